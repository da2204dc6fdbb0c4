"""Next-token sampling: greedy by default, temperature with nucleus (top-p) filtering otherwise.

Randomness comes only from the `torch.Generator` passed in, so a seed reproduces a generation.

Temperature rule (checked by runtime_min/core/checks.py check_params): any finite T >= 0. T = 0 is greedy; any positive finite T is valid, however small
or large, because the probabilities are computed in float64 as softmax((logits - max) / T): the
numerator is <= 0, so the quotient is at worst -inf (probability 0) and never inf or NaN. A tiny T
therefore tends to greedy (ties shared evenly) and a huge T to the uniform distribution.
"""

from __future__ import annotations

import torch

from dsneuron import UserError

from .checks import check_params


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """logits fp32 [B, V] -> token ids int64 [B].

    allowed: bool [V] (or [B, V]), the only tokens that may be drawn (a grammar's mask,
    runtime_min/serving/grammar.py; at least one True a row): the others' logits are -inf first.

    temperature 0: argmax (the lowest id among equal maxima). Otherwise p = softmax((logits - max)
    / T) in float64 (module docstring: safe for every positive finite T); top-p keeps the smallest
    set of most probable tokens whose mass reaches top_p (at least one; ties in probability ordered
    by id), renormalises, and draws one id per row from `generator`. Raises UserError as
    `check_params`.
    """
    check_params(temperature, top_p)
    if temperature == 0.0:
        return (logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))).argmax(dim=-1)
    return torch.multinomial(probabilities(logits, temperature, top_p, allowed), 1, generator=generator)[:, 0]


def probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution `sample` draws from at temperature > 0: float64 [..., V] (the softmax, the
    top-p filter, renormalised; `allowed` as in `sample`). Speculative decoding's target
    distribution p (runtime_min/core/speculative.py). Raises UserError as `check_params`, and for
    temperature 0 (greedy has no distribution to draw from)."""
    check_params(temperature, top_p)
    if temperature == 0.0:
        raise UserError("probabilities: temperature 0 is greedy (argmax), not a distribution")
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    x = logits.double()
    probs = torch.softmax((x - x.amax(dim=-1, keepdim=True)) / temperature, dim=-1)
    if top_p < 1.0:
        # stable sort so equal probabilities keep id order, making the kept set deterministic
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of strictly more probable tokens
        keep_sorted = before < top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
