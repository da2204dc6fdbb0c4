"""Reads and writes of rows of the state caches with static shapes (a ring slot, a run of slots,
the leading slots), per batch row, so one graph serves every position.

A one-row write (`write_slot`: a decode step's window ring and compressed rows) is functional by
default: a new cache with the row written. Within `writes_in_place()` it writes the row into the
cache it was given instead and returns that tensor: the cpu target traces its decode stages so
(graphs/stages.py AttnStage.in_place_names), since the functional write compiles to a copy of the whole
cache each step, stored 8 bytes at a time into freshly allocated memory; on tiny that was about
1 ms of a 28 ms decode step (perf on 2026-12-06), growing with the capacity and the batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_IN_PLACE = False


@contextmanager
def writes_in_place() -> Iterator[None]:
    """While active, `write_slot` writes into the cache it is given (module docstring)."""
    global _IN_PLACE
    before, _IN_PLACE = _IN_PLACE, True
    try:
        yield
    finally:
        _IN_PLACE = before


def leading(cache: torch.Tensor, n: int) -> torch.Tensor:
    """cache [B,C,...] -> its first n slots [B,n,...]. An index_select rather than a slice: for B > 1
    the slice of a longer cache is strided, and a later op's contiguity check would specialise a
    dynamic token count n to C."""
    if isinstance(n, int) and n == cache.size(1):  # (comparing a symbolic n would specialise it)
        return cache
    return cache.index_select(1, torch.arange(n, device=cache.device))


def slot_index(slot: torch.Tensor, X: int) -> torch.Tensor:
    """slot int64 [B] -> the gather / scatter index int64 [B,1,X] of row slot[b] of a [B,C,X] cache."""
    return slot.view(-1, 1, 1).expand(-1, 1, X)


def write_slot(cache: torch.Tensor, row: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """cache [B,C,X] with row [B,1,X] written at slot [B] (int64, 0 <= slot < C), the rest as it was.
    A scatter: Inductor makes it a copy of the cache and one row's store, where a where() over the
    cache tests every element's slot (a decode step's cache writes went 4.2 -> ~0.3 ms on tiny).
    Within `writes_in_place()`: `cache` itself, the row written into it by an index_put_, which
    Inductor compiles to the row's store alone (it keeps a copy for an in-place scatter_)."""
    if _IN_PLACE:
        return cache.index_put_((torch.arange(cache.size(0), device=cache.device), slot), row[:, 0])
    return cache.scatter(1, slot_index(slot, cache.size(2)), row)


# ----------------------------------------------------------------------------------------- chunks
def newest_positions(start: torch.Tensor, count: torch.Tensor, n: int) -> torch.Tensor:
    """The ring of n slots after positions start .. start+count-1 were written in order (slot =
    position % n): int64 [B, n], slot j's newest position t < start + count with t % n == j
    (negative where no position ever reached slot j). start, count int64 [B]."""
    last = (start + count - 1).unsqueeze(1)  # [B,1]
    slots = torch.arange(n, device=start.device)
    return slots + n * torch.div(last - slots, n, rounding_mode="floor")


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slot0: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
    """cache [B,C,X] with rows [B,G,X] written at slots slot0[b] + j (int64 [B]) where write [B,G]
    is True, the other slots as they were. A where over the cache (row j's slot computed per cache
    slot), so rows past the cache or not written never collide with a written one."""
    B, C, X = cache.shape
    G = rows.size(1)
    j = torch.arange(C, device=cache.device).unsqueeze(0) - slot0.unsqueeze(1)  # [B,C]: the row landing in slot c
    inside = (j >= 0) & (j < G)
    jc = j.clamp(0, G - 1)
    take = inside & write.gather(1, jc)
    return torch.where(take.unsqueeze(-1), rows.gather(1, jc.unsqueeze(-1).expand(B, C, X)), cache)


def write_groups(cache: torch.Tensor, rows: torch.Tensor, write: torch.Tensor, slot0: torch.Tensor | None) -> torch.Tensor:
    """cache [B,C,X] with rows [B,G,X] written at slots 0..G-1 (prefill, slot0 None) or at slot0[B]
    (decode, G == 1), only where write [B,G] is True."""
    B, C, X = cache.shape
    if slot0 is None:
        G = rows.size(1)
        fresh = torch.where(write.unsqueeze(-1), rows, leading(cache, G))
        # index_copy, not a cat with cache[:, G:]: that slice is empty when the prompt fills the
        # cache, and a graph with a dynamic token count must not depend on it being empty
        return cache.index_copy(1, torch.arange(G, device=cache.device), fresh)
    keep = write & (slot0 < C).unsqueeze(1)  # [B,1]: a slot past the cache writes nothing
    slot = slot0.clamp(max=C - 1)
    return write_slot(cache, torch.where(keep.unsqueeze(-1), rows, cache.gather(1, slot_index(slot, X))), slot)
