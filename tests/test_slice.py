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

from dsneuron.compiler import placement as PL
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


# ------------------------------------------------------------------------------- compiled (slow)
def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsneuron.compiler.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "300"})


@pytest.fixture(scope="module")
def slice_bundle(tmp_path_factory):
    """(bundle, cache folder): `dsneuron compile --config v4.1-flash-slice` into a fresh cache, so the
    random checkpoint (5.5 GiB) and every executable are made: about 5 minutes on a quiet 2-core host,
    11 GB of disk."""
    root = tmp_path_factory.mktemp("slice")
    out, cache = root / "bundle", root / "cache"
    t0 = time.perf_counter()
    r = _cli("compile", "--config", "v4.1-flash-slice", "--out", str(out), "--cache-dir", str(cache), timeout=3600)
    assert r.returncode == 0, r.stderr[-4000:]
    print(f"slice compiled in {time.perf_counter() - t0:.0f} s")
    return out, cache


@pytest.mark.slow
def test_slice_bundle_holds_one_executable_per_stage_kind_and_step(slice_bundle):
    bundle, _ = slice_bundle
    manifest = json.loads((bundle / "manifest.json").read_text())
    cfg = load_config("v4.1-flash-slice")[0]
    for b in manifest["buckets"]:
        names = [s["name"] for s in b["stages"]]
        assert names[0] == "embed" and names[-1] == "head", names
        # a stage's executable is named after its kind, shared by the stages of that kind
        assert {s["file"].rsplit("/", 1)[1].split(".")[0] for s in b["stages"]} == set(P.stage_kinds(cfg)), b["file"]
        assert all((bundle / s["file"]).is_file() for s in b["stages"])


@pytest.mark.slow
def test_slice_bundle_runs_greedy_and_deterministic(slice_bundle):
    """Greedy generation of 6 tokens: exit 0, text out, the stats line; a second run prints the same text."""
    bundle, _ = slice_bundle
    runs = [_cli("run", str(bundle), "--prompt", "The capital of France is", "--max-new-tokens", "6", "--stats")
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "tokens/s" in r.stderr and "(bucket b1 s128)" in r.stderr, r.stderr
    assert runs[0].stdout.strip() and runs[0].stdout == runs[1].stdout
    print(runs[0].stderr.strip().splitlines()[-1])


@pytest.mark.slow
def test_plan_decode_bytes_equal_the_checkpoint_headers(slice_bundle):
    """plan's weight bytes one decode token reads (device parts plus the engram rows the host sends)
    against bench/bundle.py decode_bytes, which sums the slice checkpoint's safetensors headers
    with the same reading rule. The only slack is the routed experts' k/E share, which plan floors
    per tensor and decode_bytes once: at most one byte per routed expert tensor."""
    from dsneuron.bench.bundle import decode_bytes
    from dsneuron.compiler.model_steps import checkpoint_for
    from dsneuron.graphs.engram import engram_layout
    from dsneuron.graphs.spec import checkpoint_spec

    _, cache = slice_bundle
    model, comp, _ = load_config("v4.1-flash-slice")
    spec = checkpoint_spec(model, engram_layout(model).num_embeddings)
    read = P.decode_read(model, PL.Parallel(1, 1), spec)
    measured = decode_bytes(checkpoint_for(model, comp, cache), model.to_dict())
    n_expert_tensors = sum(".ffn.experts." in n and not n.startswith("mtp.") for n in spec)
    assert 0 <= measured - (read["total"] + read["host"]) <= n_expert_tensors, (measured, read)
    assert read["host"] > 0 and read["by_part"]["routed experts"] > 0



@pytest.mark.slow
def test_compare_on_the_slice_is_no_worse_than_the_floors(slice_bundle, tmp_path):
    """`dsneuron compare` of the slice bundle against the eager golden on its checkpoint (the golden
    without its float64 weight copies, 29.5 GiB at these widths; the bundle released before the
    golden loads; 8.8 GB peak RSS): one prompt, prefill + 3 teacher-forced decode steps, end to end
    no worse than the floors."""
    bundle, cache = slice_bundle
    prompts = tmp_path / "p.txt"
    prompts.write_text("The capital of France is\n")
    out = tmp_path / "c.json"
    r = _cli("compare", str(bundle), "--prompts", str(prompts), "--decode", "3", "--json", str(out), "--cache-dir",
             str(cache), timeout=3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "no worse than the floor" in r.stdout
    (rep,) = json.loads(out.read_text())["prompts"]
    assert rep["n_steps"] == 4 and rep["verdict"]["ok"], rep["verdict"]
    print(rep["verdict"], [s["bundle"]["argmax"] for s in rep["steps"]])
