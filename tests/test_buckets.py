"""Bucket planning (compiler/buckets.py) and bucket selection / padding (runtime_min/core/select.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dsneuron import UserError
from dsneuron.compiler.buckets import generated_lengths, plan_buckets
from dsneuron.compiler.config import CompileConfig, load_config
from dsneuron.graphs.config import ConfigError
from dsneuron.runtime_min.core import select


@pytest.fixture(scope="module")
def micro():
    model, compile_cfg, _ = load_config("micro")
    return model, compile_cfg


def cc(**kw) -> CompileConfig:
    raw = {"max_seq_len": 64, "batch_sizes": [1], "prefill_seq_lens": [16, 32, 64], "decode_context_lens": [64]}
    raw.update(kw)
    return CompileConfig.from_dict(raw)


# ------------------------------------------------------------------------------------------ planning
@pytest.mark.parametrize("maximum, expected", [
    (1024, (128, 256, 512, 1024)),
    (640, (128, 256, 512, 640)),   # NxDI's example: a non-power-of-two maximum is appended
    (128, (128,)),
    (129, (128, 129)),
    (64, (64,)),                   # below the 128 minimum: the maximum alone
])
def test_generated_lengths(maximum, expected):
    assert generated_lengths(maximum) == expected


def test_explicit_lists_sorted_and_deduplicated(micro):
    model, _ = micro
    plan = plan_buckets(cc(prefill_seq_lens=[64, 16, 32, 16], decode_context_lens=[64, 32, 64], batch_sizes=[2, 1, 2]), model)
    assert plan.prefill_seq_lens == (16, 32, 64)
    assert plan.decode_capacities == (32, 64)
    assert plan.batch_sizes == (1, 2)
    assert [b.label for b in plan.buckets] == [
        "prefill b1 s16", "prefill b1 s32", "prefill b1 s64", "prefill b2 s16", "prefill b2 s32", "prefill b2 s64",
        "decode b1 s32", "decode b1 s64", "decode b2 s32", "decode b2 s64"]
    # each prefill hands its state to the smallest capacity holding its seq_len
    assert [b.capacity for b in plan.prefill[:3]] == [32, 32, 64]


def test_generated_equals_the_same_buckets_listed(micro):
    model, _ = micro
    model = dataclasses.replace(model, window_size=128)
    generated = plan_buckets(cc(max_seq_len=1024, prefill_seq_lens=[], decode_context_lens=[]), model)
    listed = plan_buckets(cc(max_seq_len=1024, prefill_seq_lens=[1024, 128, 512, 256],
                             decode_context_lens=[256, 128, 1024, 512]), model)
    assert generated == listed
    assert generated.prefill_seq_lens == (128, 256, 512, 1024)


def test_packaged_configs_plan():
    for name in ("micro", "tiny"):
        model, compile_cfg, _ = load_config(name)
        plan = plan_buckets(compile_cfg, model)
        assert plan.buckets
    # tiny must cover the 11-, 172- and 715-token prompts and a context of at least 1024
    model, compile_cfg, _ = load_config("tiny")
    plan = plan_buckets(compile_cfg, model)
    for n in (11, 172, 715):
        assert select.first_fit(plan.prefill_seq_lens, n) is not None
    assert plan.decode_capacities[-1] >= 1024


@pytest.mark.parametrize("kw, key, limit", [
    ({"prefill_seq_lens": [16, 33]}, "compile.prefill_seq_lens", "not a multiple of 2"),
    ({"decode_context_lens": [8, 64]}, "compile.decode_context_lens", "below model.window_size=16"),
    ({"decode_context_lens": [20, 64]}, "compile.decode_context_lens", "not a multiple of 8"),
    ({"prefill_seq_lens": [16, 64], "decode_context_lens": [32]}, "compile.prefill_seq_lens", "exceeds the largest decode capacity 32"),
])
def test_constraint_violations_name_key_and_limit(micro, kw, key, limit):
    model, _ = micro
    with pytest.raises(ConfigError) as e:
        plan_buckets(cc(**kw), model)
    assert key in str(e.value) and limit in str(e.value)
    assert isinstance(e.value, UserError)


def test_generated_list_violation_says_generated(micro):
    model, _ = micro
    with pytest.raises(ConfigError, match=r"generated from compile.max_seq_len=129.*129 is not a multiple of 2"):
        plan_buckets(cc(max_seq_len=129, prefill_seq_lens=[], decode_context_lens=[128]), model)


def test_decode_batch_sizes_add_decode_buckets_only(micro):
    """compile.decode_batch_sizes: decode buckets at those batches too; prefill and chunk buckets
    stay at batch_sizes (the runtime prefills one prompt at a time). Left out of the manifest's
    compile section when empty, so other bundles keep their bytes; a non-positive entry is refused."""
    model, _ = micro
    plan = plan_buckets(cc(decode_batch_sizes=[4, 2, 4]), model).with_dynamic_prefill(8).with_chunks()
    assert [b.batch for b in plan.decode] == [1, 2, 4]
    assert {b.batch for b in plan.prefill} == {b.batch for b in plan.chunk} == {1}
    assert "decode_batch_sizes" not in cc().to_dict() and cc(decode_batch_sizes=[2]).to_dict()["decode_batch_sizes"] == [2]
    with pytest.raises(ConfigError, match="compile.decode_batch_sizes: entries must be positive"):
        cc(decode_batch_sizes=[0])
    tiny_model, tiny_cc, _ = load_config("tiny")
    tiny = plan_buckets(tiny_cc, tiny_model).with_dynamic_prefill(8).with_chunks()
    assert [(b.kind, b.batch, b.capacity) for b in tiny.buckets] == [
        ("prefill", 1, 1024), ("decode", 1, 1024), ("decode", 4, 1024), ("chunk", 1, 1024)]


def test_config_rejects_lengths_above_max_seq_len():
    with pytest.raises(ConfigError, match=r"compile.prefill_seq_lens: entries must be in 1..max_seq_len=64"):
        cc(prefill_seq_lens=[16, 128])


def test_candidate_filter_off_relaxes_capacity_rule(micro):
    model, _ = micro
    no_filter = dataclasses.replace(model, candidate_source_layer=-1)
    assert plan_buckets(cc(decode_context_lens=[18, 64]), no_filter).decode_capacities == (18, 64)


# ------------------------------------------------------------------------------------------ selection
BUCKETS = (16, 32, 64)


def expected_bucket(n: int) -> int | None:
    """Hand-written first-fit inclusive table for BUCKETS."""
    if 1 <= n <= 16:
        return 16
    if n <= 32:
        return 32
    if n <= 64:
        return 64
    return None


@pytest.mark.parametrize("b", BUCKETS)
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_prefill_selection_at_every_edge(b, delta):
    n = b + delta
    want = expected_bucket(n)
    if want is None:
        with pytest.raises(UserError, match=r"prompt has 65 tokens; the largest prefill bucket of this bundle holds 64"):
            select.pick_prefill(BUCKETS, n)
    else:
        assert select.pick_prefill(BUCKETS, n) == want
    # equality uses that bucket, one more moves on
    assert select.first_fit(BUCKETS, b) == b


@pytest.mark.parametrize("c", BUCKETS)
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_capacity_selection_at_every_edge(c, delta):
    n = c + delta
    want = expected_bucket(n)
    if want is None:
        with pytest.raises(UserError, match=r"context capacity of this bundle is 64 tokens"):
            select.pick_capacity(BUCKETS, n)
    else:
        assert select.pick_capacity(BUCKETS, n) == want


def test_batch_selection_pads_or_refuses():
    assert select.pick_batch([1, 4], 1) == 1
    assert select.pick_batch([1, 4], 2) == 4
    assert select.pick_batch([4, 1], 4) == 4
    with pytest.raises(UserError, match=r"5 prompts exceed the largest batch bucket of this bundle \(4"):
        select.pick_batch([1, 4], 5)


def test_pad_prompts():
    tokens, valid = select.pad_prompts([[5, 6, 7], [9]], batch=3, seq_len=4, pad_id=1)
    assert tokens.tolist() == [[5, 6, 7, 1], [9, 1, 1, 1], [1, 1, 1, 1]]
    assert valid.tolist() == [3, 1, 1]
    assert tokens.dtype == valid.dtype == torch.int64
    with pytest.raises(ValueError):
        select.pad_prompts([[1] * 5], batch=1, seq_len=4, pad_id=0)
    with pytest.raises(ValueError):
        select.pad_prompts([[]], batch=1, seq_len=4, pad_id=0)


def test_config_file_that_is_not_utf8_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match=r"bad.json: not UTF-8 text"):
        load_config(str(bad))


def test_config_that_is_a_folder_or_missing_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"is a folder; --config takes a JSON config file or a packaged config name "
                                          r"\(packaged: micro, tiny, v4.1-flash, v4.1-flash-slice\)"):
        load_config(str(tmp_path))
    with pytest.raises(ConfigError, match=r"no such file, and no packaged config of that name"):
        load_config(str(tmp_path / "none.json"))


def test_engram_head_dim_zero_is_refused(tmp_path):
    raw = json.loads((Path(load_config("micro")[2])).read_text())
    raw["model"]["engram_head_dim"] = 0
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"engram_head_dim: must be a positive multiple of 32"):
        load_config(str(path))
