"""The prefix cache's data structure: token prefixes -> state snapshots, LRU under a byte budget.

A request whose prompt starts with a cached prefix of n tokens starts from a copy of that prefix's
snapshot and prefills only the rest through the chunk graph (graphs/steps.py prefill_chunk). That is
bit-identical to the request without the cache because a prefill row, a chunk row and a decode step
at one position compute the same bits (graphs/model.py: one index-list layout, prefill's state as
decode leaves it), so a snapshot can be taken at any token: at the end of a prompt's prefill, at a
chunk boundary, or when a request ends (prompt plus completion, what a chat's next turn resends).

The keys form a trie over token ids (one node per token; a node holds at most one snapshot); the
snapshots are opaque here: any object with an int `nbytes` (`Snapshot` is the one the runtime
stores). Entries are evicted least recently used first (an insert or a hit uses an entry) until
their bytes fit `max_bytes`. All methods are thread-safe (one lock; each call is O(len(tokens))
plus the evictions it causes). The scheduler owns copying a snapshot before running from it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch


@dataclass
class Snapshot:
    """What a request needs to continue after a prefix of n tokens.

    state: {name: tensor [1, ...]} the state row after the prefix (graphs/steps.py state_layout at
    batch 1: every cache, the compressor's pending group); engram_history: the last
    max_ngram_size - 1 token ids the engram hasher keeps (int64 [1, H]), None for a bundle that
    hashes no engram ids; logits: fp32 [V], the logits after the prefix's last token where the
    call that fed it gave them (a prefill or chunk call), else None. A request whose whole prompt
    is a cached prefix can start only from a snapshot with logits (its first token is sampled from
    them); any shorter prefix leaves at least one token whose call gives them
    (runtime_min/core/scheduler.py). nbytes: their bytes together, what the cache's budget counts.
    """

    state: dict[str, torch.Tensor]
    engram_history: torch.Tensor | None
    logits: torch.Tensor | None = None
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        tensors = [*self.state.values(), *(t for t in (self.engram_history, self.logits) if t is not None)]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)


class _Node:
    """A trie node: the prefix spelled by the path from the root. `parent` and `token` let an
    evicted entry prune its childless, snapshot-less nodes back towards the root."""

    __slots__ = ("children", "parent", "token", "snapshot")

    def __init__(self, parent: _Node | None, token: int | None):
        self.children: dict[int, _Node] = {}
        self.parent, self.token = parent, token
        self.snapshot: Any = None


class PrefixCache:
    """Token prefixes -> snapshots, at most `max_bytes` of them (sum of their `nbytes`).

    insert(tokens, snapshot) stores a snapshot for exactly that prefix; longest_prefix(tokens)
    finds the longest stored prefix of tokens. Counters: hits and misses (of longest_prefix),
    tokens_saved (the matched lengths of the hits), bytes and entries held now, evictions.
    max_bytes 0 stores nothing (every lookup misses). Raises ValueError for a negative budget.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"PrefixCache: max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._root = _Node(None, None)
        # the nodes holding a snapshot, least recently used first
        self._lru: OrderedDict[_Node, None] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.tokens_saved = self.bytes = self.evictions = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def insert(self, tokens: Sequence[int], snapshot: Any) -> bool:
        """Store `snapshot` (an object with int `nbytes`) as the state after `tokens` (>= 1 token
        ids), replacing one stored for the same tokens, then evict least recently used entries
        until the budget holds. Returns False (storing nothing, evicting nothing) when the snapshot
        alone exceeds max_bytes. Raises ValueError for an empty prefix or a negative nbytes."""
        if len(tokens) == 0:
            raise ValueError("PrefixCache.insert: the prefix must have at least one token")
        size = int(snapshot.nbytes)
        if size < 0:
            raise ValueError(f"PrefixCache.insert: nbytes must be >= 0, got {size}")
        if size > self.max_bytes:
            return False
        with self._lock:
            node = self._root
            for t in tokens:
                node = node.children.setdefault(int(t), _Node(node, int(t)))
            if node.snapshot is not None:
                self.bytes -= node.snapshot.nbytes
            node.snapshot = snapshot
            self.bytes += size
            self._lru[node] = None
            self._lru.move_to_end(node)
            while self.bytes > self.max_bytes:
                self._evict(next(iter(self._lru)))
            return True

    def longest_prefix(self, tokens: Sequence[int],
                       usable: Callable[[int, Any], bool] | None = None) -> tuple[int, Any] | None:
        """(n, snapshot) of the longest stored prefix tokens[:n] for which usable(n, snapshot) is
        true (every one when None), counted as a hit of n tokens and made the most recently used;
        None (a miss) when no stored prefix matches."""
        with self._lock:
            node, best = self._root, None
            for n in range(len(tokens)):
                node = node.children.get(int(tokens[n]))
                if node is None:
                    break
                if node.snapshot is not None and (usable is None or usable(n + 1, node.snapshot)):
                    best = (n + 1, node)
            if best is None:
                self.misses += 1
                return None
            n, node = best
            self._lru.move_to_end(node)
            self.hits += 1
            self.tokens_saved += n
            return n, node.snapshot

    def stats(self) -> dict[str, int]:
        """The counters, for /metrics: hits, misses, tokens_saved, bytes, entries, evictions."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "tokens_saved": self.tokens_saved, "bytes": self.bytes,
                    "entries": len(self._lru), "evictions": self.evictions}

    def _evict(self, node: _Node) -> None:
        """Drop node's snapshot and the nodes that then lead to no snapshot (lock held)."""
        self.bytes -= node.snapshot.nbytes
        node.snapshot = None
        del self._lru[node]
        self.evictions += 1
        while node.parent is not None and node.snapshot is None and not node.children:
            del node.parent.children[node.token]
            node = node.parent
