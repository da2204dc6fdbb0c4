"""The packaged real-width slice `v4.1-flash-slice` (compiler/configs/v4.1-flash-slice.json): V4.1-Flash's
own widths and vocabulary with one layer of each of its layer kinds. The fast tests check the config
against v4.1-flash and plan it; the slow ones compile it once, run it, and check plan's decode bytes
against the checkpoint's safetensors headers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dsneuron.compiler import plan as P
from dsneuron.compiler.config import load_config
from dsneuron.graphs.stages import attn_kind

#: the keys the slice may differ in from v4.1-flash: its depth and the layer tables that index it,
#: the expert count, the engram table size, and the DSpark stages' depth and experts
SLICE_KEYS = {"n_layers", "n_mtp_layers", "compress_ratios", "kv_source_layers", "index_source_layers",
              "candidate_source_layer", "engram_layer_ids", "n_routed_experts", "engram_vocab_size",
              "dspark_target_layer_ids", "dspark_n_routed_experts", "dspark_n_activated_experts"}


def _kinds(cfg) -> set[str]:
    """The stage kinds of one step with the MoE half's expert count left out (the slice has fewer
    experts: the same graph with a smaller expert table)."""
    return {k.split("_e")[0] if k.startswith("ffn_") else k for k in P.stage_kinds(cfg)}


def test_slice_has_the_real_models_widths_and_every_stage_kind():
    real, _, _ = load_config("v4.1-flash")
    part, comp, _ = load_config("v4.1-flash-slice")
    a, b = real.to_dict(), part.to_dict()
    assert {k for k in a if a[k] != b[k]} <= SLICE_KEYS, {k: (a[k], b[k]) for k in a if a[k] != b[k] and k not in SLICE_KEYS}
    assert part.n_activated_experts == real.n_activated_experts < part.n_routed_experts
    assert _kinds(part) == _kinds(real), _kinds(part) ^ _kinds(real)
    # one layer of each attention kind: the slice is no deeper than it needs to be
    attn = [attn_kind(part, L) for L in range(part.n_layers)]
    assert len(set(attn)) == len(attn) - attn.count("attn_r0") + 1
    # DSpark reads target layers of the backbone, as the real model's last three
    assert part.dspark_target_layer_ids == tuple(range(part.n_layers - 3, part.n_layers))
    assert comp.batch_sizes == (1,) and comp.max_seq_len == 1024


def test_a_slice_missing_a_layer_kind_is_told_apart():
    """The kind comparison can fail: the hand-made 6-layer slice of issue 38 (ratios 0,0,2,2,1,1, no
    ratio-1 layer reusing another's selections) lacks attn_r1."""
    import dataclasses

    real, _, _ = load_config("v4.1-flash")
    part, _, _ = load_config("v4.1-flash-slice")
    six = dataclasses.replace(part, n_layers=6, compress_ratios=(0, 0, 2, 2, 1, 1, 0), index_source_layers=(2, 4, 5),
                              dspark_target_layer_ids=(3, 4, 5))
    six.validate()
    assert _kinds(real) - _kinds(six) == {"attn_r1"}


def test_plan_runs_on_the_slice(monkeypatch, capsys):
    from stand_in import run_cli

    monkeypatch.setenv("COLUMNS", "250")
    assert run_cli(monkeypatch, "plan", "--config", "v4.1-flash-slice", "--bandwidth-gbs", "20") == 0
    out = capsys.readouterr().out
    for kind in P.stage_kinds(load_config("v4.1-flash-slice")[0]):
        assert kind in out, kind
    assert "prefill b1 s128" in out and "decode b1 s1024" in out and "fits" in out
