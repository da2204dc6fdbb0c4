"""Engram hashing parameters (graphs/engram.py, graphs/tokenizer.py) and the host-side hasher
(kernels_nki/engram_hash.py), against independent oracles: trial division, a restart-and-skip prime
search written as the reference does it, the V4.1 release config values, a unicodedata-based token
normaliser and a per-position Python-int hash."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
import unicodedata

import numpy as np
import pytest
import torch

from dsneuron.compiler.config import load_config
from dsneuron.graphs.config import ConfigError
from dsneuron.graphs.engram import (EngramParams, _layout, compressed_token_map, engram_layout, engram_params,
                                    hash_multipliers, is_prime)
from dsneuron.graphs.tokenizer import TokenizerError, load_tokenizer, tokenizer_files
from dsneuron.kernels_nki.engram_hash import NgramHasher

# DeepSeek-V4.1-Flash release config (docs/architecture.md "Tokenizer and configs")
V41_ENGRAM = dict(layer_ids=(1, 14), max_ngram=4, n_heads=8, head_dim=256, vocab=16_000_000)
V41_NUM_EMBEDDINGS = (384006168, 384016682)
V41_COMPRESSED_VOCAB = 99092


def _trial_division(n: int) -> bool:
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


# ---------------------------------------------------------------------------------------- primes
def test_is_prime_matches_trial_division():
    assert [n for n in range(20000) if is_prime(n)] == [n for n in range(20000) if _trial_division(n)]


@pytest.mark.parametrize("n,expected", [
    (561, False), (41041, False),                 # Carmichael numbers
    (2047, False), (3215031751, False),           # strong pseudoprimes to base 2 / bases 2,3,5,7
    (3825123056546413051, False),                 # strong pseudoprime to bases 2..23
    (2**61 - 1, True), (1_000_000_007, True), (16_000_057, True), (16_000_058, False),
])
def test_is_prime_hard_cases(n, expected):
    assert is_prime(n) is expected


def test_is_prime_rejects_out_of_range():
    with pytest.raises(ValueError):
        is_prime(-1)
    with pytest.raises(ValueError):
        is_prime(10**25)


def _reference_style_primes(layer_ids, max_ngram, n_heads, vocab):
    """The search as inference/engram.py words it: restart at vocab-1 per n-gram size, skip used primes."""
    seen, out = set(), []
    for _ in layer_ids:
        per_layer = []
        for _ in range(max_ngram - 1):
            row, cur = [], vocab - 1
            for _ in range(n_heads):
                cur += 1
                while not _trial_division(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                row.append(cur)
            per_layer.append(tuple(row))
        out.append(tuple(per_layer))
    return tuple(out)


@pytest.mark.parametrize("name", ["micro", "tiny"])
def test_layout_of_packaged_configs(name):
    cfg, _, _ = load_config(name)
    lay = engram_layout(cfg)
    assert lay.primes == _reference_style_primes(cfg.engram_layer_ids, cfg.engram_max_ngram_size,
                                                 cfg.engram_n_heads, cfg.engram_vocab_size)
    flat = [p for layer in lay.primes for per_n in layer for p in per_n]
    assert len(flat) == len(set(flat)) == len(cfg.engram_layer_ids) * lay.n_cols
    assert all(_trial_division(p) and p > cfg.engram_vocab_size - 1 for p in flat)
    for layer, rows, offs in zip(lay.primes, lay.num_embeddings, lay.offsets):
        sizes = [p for per_n in layer for p in per_n]
        assert rows == sum(sizes)
        assert list(offs) == [sum(sizes[:i]) for i in range(len(sizes))]


def test_layout_reproduces_v41_release_table_sizes():
    lay = _layout(V41_ENGRAM["layer_ids"], V41_ENGRAM["max_ngram"], V41_ENGRAM["n_heads"],
                  V41_ENGRAM["head_dim"], V41_ENGRAM["vocab"])
    assert lay.num_embeddings == V41_NUM_EMBEDDINGS


# ------------------------------------------------------------------------------------ tokenizer
@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_tokenizer_size_equals_model_vocab(tok):
    assert tok.get_vocab_size(with_added_tokens=True) == 129280 == load_config("micro")[0].vocab_size
    assert [p.name for p in tokenizer_files()] == ["tokenizer.json", "tokenizer_config.json"]
    assert all(p.is_file() for p in tokenizer_files())


def test_load_tokenizer_bad_paths(tmp_path):
    with pytest.raises(TokenizerError, match="no such tokenizer file"):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)  # a folder holding a tokenizer.json


_RUST_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"


def _oracle_key(text: str) -> str:
    """The reference's normaliser spelt with unicodedata/re (tokenizers' StripAccents drops every
    combining mark Mn/Mc/Me; its Strip uses Unicode White_Space, not str.isspace)."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if unicodedata.category(c) not in ("Mn", "Mc", "Me")).lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    s = " " if s == " " else s.strip(_RUST_WHITESPACE)
    return s or text


