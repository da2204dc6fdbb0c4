"""The mean of a residual stream over its hc copies, as the DSpark drafter reads the target's hidden
states: one op below both graphs/ and runtime_min/ so the golden and the runtime round alike."""

from __future__ import annotations

import torch


def main_hidden_of(h: torch.Tensor) -> torch.Tensor:
    """The mean over the hc copies of a stream h bf16 [B,S,hc,D] -> bf16 [B,S,D]
    (deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py Transformer.forward, `h.mean(dim=2)` of the
    stream entering a DSpark target layer): an fp32 sum of the hc values, divided by hc (a power of
    two: exact), one bf16 rounding. The golden (graphs/dspark.py) and the runtime
    (runtime_min/core/runner.py) share it so both round alike."""
    return (h.float().sum(dim=2) / h.size(2)).to(torch.bfloat16)
