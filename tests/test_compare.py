"""`dsneuron compare` on the session's micro probe bundle: the compiled stages against the eager
golden (local errors), the end-to-end verdict against the floors, the CLI and its bad inputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dsneuron.compiler.compare import compare_sequence, end_to_end_verdict, stage_kind, worst_local
from dsneuron.runtime_min.session import Session


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsneuron.compiler.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def session(micro_bundle):
    return Session.load(micro_bundle.path)


def test_every_compiled_stage_reproduces_the_golden_stage_on_its_input(session, micro_golden):
    """Prefill of 11 tokens + 6 decode steps: every stage the golden re-runs on the bundle's
    recorded input and state (engram, hc mixes, attention of every layer with its quantised KV,
    indexer scores and selections, MoE, head; prefill and each decode step) is within the issue's
    2 bf16 ulps, quantisers and selections bit-exact, and the end to end drift is no worse than the
    floors'."""
    ids = torch.randint(0, 128000, (17,), generator=torch.Generator().manual_seed(1)).tolist()
    rep = compare_sequence(session, micro_golden, "random", ids, 11)
    assert rep.n_steps == 7 and len(rep.steps) == 7
    kinds = {stage_kind(s) for s, per in rep.stages.items() if all("local" in step for step in per)}
    assert {"hc_attn.comb", "hc_ffn.pre", "engram.out", "attn.out", "attn.window_kv", "compress_kv.entry",
            "indexer.scores", "indexer.topk", "attn.idx", "ffn.out", "final.logits"} <= kinds
    n_layers = micro_golden.cfg.n_layers
    assert all("local" in step for L in range(n_layers) for step in rep.stages[f"layers.{L}.attn.out"])
    stage, ulps = worst_local(rep)
    assert ulps <= 2, (stage, ulps)
    # the quantisers and the selections, re-run on the bundle's input and state, are bit-exact
    assert worst_local(rep, "rows_differ") == ("", 0.0)
    for L in range(n_layers):
        assert all(step["local"]["max_ulp"] == 0 for step in rep.stages[f"layers.{L}.attn.window_kv"])
        # the MoE halves too: nothing in them is summed in another order, and the router's sqrt is
        # IEEE on both sides (graphs/model.py ieee_sqrt)
        assert all(step["local"]["max_ulp"] == 0 for step in rep.stages[f"layers.{L}.ffn.out"]), L
    v = end_to_end_verdict(rep)
    assert v["ok"], v
    # the quantized window KV of layer 0 at the prefill is computed from identical inputs: bit-exact
    assert rep.stages["layers.0.attn.window_kv"][0]["bundle"]["max_ulp"] == 0


def test_compare_cli_writes_tables_and_json(micro_bundle, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello there, this is a test\n")
    r = cli("compare", str(micro_bundle.path), "--prompts", str(prompts), "--decode", "3", "--json", str(tmp_path / "c.json"),
            "--checkpoint", str(micro_bundle.compile_cfg.checkpoint))
    assert r.returncode == 0, r.stderr
    assert "no worse than the floor" in r.stdout and "largest local error" in r.stdout
    assert "the floor used is the larger" in r.stdout and "stages: every local re-run within 2 bf16 ulps" in r.stdout
    data = json.loads((tmp_path / "c.json").read_text())
    (rep,) = data["prompts"]
    assert rep["n_steps"] == len(rep["steps"]) and rep["verdict"]["ok"]
    assert set(rep["steps"][0]) == {"bundle", "floor", "nudge"}


@pytest.mark.parametrize("args, message", [
    (("--prompts", "/nonexistent/prompts.txt"), "cannot read it"),
    (("--decode", "-1"), "--decode must be >= 0"),
])
def test_compare_bad_inputs_exit_2(micro_bundle, args, message):
    r = cli("compare", str(micro_bundle.path), *args, "--checkpoint", str(micro_bundle.compile_cfg.checkpoint))
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_compare_refuses_when_no_prompt_fits(micro_bundle):
    """The shipped prompts are 11, 172 and 715 tokens; with 60 decode steps none fits capacity 64."""
    r = cli("compare", str(micro_bundle.path), "--decode", "60", "--checkpoint", str(micro_bundle.compile_cfg.checkpoint))
    assert r.returncode == 2 and "no prompt fits this bundle" in r.stderr and "64" in r.stderr


def test_compare_with_another_checkpoint_is_worse_than_the_floor_and_exits_1(micro_bundle, micro_cfg, tmp_path):
    """The same config with other random weights: the verdict fails and the exit code says so."""
    from dsneuron.graphs.checkpoint_make import make_checkpoint

    other = make_checkpoint(micro_cfg, tmp_path / "other", seed=5)
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello there\n")
    r = cli("compare", str(micro_bundle.path), "--prompts", str(prompts), "--decode", "1", "--checkpoint", str(other))
    assert r.returncode == 1 and "WORSE than the floor" in r.stdout and "is --checkpoint the one" in r.stderr, r.stderr


def test_compare_of_a_missing_bundle_exits_2(tmp_path):
    r = cli("compare", str(tmp_path / "nope"))
    assert r.returncode == 2 and "does not exist" in r.stderr
