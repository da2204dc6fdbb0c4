"""Engram n-gram hashing parameters: table layout (primes, offsets), hash multipliers, token map.

Follows deepseek-ai/DeepSeek-V4.1-Flash:inference/engram.py (`find_next_prime`,
`build_compressed_token_map`, `compute_hash_multipliers`, `EngramLayout.from_args`,
`NgramHashState.__init__`). Everything the host-side hash needs is derived here from the config and
the tokenizer and handed out as plain data (`EngramParams.to_dict()`), which the bundle manifest
carries to `dsneuron.kernels_nki.engram_hash.NgramHasher`.

- Layout: each engram layer hashes every position into (max_ngram_size - 1) n-gram sizes x n_heads
  heads; each (n-gram size, head) owns a prime-sized range of the layer's table. The primes are the
  consecutive primes >= engram_vocab_size, handed out in (layer, n-gram size, head) order and never
  reused. The reference restarts each n-gram size's search at engram_vocab_size - 1 and skips the
  primes already used, which yields exactly that sequence. A layer's table has sum-of-its-primes rows;
  offsets are the exclusive prefix sums of its flattened primes (column order: 2-gram heads, 3-gram
  heads, ...).
- Token map: every tokenizer id is decoded alone and normalised (NFKC, NFD, strip accents,
  lowercase, whitespace runs -> one space, a lone space kept via a private-use sentinel, strip);
  ids whose normalised text is equal share one compressed id, numbered in order of first appearance.
  A token decoding to U+FFFD (a partial UTF-8 byte sequence) is keyed by its raw token string; a
  token normalising to "" is keyed by its decoded text.
- Model ids the tokenizer does not have (vocab_size > tokenizer size; not the case for the packaged
  tokenizer, where both are 129280) map to the compressed id of `engram_pad_id`: such ids carry no
  text, so they hash like the padding before a sequence start. They add no class, so the compressed
  vocab size (which every multiplier depends on) stays the one the reference computes. The
  reference itself has no rule: its lookup would fail on such an id.
- Multipliers: per layer, `np.random.default_rng(10007 * layer_id).integers(0, bound,
  size=max_ngram_size, dtype=int64) * 2 + 1` with bound = max(1, (int64_max // compressed_vocab_size)
  // 2), so every product id * multiplier fits in int64.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import Regex, normalizers

from dsneuron.disk import default_cache_dir

from .config import ConfigError, ModelConfig
from .tokenizer import default_tokenizer_path, load_tokenizer

# Deterministic Miller-Rabin: these 12 bases decide primality exactly for every n below this bound
# (Sorenson and Webster 2015), far above any engram table size.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
_MR_LIMIT = 3_317_044_064_679_887_385_961_981


def is_prime(n: int) -> bool:
    """Exact primality of a Python int 0 <= n < 3.3e24 (deterministic Miller-Rabin).

    Raises ValueError outside that range.
    """
    if not 0 <= n < _MR_LIMIT:
        raise ValueError(f"is_prime: {n} is outside the range [0, {_MR_LIMIT}) where the test is exact")
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _primes_from(start: int):
    """Primes >= start, ascending."""
    return (n for n in itertools.count(max(start, 2)) if is_prime(n))


@dataclass(frozen=True)
class EngramLayout:
    """Bucket layout of the engram hash tables; depends on the config only (no tokenizer).

    primes[layer][n - 2][head]: the modulus of the n-gram-size-n, head-`head` sub-table of engram
    layer `layer` (index into layer_ids). Source: inference/engram.py EngramLayout.from_args.
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    vocab_size: int  # engram_vocab_size: the primes start at it
    primes: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def n_cols(self) -> int:
        """Hash ids per position and layer: (max_ngram_size - 1) * n_heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def flat_primes(self) -> tuple[tuple[int, ...], ...]:
        """[layer][col] with col = (n - 2) * n_heads + head, the column order of the hash ids."""
        return tuple(tuple(p for per_n in layer for p in per_n) for layer in self.primes)

    @property
    def num_embeddings(self) -> tuple[int, ...]:
        """Table rows per engram layer: the sum of that layer's primes."""
        return tuple(sum(f) for f in self.flat_primes)

    @property
    def offsets(self) -> tuple[tuple[int, ...], ...]:
        """[layer][col]: first table row of each sub-table (exclusive prefix sums of flat_primes)."""
        return tuple(tuple(itertools.accumulate(f[:-1], initial=0)) for f in self.flat_primes)