def test_token_map_matches_unicodedata_oracle(tok):
    lookup, n = compressed_token_map()
    classes, expected = {}, []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=False)
        key = tok.id_to_token(i) if "\ufffd" in text else _oracle_key(text)
        expected.append(classes.setdefault(key, len(classes)))
    assert list(lookup) == expected
    assert n == len(classes) == V41_COMPRESSED_VOCAB  # the V4.1 release's engram_compressed_vocab_size


def test_token_map_merges_case_and_spaces(tok):
    lookup, _ = compressed_token_map()
    same = ["ĠThe", "the", "THE", "Ġthe"]  # byte-level BPE: Ġ is a leading space
    ids = [tok.token_to_id(t) for t in same]
    assert None not in ids and len({lookup[i] for i in ids}) == 1
    # a lone space survives the Strip (sentinel) and stays apart from every other class
    space = tok.token_to_id("Ġ")
    assert sum(1 for c in lookup if c == lookup[space]) > 1  # "\n", "  ", ... join it
    assert lookup[tok.token_to_id("a")] != lookup[space]
    assert lookup[tok.token_to_id("the")] != lookup[tok.token_to_id("tha")]


def test_token_map_is_cached():
    compressed_token_map()
    t0 = time.perf_counter()
    compressed_token_map()
    assert time.perf_counter() - t0 < 0.05


def test_token_map_is_kept_on_disk_and_a_bad_file_is_rebuilt(tok, tmp_path, monkeypatch):
    from dsneuron.graphs.engram import _cached_token_map, build_compressed_token_map
    built = build_compressed_token_map(tok)
    monkeypatch.setenv("DSNEURON_CACHE_DIR", str(tmp_path / "cache"))
    _cached_token_map.cache_clear()
    try:
        first = compressed_token_map()
        (stored,) = (tmp_path / "cache" / "token-maps").glob("*.npy")
        _cached_token_map.cache_clear()
        assert compressed_token_map() == first and (list(first[0]), first[1]) == built
        for bad in (b"not an array", b""):  # np.load raises ValueError, EOFError
            stored.write_bytes(bad)
            _cached_token_map.cache_clear()
            assert compressed_token_map() == first
        for bad in (np.array(5), np.array([3, 0, 1]), np.array([2.0, 0.0, 1.0])):  # 0-d, a class unused, floats
            np.save(stored, bad)
            _cached_token_map.cache_clear()
            assert compressed_token_map() == first
        # a cache folder that cannot be written: the map is still made, nothing raised
        blocker = tmp_path / "a-file"
        blocker.write_text("x")
        monkeypatch.setenv("DSNEURON_CACHE_DIR", str(blocker))
        _cached_token_map.cache_clear()
        assert compressed_token_map() == first
    finally:
        _cached_token_map.cache_clear()


