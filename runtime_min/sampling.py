"""Next-token sampling: greedy by default, temperature with nucleus (top-p) filtering otherwise.

Randomness comes only from the `torch.Generator` passed in, so a seed reproduces a generation.
"""

from __future__ import annotations

import torch

from dsneuron import UserError


def check_params(temperature: float, top_p: float) -> None:
    """UserError naming the limit for temperature < 0 or top_p outside (0, 1]."""
    if not temperature >= 0.0:
        raise UserError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p must be in (0, 1], got {top_p}")


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits fp32 [B, V] -> token ids int64 [B].

    temperature 0: argmax (the lowest id among equal maxima). Otherwise p = softmax(logits / T) in
    fp32; top-p keeps the smallest set of most probable tokens whose mass reaches top_p (at least
    one; ties in probability ordered by id), renormalises, and draws one id per row from `generator`.
    """
    check_params(temperature, top_p)
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        # stable sort so equal probabilities keep id order, making the kept set deterministic
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of strictly more probable tokens
        keep_sorted = before < top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