@functools.lru_cache(maxsize=16)
def _layout(layer_ids: tuple[int, ...], max_ngram: int, n_heads: int, head_dim: int, vocab: int) -> EngramLayout:
    draw = _primes_from(vocab)
    primes = tuple(tuple(tuple(next(draw) for _ in range(n_heads)) for _ in range(max_ngram - 1))
                   for _ in layer_ids)
    return EngramLayout(layer_ids, max_ngram, n_heads, head_dim, vocab, primes)


def engram_layout(cfg: ModelConfig) -> EngramLayout:
    """The table layout of `cfg` (an empty layout when cfg has no engram layers). Cached."""
    return _layout(tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                   cfg.engram_head_dim, cfg.engram_vocab_size)


def _token_normalizer() -> normalizers.Normalizer:
    # a private-use char stands in for a token that is exactly one space, so that Strip() does not
    # turn it into "" and merge it with unrelated tokens (inference/engram.py)
    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(),
        normalizers.Replace(sentinel, " "),
    ])


def build_compressed_token_map(tokenizer: tokenizers.Tokenizer) -> tuple[list[int], int]:
    """(lookup, n_classes): lookup[id] is the compressed id of every tokenizer id (with added tokens).

    Source: inference/engram.py build_compressed_token_map (raw Rust decode with special tokens
    kept, no clean-up of spaces). About 1 s for the 129,280-token V4 tokenizer.
    """
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    norm = _token_normalizer()
    texts = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    classes: dict[str, int] = {}
    lookup = []
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        lookup.append(classes.setdefault(key, len(classes)))
    return lookup, len(classes)


@functools.lru_cache(maxsize=4)
def _cached_token_map(path: str) -> tuple[tuple[int, ...], int]:
    try:
        data = Path(path).read_bytes()
    except OSError:
        data = None  # load_tokenizer names the problem
    stored = None
    if data is not None:
        key = hashlib.sha256(data + f"\0tokenizers {tokenizers.__version__}".encode()).hexdigest()
        stored = default_cache_dir() / "token-maps" / f"{key}.npy"
        try:
            row = np.load(stored)
            if _valid_token_map(row):
                return tuple(row[1:].tolist()), int(row[0])
        except Exception:  # noqa: BLE001 - any unreadable file is rebuilt (np.load: EOFError, ValueError, ...)
            pass
    lookup, n = build_compressed_token_map(load_tokenizer(path))
    if stored is not None:
        tmp = stored.with_name(f".{stored.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.npy")
        try:  # a private name, then one rename: a reader sees the whole file or none
            stored.parent.mkdir(parents=True, exist_ok=True)
            np.save(tmp, np.array([n, *lookup], dtype=np.int64))
            os.replace(tmp, stored)
        except OSError:
            pass  # a read-only cache costs the rebuild next time, nothing else
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
    return tuple(lookup), n


def _valid_token_map(row: Any) -> bool:
    """Whether a stored [n_classes, lookup...] row can be a token map: 1-D int64, every id in
    0..n_classes-1 and every class used."""
    if not isinstance(row, np.ndarray) or row.dtype != np.int64 or row.ndim != 1 or len(row) < 2:
        return False
    lookup = row[1:]
    return int(lookup.min()) == 0 and int(lookup.max()) == int(row[0]) - 1