# ---------------------------------------------------------------------------------- parameters
def test_engram_params_fields_and_json_round_trip():
    cfg, _, _ = load_config("tiny")
    p = engram_params(cfg)
    lay = engram_layout(cfg)
    lookup, n = compressed_token_map()
    assert p.compressed_vocab_size == n
    assert p.pad_id == lookup[cfg.engram_pad_id]
    assert p.token_map == list(lookup)
    assert p.num_embeddings == list(lay.num_embeddings)
    bound = (np.iinfo(np.int64).max // n) // 2
    for layer_id, row in zip(cfg.engram_layer_ids, p.multipliers):
        raw = np.random.default_rng(10007 * layer_id).integers(0, bound, size=cfg.engram_max_ngram_size, dtype=np.int64)
        assert row == [int(v) * 2 + 1 for v in raw]
        assert all(m % 2 == 1 and 0 < m and m * (n - 1) < 2**63 for m in row)
    d = json.loads(json.dumps(p.to_dict()))
    assert EngramParams.from_dict(d) == p
    with pytest.raises(ValueError, match="missing keys"):
        EngramParams.from_dict({k: v for k, v in d.items() if k != "offsets"})
    with pytest.raises(ValueError, match="unknown keys"):
        EngramParams.from_dict({**d, "extra": 1})


def test_ids_beyond_the_tokenizer_hash_like_pad():
    cfg, _, _ = load_config("micro")
    big = dataclasses.replace(cfg, vocab_size=129280 + 7)
    p = engram_params(big)
    assert len(p.token_map) == 129287 and p.token_map[129280:] == [p.pad_id] * 7
    assert p.compressed_vocab_size == V41_COMPRESSED_VOCAB
    small = engram_params(dataclasses.replace(cfg, vocab_size=1000))
    assert small.token_map == list(compressed_token_map()[0][:1000])
    assert small.multipliers == p.multipliers  # the class count comes from the whole tokenizer


def test_engram_params_bad_pad_id():
    cfg, _, _ = load_config("micro")
    with pytest.raises(ConfigError, match="engram_pad_id"):
        engram_params(dataclasses.replace(cfg, vocab_size=200000, engram_pad_id=150000))


def test_multipliers_for_single_class_vocab():
    # bound formula at its edge: int64_max // 1 // 2 multipliers stay below int64_max
    m = hash_multipliers((3,), 2, 1)
    assert all(0 < v < 2**63 and v % 2 for v in m[0])


# ------------------------------------------------------------------------------------- hashing
def _oracle_hash(p: EngramParams, tokens: list[int]) -> list[list[list[int]]]:
    """Per position, per layer, the reference formula in Python ints: [L][layer][col]."""
    out = []
    for t in range(len(tokens)):
        back = [p.token_map[tokens[t - k]] if t - k >= 0 else p.pad_id for k in range(p.max_ngram_size)]
        per_layer = []
        for li in range(len(p.layer_ids)):
            mult = p.multipliers[li]
            rolling = back[0] * mult[0]
            cols = []
            for n in range(1, p.max_ngram_size):
                rolling ^= back[n] * mult[n]
                for h in range(p.n_heads):
                    col = (n - 1) * p.n_heads + h
                    cols.append(rolling % p.primes[li][n - 1][h] + p.offsets[li][col])
            per_layer.append(cols)
        out.append(per_layer)
    return out


@pytest.fixture(scope="module", params=["micro", "tiny"])
def params(request) -> EngramParams:
    cfg, _, _ = load_config(request.param)
    return engram_params(cfg)


def _random_tokens(seed: int, b: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 129280, (b, n), generator=g)


def test_hash_sequence_matches_oracle(params):
    hasher = NgramHasher(params.to_dict())
    toks = _random_tokens(0, 3, 40)
    toks[1, :5] = 2  # the pad token itself, as real input
    ids = hasher.hash_sequence(toks)
    assert ids.dtype == torch.int64
    assert ids.shape == (3, 40, len(params.layer_ids), (params.max_ngram_size - 1) * params.n_heads)
    for b in range(3):
        assert ids[b].tolist() == _oracle_hash(params, toks[b].tolist())
    rows = torch.tensor(params.num_embeddings)[:, None]
    assert bool((ids >= 0).all()) and bool((ids < rows).all())


def test_normalised_spellings_hash_alike(params, tok):
    hasher = NgramHasher(params.to_dict())
    a = hasher.hash_sequence(torch.tensor([tok.encode("Hello THE World").ids]))
    b = hasher.hash_sequence(torch.tensor([tok.encode("hello the world").ids]))
    c = hasher.hash_sequence(torch.tensor([tok.encode("hello the word").ids]))
    assert torch.equal(a, b) and not torch.equal(a[:, -1], c[:, -1])


def test_prefill_then_decode_equals_whole_sequence(params):
    hasher = NgramHasher(params.to_dict())
    toks = _random_tokens(1, 2, 30)
    whole = hasher.hash_sequence(toks)
    for split in (0, 1, 2, 7):
        hist = hasher.initial_history(2)
        got = []
        if split:
            ids, hist = hasher.hash(toks[:, :split], hist)
            got.append(ids)
        for t in range(split, 30):
            ids, hist = hasher.hash(toks[:, t:t + 1], hist)
            got.append(ids)
        assert torch.equal(torch.cat(got, dim=1), whole), split


def test_right_padded_prefill(params):
    hasher = NgramHasher(params.to_dict())
    toks = _random_tokens(2, 3, 12)
    valid = torch.tensor([12, 5, 1])
    padded = toks.clone()
    padded[1, 5:] = 7
    padded[2, 1:] = -5  # padding may hold anything, even an invalid id
    ids, hist = hasher.hash(padded, hasher.initial_history(3), valid)
    for b, n in enumerate(valid.tolist()):
        alone, alone_hist = hasher.hash(toks[b:b + 1, :n], hasher.initial_history(1))
        assert torch.equal(ids[b, :n], alone[0])
        assert torch.equal(hist[b], alone_hist[0])
        assert bool((ids[b, n:] == hasher.pad_hash).all())
    # decoding on from the padded prefill equals the unpadded sequence
    nxt = _random_tokens(3, 3, 1)
    step, _ = hasher.hash(nxt, hist)
    for b, n in enumerate(valid.tolist()):
        seq = torch.cat([toks[b, :n], nxt[b]])[None]
        assert torch.equal(step[b, 0], hasher.hash_sequence(seq)[0, -1])


def test_zero_valid_length_keeps_history(params):
    hasher = NgramHasher(params.to_dict())
    hist = torch.tensor([[5] * hasher.history_len])
    ids, new = hasher.hash(torch.zeros(1, 4, dtype=torch.long), hist, torch.tensor([0]))
    assert torch.equal(new, hist) and bool((ids == hasher.pad_hash).all())


def test_pad_hash_is_the_all_pad_ngram(params):
    hasher = NgramHasher(params.to_dict())
    pad_token = params.token_map.index(params.pad_id)
    ids = hasher.hash_sequence(torch.tensor([[pad_token]]))
    assert torch.equal(ids[0, 0], hasher.pad_hash)


def test_hasher_rejects_bad_inputs(params):
    hasher = NgramHasher(params.to_dict())
    h = hasher.initial_history(1)
    with pytest.raises(ValueError, match="token ids"):
        hasher.hash(torch.tensor([[129280]]), h)
    with pytest.raises(ValueError, match="token ids"):
        hasher.hash(torch.tensor([[-1]]), h)
    with pytest.raises(ValueError, match="history"):
        hasher.hash(torch.tensor([[1]]), hasher.initial_history(2))
    with pytest.raises(ValueError, match="valid_len"):
        hasher.hash(torch.tensor([[1]]), h, torch.tensor([2]))
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        hasher.hash(torch.tensor([1]), h)


def test_hasher_rejects_bad_params(params):
    d = params.to_dict()
    with pytest.raises(ValueError, match="'offsets'"):
        NgramHasher({k: v for k, v in d.items() if k != "offsets"})
    with pytest.raises(ValueError, match="'primes' has shape"):
        NgramHasher({**d, "primes": d["primes"][:1]})
    with pytest.raises(ValueError, match="num_embeddings"):
        NgramHasher({**d, "num_embeddings": [n + 1 for n in d["num_embeddings"]]})
    with pytest.raises(ValueError, match="int64"):
        NgramHasher({**d, "multipliers": [[2**62] * len(r) for r in d["multipliers"]]})


def test_runtime_hasher_does_not_import_graphs():
    code = ("import sys, dsneuron.kernels_nki.engram_hash; "
            "bad = [m for m in sys.modules if m.startswith(('dsneuron.graphs', 'dsneuron.compiler'))]; "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
