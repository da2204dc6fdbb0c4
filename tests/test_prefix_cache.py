"""runtime_min/core/prefix_cache.py: longest-prefix lookup, LRU eviction under the byte budget, counters,
thread safety; a model-free property test against a dict of prefixes."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsneuron.runtime_min.core.prefix_cache import PrefixCache, Snapshot


@dataclass
class Snap:
    """A stand-in snapshot: the cache reads only nbytes."""

    name: str
    nbytes: int = 10


def test_longest_prefix_finds_the_deepest_stored_prefix_and_counts():
    c = PrefixCache(100)
    c.insert([1, 2], Snap("a"))
    c.insert([1, 2, 3, 4], Snap("b"))
    assert c.longest_prefix([1, 2, 3, 4, 5]) == (4, Snap("b"))
    assert c.longest_prefix([1, 2, 3]) == (2, Snap("a"))  # [1,2,3] itself holds no snapshot
    assert c.longest_prefix([1, 2, 3, 4], usable=lambda n, s: n <= 3) == (2, Snap("a"))
    assert c.longest_prefix([1]) is None and c.longest_prefix([9, 1, 2]) is None
    assert c.stats() == {"hits": 3, "misses": 2, "tokens_saved": 8, "bytes": 20, "entries": 2, "evictions": 0}


def test_insert_replaces_the_same_prefix():
    c = PrefixCache(100)
    c.insert([5, 6], Snap("a", 30))
    c.insert([5, 6], Snap("b", 20))
    assert c.longest_prefix([5, 6]) == (2, Snap("b", 20))
    assert c.stats()["bytes"] == 20 and len(c) == 1


def test_eviction_is_least_recently_used_first():
    c = PrefixCache(30)
    for t in (1, 2, 3):
        c.insert([t, 0], Snap(str(t)))
    assert c.longest_prefix([1, 0, 7]) == (2, Snap("1"))  # a hit makes [1,0] the most recent
    c.insert([4], Snap("4"))  # over budget: [2,0] is the least recently used
    assert c.longest_prefix([2, 0]) is None
    c.insert([5], Snap("5"))  # then [3,0]
    assert c.longest_prefix([3, 0]) is None
    assert [c.longest_prefix(p) is not None for p in ([1, 0], [4], [5])] == [True, True, True]
    assert c.stats()["evictions"] == 2 and c.stats()["bytes"] == 30


def test_eviction_prunes_the_nodes_and_keeps_longer_and_shorter_entries():
    c = PrefixCache(20)
    c.insert([1, 2, 3], Snap("long"))
    c.insert([1], Snap("short"))
    c.insert([1, 2, 3, 4, 5], Snap("longer"))  # evicts [1,2,3], not the prefixes around it
    assert c.longest_prefix([1, 2, 3, 4]) == (1, Snap("short"))
    assert c.longest_prefix([1, 2, 3, 4, 5]) == (5, Snap("longer"))
    c.insert([7], Snap("x"))
    c.insert([8], Snap("y"))  # evicts [1] and [1,2,3,4,5]: the whole branch goes
    assert 1 not in c._root.children


def test_a_zero_budget_stores_nothing_and_an_oversized_snapshot_is_refused():
    c = PrefixCache(0)
    assert not c.insert([1, 2], Snap("a", 1))
    assert c.longest_prefix([1, 2]) is None
    assert c.insert([1, 2], Snap("empty", 0))  # a 0-byte snapshot fits a 0-byte budget
    c = PrefixCache(15)
    c.insert([1], Snap("a"))
    assert not c.insert([2], Snap("big", 16))
    assert c.longest_prefix([1]) == (1, Snap("a"))  # nothing was evicted for it
    with pytest.raises(ValueError, match="at least one token"):
        c.insert([], Snap("a"))
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)


def test_snapshot_counts_its_tensors_bytes():
    s = Snapshot({"a": torch.zeros(1, 4, dtype=torch.float32), "b": torch.zeros(1, 3, dtype=torch.uint8)},
                 torch.zeros(1, 2, dtype=torch.int64))
    assert s.nbytes == 16 + 3 + 16
    assert Snapshot({"a": torch.zeros(1, 4, dtype=torch.float32)}, None).nbytes == 16
    assert Snapshot({"a": torch.zeros(1, 4, dtype=torch.float32)}, None, torch.zeros(10)).nbytes == 16 + 40


def test_longest_prefix_skips_what_usable_refuses_and_counts_only_the_match():
    c = PrefixCache(100)
    c.insert([1, 2], Snap("short"))
    c.insert([1, 2, 3], Snap("whole"))
    assert c.longest_prefix([1, 2, 3], usable=lambda n, s: n < 3)[1].name == "short"
    assert c.longest_prefix([1, 2, 3], usable=lambda n, s: s.name == "whole")[1].name == "whole"
    assert c.longest_prefix([1, 2, 3], usable=lambda n, s: False) is None
    assert c.stats()["hits"] == 2 and c.stats()["misses"] == 1 and c.stats()["tokens_saved"] == 2 + 3


def test_concurrent_inserts_and_lookups_keep_the_budget_and_the_counters():
    c = PrefixCache(50)

    def work(seed: int) -> None:
        for i in range(300):
            toks = [seed, i % 7, i % 3]
            c.insert(toks[:1 + i % 3], Snap(f"{seed}-{i}", 7))
            c.longest_prefix(toks)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = c.stats()
    assert s["hits"] + s["misses"] == 4 * 300 and s["bytes"] == 7 * s["entries"] <= 50


token_lists = st.lists(st.integers(0, 5), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), token_lists, st.integers(0, 40)), max_size=40), st.integers(0, 100))
def test_matches_a_model_of_prefixes_in_lru_order(ops, budget):
    """Against a plain model: an ordered dict {prefix: snapshot} evicted from its front."""
    c, model = PrefixCache(budget), {}
    for is_insert, toks, size in ops:
        key = tuple(toks)
        if is_insert:
            snap = Snap(str(key), size)
            stored = c.insert(toks, snap)
            assert stored == (size <= budget)
            if stored:
                model.pop(key, None)
                model[key] = snap
                while sum(s.nbytes for s in model.values()) > budget:
                    model.pop(next(iter(model)))
        else:
            got = c.longest_prefix(toks)
            hits = [k for k in model if key[:len(k)] == k]
            if not hits:
                assert got is None
            else:
                best = max(hits, key=len)
                assert got == (len(best), model[best])
                model[best] = model.pop(best)
        assert c.stats()["bytes"] == sum(s.nbytes for s in model.values()) <= budget
        assert len(c) == len(model)
