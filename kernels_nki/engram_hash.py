"""Host-side engram n-gram hashing, driven only by the plain-data parameters of the bundle manifest.

Reproduces deepseek-ai/DeepSeek-V4.1-Flash:inference/engram.py NgramHashState.forward in int64 for
text-only input (basic mode: no image spans, so no DEAD tokens and no look-back blocking inside a
sequence). For each position t, engram layer l and n in 2..max_ngram_size:

    tok[k]  = token_map[id at t - k], or pad_id when t - k is before the sequence start  (k = 0..n-1)
    rolling = XOR_k (tok[k] * multipliers[l][k])
    id      = rolling % primes[l][n - 2][head] + offsets[l][(n - 2) * n_heads + head]

Products cannot overflow: the multipliers are bounded by int64_max / compressed_vocab_size.

State lifecycle: instead of the reference's [B, max_seq_len] cache of compressed ids, a caller keeps
the last max_ngram_size - 1 compressed ids per batch row as an explicit `history` [B, max_ngram_size
- 1] int64 (oldest first), starting as all pad_id (`initial_history`), which is exactly what the
reference reads before the sequence start. `hash` takes a prefill chunk or one decode token plus
the history and returns the ids and the next history. Positions at or past a row's `valid_len` (the
right padding of a prefill bucket) get the pad hash, the id of an all-pad n-gram: a valid table row
whose value nobody uses; they never enter the history. This module imports neither graphs nor compiler.
"""

from __future__ import annotations

from typing import Any

import torch

_KEYS = ("layer_ids", "max_ngram_size", "n_heads", "compressed_vocab_size", "pad_id", "token_map",
         "multipliers", "primes", "offsets", "num_embeddings")


