"""Rotary position embedding of the graphs: the cos/sin tables and their application to the rope
tail of a vector (model.py precompute_freqs_cis, apply_rotary_emb).

- RoPE is applied with explicit real arithmetic in fp32 (no complex tensors in the graph), on
  cos/sin tables taken from torch.polar as the reference's freqs_cis is; the reference's complex
  multiply rounds each of its two products and their sum as the real form does. Measured on tiny's
  three shipped prompts (inverse RoPE of every layer's attention output): 0 of 4.6M bf16 elements
  differ from the complex form (16 did with torch.cos/torch.sin tables).
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def rope_tables(cfg: ModelConfig, max_seq_len: int, compressed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [max_seq_len, rd/2] of one layer kind (model.py precompute_freqs_cis).

    compressed=True: layers with compress ratio > 0 use compress_rope_theta with YaRN
    (original_seq_len, rope_factor, beta_fast, beta_slow); ratio-0 layers use rope_theta, no YaRN.
    """
    rd = cfg.rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    orig = cfg.original_seq_len if compressed else 0
    freqs = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    if orig > 0:
        def corrected_dim(rotations: float) -> float:
            return rd * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(cfg.beta_fast)), 0)
        high = min(math.ceil(corrected_dim(cfg.beta_slow)), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    angle = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    # torch.polar, as the reference builds freqs_cis: its cos/sin differ from torch.cos/torch.sin
    # in the last fp32 bit on ~5% of the entries, which moved 16 of 4.6M bf16 elements of the
    # inverse RoPE on tiny's prompts; with the polar tables none (see "RoPE" in the module docstring)
    rot = torch.polar(torch.ones_like(angle), angle)
    return rot.real.contiguous(), rot.imag.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last rd dims of x (bf16 [B, S, rd] or [B, S, H, rd]) as interleaved pairs.

    cos/sin: fp32 [B, S, rd/2] (per-row positions). Pairs (x[2i], x[2i+1]) are complex numbers
    multiplied by exp(i*angle) (conjugate when inverse) in fp32, written back in x.dtype
    (model.py apply_rotary_emb).
    """
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if inverse:
        sin = -sin
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


def with_rope_tail(x: torch.Tensor, rd: int, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x with RoPE applied to its last rd dims only (functional form of the reference's in-place op)."""
    return torch.cat([x[..., :-rd], apply_rope(x[..., -rd:], cos, sin, inverse)], dim=-1)
