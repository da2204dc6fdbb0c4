"""The checks of a generation's inputs, in one place for every interface: `dsneuron run` (before
the bundle loads), the Python API (runtime_min/session.py) and the server (Scheduler.check).

Each check raises ParamError naming the parameter and its limit. An interface passes the names
its users type (`names`: the CLI's flags, the OpenAI API's `max_tokens`), so the message and
`ParamError.param` speak its language while the rule stays here.
"""

from __future__ import annotations

import math
from typing import Mapping

from dsneuron import UserError

#: seeds are taken by torch.Generator.manual_seed as an unsigned 64-bit integer
SEED_LIMIT = 2**64


class ParamError(UserError, ValueError):
    """An input outside its range; `param` is its name as the interface spells it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_params(temperature: float, top_p: float, names: Mapping[str, str] | None = None) -> None:
    """ParamError naming the limit for a temperature that is not a finite number >= 0, or a top_p
    outside (0, 1] (runtime_min/core/sampling.py: why any positive finite temperature is safe)."""
    names = names or {}
    try:
        ok = temperature >= 0.0 and math.isfinite(temperature)
    except TypeError:  # not a number: refused by name like a value out of range
        ok = False
    if not ok:
        name = names.get("temperature", "temperature")
        raise ParamError(f"{name} must be a finite number >= 0 (0 = greedy), got {temperature}", name)
    try:
        ok = 0.0 < top_p <= 1.0
    except TypeError:
        ok = False
    if not ok:
        name = names.get("top_p", "top_p")
        raise ParamError(f"{name} must be in (0, 1], got {top_p}", name)


def check_seed(seed: int | None, name: str = "seed") -> None:
    """ParamError unless `seed` is None (fresh entropy) or an integer in 0..2**64-1, the range of
    torch.Generator.manual_seed (which would overflow above it and wrap negative seeds around)."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ParamError(f"{name} must be an integer in 0..{SEED_LIMIT - 1} (2**64 - 1), got {seed!r}", name)


def check_context(prompt_len: int, max_new_tokens: int, capacity: int, name: str = "max_new_tokens") -> None:
    """ParamError naming the limit unless a prompt of `prompt_len` tokens can generate
    `max_new_tokens` tokens within `capacity` positions: prompt_len + max_new_tokens - 1 <= capacity
    (the prefill holds positions 0..prompt_len-1 and the last new token is sampled but never fed
    back, so it takes no position; a speculative verify drafts no further than that either).
    `name`: the parameter's name in the message."""
    needed = prompt_len + max_new_tokens - 1
    if needed > capacity:
        raise ParamError(f"prompt of {prompt_len} tokens + {name} {max_new_tokens} needs {needed} positions "
                         f"(prompt + new tokens - 1: the last new token is not fed back), which exceeds the context "
                         f"capacity of this bundle, {capacity} tokens (compile.decode_context_lens); use "
                         f"{name} <= {capacity - prompt_len + 1}", name)


def check_generation(max_new_tokens: int, temperature: float, top_p: float, seed: int | None,
                     names: Mapping[str, str] | None = None, context: tuple[int, int] | None = None) -> None:
    """The checks of one generation's parameters, first fault first: max_new_tokens a positive
    integer, then, with `context` = (prompt_len, capacity), within the context (`check_context`),
    then temperature and top_p (`check_params`) and the seed (`check_seed`). names: the
    interface's name of each parameter (keys max_new_tokens, temperature, top_p, seed), by default
    these. Raises ParamError."""
    names = names or {}
    name = names.get("max_new_tokens", "max_new_tokens")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ParamError(f"{name} must be a positive integer, got {max_new_tokens!r}", name)
    if context is not None:
        check_context(context[0], max_new_tokens, context[1], name)
    check_params(temperature, top_p, names)
    check_seed(seed, names.get("seed", "seed"))