class NgramHasher:
    """Engram hash ids from token ids, for every engram layer at once.

    params: the dict written by `dsneuron.graphs.engram.EngramParams.to_dict()` (keys layer_ids,
    max_ngram_size, n_heads, compressed_vocab_size, pad_id, token_map, multipliers, primes, offsets,
    num_embeddings; shapes in that class's docstring). Raises ValueError naming the first key that is
    missing or inconsistent.
    """

    def __init__(self, params: dict[str, Any]):
        missing = [k for k in _KEYS if k not in params]
        if missing:
            raise ValueError(f"engram params: missing key {missing[0]!r}")
        self.n_layers = len(params["layer_ids"])
        self.max_ngram_size = int(params["max_ngram_size"])
        self.n_heads = int(params["n_heads"])
        self.history_len = self.max_ngram_size - 1
        self.n_cols = self.history_len * self.n_heads
        if self.max_ngram_size < 2 or self.n_heads < 1:
            raise ValueError("engram params: max_ngram_size must be >= 2 and n_heads >= 1")
        L, N, H = self.n_layers, self.max_ngram_size, self.n_heads
        self.token_map = _tensor(params, "token_map", (len(params["token_map"]),))
        self.multipliers = _tensor(params, "multipliers", (L, N))
        self.primes = _tensor(params, "primes", (L, N - 1, H))
        self.offsets = _tensor(params, "offsets", (L, (N - 1) * H))
        self.num_embeddings = _tensor(params, "num_embeddings", (L,))
        self.pad_id = int(params["pad_id"])
        ncls = int(params["compressed_vocab_size"])
        if not 0 <= self.pad_id < ncls:
            raise ValueError(f"engram params: pad_id {self.pad_id} outside 0..compressed_vocab_size-1={ncls - 1}")
        if self.token_map.numel() and (int(self.token_map.min()) < 0 or int(self.token_map.max()) >= ncls):
            raise ValueError("engram params: token_map entries must lie in 0..compressed_vocab_size-1")
        if bool((self.multipliers <= 0).any()) or bool((self.multipliers > (2**63 - 1) // ncls).any()):
            raise ValueError("engram params: multipliers must be positive and keep id * multiplier within int64")
        if bool((self.primes < 2).any()):
            raise ValueError("engram params: primes must be >= 2")
        if L and not torch.equal(self.offsets[:, -1] + self.primes[:, -1, -1], self.num_embeddings):
            raise ValueError("engram params: offsets + primes do not add up to num_embeddings")
        self.vocab_size = self.token_map.numel()
        self.pad_hash = self._hash_window(torch.full((1, 1, N), self.pad_id, dtype=torch.int64))[0, 0]

    def initial_history(self, batch: int) -> torch.Tensor:
        """History before any token: int64 [batch, max_ngram_size - 1] filled with pad_id."""
        return torch.full((batch, self.history_len), self.pad_id, dtype=torch.int64)

    def hash(self, tokens: torch.Tensor, history: torch.Tensor,
             valid_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Hash a chunk of tokens that follows `history`.

        tokens: int [B, L] model token ids (prefill chunk, or L = 1 for a decode step);
        history: int64 [B, max_ngram_size - 1], compressed ids of the tokens before this chunk
            (oldest first), `initial_history(B)` at a sequence start;
        valid_len: int [B] in 0..L, or None for all L; positions >= valid_len[b] are padding.
        Returns (ids int64 [B, L, n_layers, (max_ngram_size - 1) * n_heads] in 0..num_embeddings-1
        of each layer, with the pad hash at padded positions; next history int64 [B,
        max_ngram_size - 1]: the last max_ngram_size - 1 compressed ids up to valid_len).
        Raises ValueError for a bad shape or a valid token id outside 0..vocab_size-1.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, L], got shape {tuple(tokens.shape)}")
        B, L = tokens.shape
        if tuple(history.shape) != (B, self.history_len):
            raise ValueError(f"history must be [{B}, {self.history_len}], got {tuple(history.shape)}")
        tokens = tokens.long()
        valid = torch.ones(B, L, dtype=torch.bool)
        if valid_len is not None:
            valid_len = valid_len.long()
            if tuple(valid_len.shape) != (B,) or bool((valid_len < 0).any()) or bool((valid_len > L).any()):
                raise ValueError(f"valid_len must be [{B}] with entries in 0..{L}")
            valid = torch.arange(L) < valid_len[:, None]
        real = tokens[valid]
        if real.numel() and (int(real.min()) < 0 or int(real.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in 0..{self.vocab_size - 1}")
        cid = torch.where(valid, self.token_map[torch.where(valid, tokens, 0)], self.pad_id)
        ext = torch.cat([history.long(), cid], dim=1)  # [B, H + L]; token t sits at column H + t
        H = self.history_len
        window = torch.stack([ext[:, H - k: H - k + L] for k in range(self.max_ngram_size)], dim=-1)
        ids = torch.where(valid[..., None, None], self._hash_window(window), self.pad_hash)
        end = (valid_len if valid_len is not None else torch.full((B,), L, dtype=torch.long))
        new_history = ext.gather(1, end[:, None] + torch.arange(H))
        return ids, new_history

    def hash_sequence(self, tokens: torch.Tensor) -> torch.Tensor:
        """Stateless: hash whole sequences that start at position 0. tokens int [B, L] ->
        int64 [B, L, n_layers, (max_ngram_size - 1) * n_heads]."""
        return self.hash(tokens, self.initial_history(tokens.shape[0]))[0]

    def _hash_window(self, window: torch.Tensor) -> torch.Tensor:
        """window int64 [B, L, max_ngram_size] (k = tokens back) -> ids [B, L, n_layers, n_cols]."""
        products = window[:, :, None, :] * self.multipliers  # [B, L, n_layers, max_ngram_size]
        rolling = products[..., 0]
        cols = []
        for n in range(1, self.max_ngram_size):
            rolling = torch.bitwise_xor(rolling, products[..., n])
            cols.append(rolling[..., None] % self.primes[:, n - 1])  # [B, L, n_layers, n_heads]
        return torch.cat(cols, dim=-1) + self.offsets


def _tensor(params: dict[str, Any], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    try:
        t = torch.tensor(params[key], dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ValueError(f"engram params: {key!r} is not a nested list of int64 ({e})") from None
    if t.numel() == 0 and 0 in shape:
        t = t.reshape(shape)  # an empty nested list loses its inner dims
    if tuple(t.shape) != shape:
        raise ValueError(f"engram params: {key!r} has shape {tuple(t.shape)}, expected {shape}")
    return t
