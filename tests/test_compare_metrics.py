"""The comparison metrics of `dsneuron compare` against hand-computed values and ml_dtypes."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from dsneuron.compiler.compare import (
    _cut,
    _unoffset,
    bf16_ulps,
    logit_metrics,
    selection_metrics,
    stage_kind,
    stage_metrics,
    tensor_metrics,
)


def test_bf16_ulps_equals_the_ml_dtypes_spacing():
    """The next bf16 value away from zero (ml_dtypes nextafter) is exactly 1 ulp from any normal value."""
    rng = np.random.default_rng(0)
    ref = (rng.standard_normal(2000) * 10.0 ** rng.integers(-20, 20, 2000)).astype(ml_dtypes.bfloat16)
    away = np.nextafter(ref, (np.sign(ref.astype(np.float32)) * np.inf).astype(ml_dtypes.bfloat16))
    got = bf16_ulps(torch.from_numpy(away.astype(np.float32)), torch.from_numpy(ref.astype(np.float32)))
    assert torch.equal(got, torch.ones(2000))


def test_bf16_ulps_hand_made():
    ref = torch.tensor([1.0, 1.5, -3.0, 0.0])
    got = torch.tensor([1.0 + 2**-7, 1.5 - 2**-6, -3.0, 2**-126])
    assert bf16_ulps(got, ref).tolist() == [1.0, 2.0, 0.0, 128.0]


def test_logit_metrics_hand_made():
    ref = torch.tensor([3.0, 1.0, 0.0, -1.0, -2.0, -5.0])
    same = logit_metrics(ref, ref)
    assert same["cos"] == pytest.approx(1.0) and same["max_rel"] == 0 and same["kl"] == pytest.approx(0, abs=1e-12)
    assert same["top5"] == 5 and same["argmax"] == 1 and same["margin"] == 2.0
    swapped = logit_metrics(torch.tensor([1.0, 3.0, 0.0, -1.0, -2.0, -5.0]), ref)
    assert swapped["argmax"] == 0 and swapped["top5"] == 5 and swapped["max_rel"] == pytest.approx(2 / 5)
    p = torch.softmax(ref.double(), 0)
    q = torch.softmax(torch.tensor([1.0, 3.0, 0.0, -1.0, -2.0, -5.0]).double(), 0)
    assert swapped["kl"] == pytest.approx(float((p * (p / q).log()).sum()))


def test_tensor_metrics_counts_elements_over_two_ulps_and_nonfinite():
    ref = torch.ones(4, dtype=torch.bfloat16)
    got = torch.tensor([1.0, 1.0 + 2**-7, 1.0 + 3 * 2**-7, 1.0], dtype=torch.bfloat16)
    m = tensor_metrics(got, ref)
    assert m["max_ulp"] == 3.0 and m["over2"] == 0.25 and m["max_rel"] == pytest.approx(3 * 2**-7)
    bad = tensor_metrics(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, 1.0]))
    assert math.isinf(bad["max_ulp"]) and bad["over2"] == 1.0
    assert tensor_metrics(torch.tensor([-math.inf, 1.0]), torch.tensor([-math.inf, 1.0]))["max_ulp"] == 0.0
    with pytest.raises(ValueError, match="shape"):
        tensor_metrics(torch.ones(3), torch.ones(4))
    assert tensor_metrics(torch.ones(0, 4), torch.ones(0, 4))["max_ulp"] == 0.0


def test_selections_compare_as_sets_per_row():
    ref = torch.tensor([[1, 5, 9], [2, 3, 4]])
    assert selection_metrics(torch.tensor([[9, 1, 5], [2, 3, 4]]), ref)["rows_differ"] == 0.0
    assert selection_metrics(torch.tensor([[9, 1, 6], [4, 3, 2]]), ref)["rows_differ"] == 0.5
    mask = torch.tensor([[True, False], [False, True]])
    assert selection_metrics(mask, mask.flip(-1))["rows_differ"] == 1.0


def test_prefill_index_lists_align_after_taking_out_the_window_offset():
    """Bundle prefill at bucket 16, golden at 11 tokens: compressed entries sit after the window
    (offset 16 vs 11) and are equal once the offset is taken out; window entries stay."""
    golden = torch.tensor([[[0, 1, -1, 11, 12]]])
    bundle = torch.tensor([[[1, 0, -1, 16, 17], [3, 3, 3, 3, 3]]])  # second row: padding, cut away
    assert stage_metrics("layers.2.attn.idx", bundle[0], golden[0], (16, 11))["rows_differ"] == 0.0
    assert stage_metrics("layers.2.attn.idx", bundle[0], golden[0], (11, 11))["rows_differ"] == 1.0
    assert _unoffset(torch.tensor([-1, 3, 16]), 16).tolist()[:2] == [-1, 3]


def test_cut_refuses_a_bundle_tensor_smaller_than_the_golden():
    assert _cut(torch.zeros(16, 4), torch.Size([11, 4])).shape == (11, 4)
    with pytest.raises(ValueError, match="does not cover"):
        _cut(torch.zeros(8, 4), torch.Size([11, 4]))


def test_stage_kind_drops_the_layer():
    assert stage_kind("layers.12.ffn.gate.indices") == "ffn.gate.indices"
    assert stage_kind("final.logits") == "final.logits"


@pytest.mark.parametrize("config", ["tiny", "micro"])
def test_every_packaged_config_gets_three_shipped_prompts_that_fit(config):
    """The prompt set `dsneuron compare` picks by default fits the packaged plan with 8 decode steps,
    and its longest prompt is longer than the model's attention window."""
    from dsneuron.compiler.buckets import plan_buckets
    from dsneuron.compiler.config import load_config
    from dsneuron.compiler.default_prompts import NAMES, SMALL_NAMES, shipped_prompts
    from dsneuron.graphs.tokenizer import load_tokenizer

    model_cfg, compile_cfg, _ = load_config(config)
    plan = plan_buckets(compile_cfg, model_cfg)
    max_prefill = max(b.seq_len for b in plan.buckets if b.kind == "prefill")
    tok = load_tokenizer()

    def n_tokens(text):
        return 1 + len(tok.encode(text, add_special_tokens=False).ids)

    def fits(text):
        return n_tokens(text) <= max_prefill and n_tokens(text) + 8 <= compile_cfg.max_seq_len

    chosen = shipped_prompts(fits)
    assert [name for name, _ in chosen] == list(NAMES if config == "tiny" else SMALL_NAMES)
    assert all(fits(t) for _, t in chosen)
    assert max(n_tokens(t) for _, t in chosen) > model_cfg.window_size