def compressed_token_map(tokenizer_path: str | Path | None = None) -> tuple[tuple[int, ...], int]:
    """`build_compressed_token_map` of the tokenizer file at `tokenizer_path` (None: the packaged
    one), cached in-process by resolved path and on disk by the file's sha256 and the tokenizers
    release (dsneuron's cache folder, token-maps/: 1 s for the V4 tokenizer -> a file read).
    Raises TokenizerError for a missing/invalid file."""
    p = default_tokenizer_path() if tokenizer_path is None else Path(tokenizer_path)
    return _cached_token_map(str(p.resolve()))


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram_size: int, compressed_vocab_size: int) -> list[list[int]]:
    """[layer][k]: the odd int64 multiplier of the token k positions back (k = 0 is the current one).

    Source: inference/engram.py compute_hash_multipliers.
    """
    bound = max(1, (int(np.iinfo(np.int64).max) // compressed_vocab_size) // 2)
    out = []
    for layer_id in layer_ids:
        draw = np.random.default_rng(10007 * layer_id).integers(0, bound, size=max_ngram_size, dtype=np.int64)
        out.append((draw * 2 + 1).tolist())
    return out


_PARAM_KEYS = ("layer_ids", "max_ngram_size", "n_heads", "compressed_vocab_size", "pad_id", "token_map",
               "multipliers", "primes", "offsets", "num_embeddings")


@dataclass(frozen=True)
class EngramParams:
    """Everything the host-side n-gram hash needs, as plain ints and lists (JSON-serialisable).

    layer_ids [n_layers]; max_ngram_size; n_heads; compressed_vocab_size; pad_id: the compressed id
    that fills look-back slots before a sequence start (token_map[engram_pad_id]); token_map
    [vocab_size]: model id -> compressed id; multipliers [n_layers][max_ngram_size] (odd int64);
    primes [n_layers][max_ngram_size - 1][n_heads]; offsets [n_layers][(max_ngram_size - 1) * n_heads];
    num_embeddings [n_layers] (table rows). Consumed by dsneuron.kernels_nki.engram_hash.NgramHasher.
    """

    layer_ids: list[int]
    max_ngram_size: int
    n_heads: int
    compressed_vocab_size: int
    pad_id: int
    token_map: list[int]
    multipliers: list[list[int]]
    primes: list[list[list[int]]]
    offsets: list[list[int]]
    num_embeddings: list[int]

    def to_dict(self) -> dict[str, Any]:
        """The manifest form: a dict of the fields above (fresh lists)."""
        return {k: _plain(getattr(self, k)) for k in _PARAM_KEYS}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "EngramParams":
        """Inverse of to_dict. Raises ValueError naming a missing or unknown key."""
        missing = [k for k in _PARAM_KEYS if k not in raw]
        unknown = sorted(set(raw) - set(_PARAM_KEYS))
        if missing or unknown:
            raise ValueError(f"engram params: missing keys {missing}, unknown keys {unknown}")
        return cls(**{k: _plain(raw[k]) for k in _PARAM_KEYS})


def _plain(v: Any) -> Any:
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else int(v)


def engram_params(cfg: ModelConfig, tokenizer: str | Path | None = None) -> EngramParams:
    """The engram hashing parameters of `cfg` with the tokenizer file `tokenizer` (None: packaged).

    Raises ConfigError when cfg.engram_pad_id is not a tokenizer id, TokenizerError when the
    tokenizer file is missing or invalid.
    """
    layout = engram_layout(cfg)
    lookup, n_classes = compressed_token_map(tokenizer)
    if cfg.engram_pad_id >= len(lookup):
        raise ConfigError(f"model.engram_pad_id: {cfg.engram_pad_id} is not an id of the tokenizer "
                          f"(it has {len(lookup)} tokens)")
    pad = lookup[cfg.engram_pad_id]
    token_map = list(lookup[:cfg.vocab_size]) + [pad] * max(0, cfg.vocab_size - len(lookup))
    return EngramParams(
        layer_ids=list(layout.layer_ids),
        max_ngram_size=layout.max_ngram_size,
        n_heads=layout.n_heads,
        compressed_vocab_size=n_classes,
        pad_id=pad,
        token_map=token_map,
        multipliers=hash_multipliers(layout.layer_ids, layout.max_ngram_size, n_classes),
        primes=_plain(layout.primes),
        offsets=_plain(layout.offsets),
        num_embeddings=list(layout.num_embeddings),
    )
