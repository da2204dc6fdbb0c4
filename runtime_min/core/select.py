"""Bucket selection and padding.

Selection is first-fit and inclusive: a need of n uses the smallest bucket size >= n, so n equal to
a bucket uses that bucket (unlike NxDI's strict `<`), and n = b + 1 moves to the next one. Needs
above the largest bucket are a UserError naming the limit. A prompt above the largest prefill
bucket runs as a chunked prefill where the bundle has chunk buckets (runtime_min/core/runner.py
Runner.prefill_job), at the smallest chunk capacity holding it (`pick_chunk_capacity`); a batch is
never split into several calls.

Padding: prompts are right-padded to the bucket's seq_len and carry their valid length; rows added
to reach the batch bucket hold one pad token (valid length 1) and their outputs are dropped.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dsneuron import UserError


def first_fit(sizes: Sequence[int], need: int) -> int | None:
    """The smallest size >= need, or None when every size is smaller. `sizes` need not be sorted."""
    fits = [s for s in sizes if s >= need]
    return min(fits) if fits else None


def pick_batch(sizes: Sequence[int], n_prompts: int) -> int:
    """Batch bucket for n prompts; UserError naming the largest batch when none fits."""
    b = first_fit(sizes, n_prompts)
    if b is None:
        raise UserError(f"{n_prompts} prompts exceed the largest batch bucket of this bundle ({max(sizes)}, "
                        "compile.batch_sizes); pass at most that many prompts per call")
    return b


def pick_prefill(seq_lens: Sequence[int], prompt_len: int) -> int:
    """Prefill bucket for a prompt of prompt_len tokens; UserError naming the largest bucket."""
    s = first_fit(seq_lens, prompt_len)
    if s is None:
        raise UserError(f"prompt has {prompt_len} tokens; the largest prefill bucket of this bundle holds "
                        f"{max(seq_lens)} (compile.prefill_seq_lens); shorten the prompt")
    return s


def pick_chunk_capacity(capacities: Sequence[int], prompt_len: int) -> int:
    """The chunk bucket capacity a chunked prefill of prompt_len tokens runs at; UserError naming
    the context capacity (the largest) when none holds the prompt."""
    c = first_fit(capacities, prompt_len)
    if c is None:
        raise UserError(f"prompt has {prompt_len} tokens; the context capacity of this bundle is {max(capacities)} "
                        "tokens (compile.decode_context_lens; longer prompts than the largest prefill bucket run as "
                        "chunks up to it); shorten the prompt")
    return c


def pick_capacity(capacities: Sequence[int], positions: int) -> int:
    """Decode capacity holding `positions` positions (0..positions-1); UserError past the largest."""
    c = first_fit(capacities, positions)
    if c is None:
        raise UserError(f"generation needs {positions} positions; the context capacity of this bundle is "
                        f"{max(capacities)} tokens (compile.decode_context_lens)")
    return c


def pad_prompts(prompts: Sequence[Sequence[int]], batch: int, seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists into (tokens int64 [batch, seq_len], valid_len int64 [batch]).

    Rows past len(prompts) are filler: [pad_id] with valid length 1. Raises ValueError when a prompt
    is empty or longer than seq_len, or there are more prompts than rows (callers select first).
    """
    if len(prompts) > batch:
        raise ValueError(f"{len(prompts)} prompts do not fit batch {batch}")
    tokens = torch.full((batch, seq_len), pad_id, dtype=torch.int64)
    valid = torch.ones(batch, dtype=torch.int64)
    for i, ids in enumerate(prompts):
        if not 0 < len(ids) <= seq_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; must be 1..{seq_len}")
        tokens[i, :len(ids)] = torch.as_tensor(list(ids), dtype=torch.int64)
        valid[i] = len(ids)
    return tokens, valid
