"""What one call of the model knows about its tokens (`StepInputs`: step kind, positions, RoPE at
them), shared by every layer, and the optional record of every stage's tensors (`Capture`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Capture:
    """Optional record of every stage's inputs and outputs (eager only), keyed `layers.3.attn.out`.

    Tensors are detached copies, so a stage can be re-run alone from them.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __call__(self, name: str, t: torch.Tensor | None) -> None:
        if t is not None:
            self.tensors[name] = t.detach().clone()


def record(cap: Capture | None, name: str, t: torch.Tensor | None) -> None:
    if cap is not None:
        cap(name, t)


@dataclass
class StepInputs:
    """What one call knows about its tokens, shared by every layer.

    prefill: pos is None, valid_len [B] int64 (tokens at >= valid_len are right padding);
    decode: S == 1, pos [B] int64 the position of each row's token, valid_len is None;
    chunk (a prefill continuing from state, `chunk`): pos [B] int64 the position of each row's
    first token, valid_len [B] int64 its tokens in this call (1..S, right padding after).
    rope: cos/sin fp32 [B, S, rd/2] of both layer kinds (False: ratio 0, True: compressed) at the
    tokens' positions; tables: the full [max_seq_len, rd/2] tables, for compressed-group positions.
    """

    seqlen: int
    valid_len: torch.Tensor | None
    pos: torch.Tensor | None
    rope: dict[bool, tuple[torch.Tensor, torch.Tensor]]
    tables: dict[bool, tuple[torch.Tensor, torch.Tensor]]
    capture: Capture | None = None

    def rope_at(self, positions: torch.Tensor, compressed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin fp32 [..., rd/2] at int64 positions of any shape."""
        cos, sin = self.tables[compressed]
        return cos[positions], sin[positions]

    @property
    def prefill(self) -> bool:
        return self.pos is None

    @property
    def chunk(self) -> bool:
        """A chunk: tokens at positions pos .. pos + valid_len - 1 read and extend the state as
        that many decode steps in order would (graphs/steps.py prefill_chunk)."""
        return self.pos is not None and self.valid_len is not None


def step_inputs(owner: nn.Module, seqlen: int, positions: torch.Tensor, valid_len: torch.Tensor | None,
                pos: torch.Tensor | None, capture: Capture | None = None) -> StepInputs:
    """The per-call context for tokens at int64 positions [B,S], with the RoPE tables held by
    `owner` as buffers rope_cos_0/1, rope_sin_0/1 (the Transformer, or a stage module)."""
    tables = {c: (getattr(owner, f"rope_cos_{int(c)}"), getattr(owner, f"rope_sin_{int(c)}")) for c in (False, True)}
    rope = {c: (cos[positions], sin[positions]) for c, (cos, sin) in tables.items()}
    return StepInputs(seqlen, valid_len, pos, rope, tables, capture)
