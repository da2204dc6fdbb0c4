"""Manifold-constrained hyper-connections (mHC): the Sinkhorn split of a block's mixes and the
collapse / expansion of the hc copies of the stream (model.py Block.hc_pre, hc_post; official
kernel.py hc_split_sinkhorn_kernel).
"""

from __future__ import annotations

import torch
from torch._higher_order_ops.while_loop import while_loop

from dsneuron.kernels_nki.formats import SPELLING

from .numerics import row_sigmoid


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float):
    """Split mixes fp32 [B, S, (2+hc)*hc] into pre [B,S,hc], post [B,S,hc], comb [B,S,hc,hc].

    pre = sigmoid(.) + eps; post = 2*sigmoid(.); comb = exp(c - max) / sum over its last dim + eps
    (the kernel's softmax: exp of the max-shifted value divided by the row sum, which torch.softmax
    rounds differently in about 60% of the entries), then column-normalised, then iters-1 rounds of
    row- then column-normalisation, all fp32 (deepseek-ai/DeepSeek-V4.1-Flash:inference/kernel.py
    hc_split_sinkhorn_kernel).
    """
    pre = row_sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * row_sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)

    def more(i: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return i < iters - 1

    def normalise(i: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        return i + 1, c / (c.sum(dim=-2, keepdim=True) + eps)

    # torch-mlir lowers no loop op to StableHLO (torch.prim.Loop), and eagerly the loop op is a
    # torch.compile region (2-3 s to import dynamo and compile at its first call: the eager golden
    # and drafter paid it, then ~4x the loop's time a call): unrolled there, the same ATen ops
    if SPELLING.neuron or not (torch.compiler.is_exporting() or torch.compiler.is_compiling()):
        for i in range(iters - 1):
            _, comb = normalise(i, comb)
        return pre, post, comb
    # exported for the cpu target: a loop op, not an unrolled Python loop: the rounds would be a
    # fifth of the exported graph's nodes, and the compile time grows with the node count
    _, comb = while_loop(more, normalise, (torch.zeros((), dtype=torch.int64), comb))
    return pre, post, comb


def hc_pre(x: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
    """Collapse the hc copies: x bf16 [B,S,hc,D], pre_mix fp32 [B,S,hc] -> bf16 [B,S,D] (Block.hc_pre)."""
    return torch.sum(pre_mix.unsqueeze(-1) * x.float(), dim=2).to(x.dtype)


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand: out[j] = post[j]*f + sum_i comb[i,j]*residual[i], fp32 math, bf16 out (Block.hc_post).

    f bf16 [B,S,D], residual bf16 [B,S,hc,D], post [B,S,hc], comb [B,S,hc,hc] -> bf16 [B,S,hc,D].
    """
    y = post.unsqueeze(-1) * f.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=2)
    return y.to(f.dtype)
