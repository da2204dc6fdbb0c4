"""Sharded bundles (compiler/sharded_bundle.py, runtime_min/sharded.py): parallel.json is validated
field by field, a rank folder swapped or missing is refused before any rank starts, a rank bundle
opened on its own (or an ordinary bundle opened as a rank) is refused, a torchrun world of another
size is refused naming both, bad --tp/--ep exit 2 before any work, and (slow) the TP=2/EP=2 bundle
of micro generates the one-process bundle's text through `dsneuron run`."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from stand_in import run_cli

from dsneuron.runtime_min.bundle.bundle import file_sha256, open_bundle, read_manifest
from dsneuron.runtime_min.bundle.schema import MANIFEST, PARALLEL, BundleError, Manifest, ShardedManifest, rank_dir
from dsneuron.runtime_min.sharded import launch, read_sharded

SHA = "ab" * 32


def _raw(**over) -> str:
    raw = json.loads(ShardedManifest(2, 2, (SHA, SHA)).to_json())
    raw.update(over)
    return json.dumps(raw)


def test_parallel_json_round_trips():
    m = ShardedManifest(4, 2, ("0" * 64, "1" * 64, "2" * 64, "3" * 64), created_by="dsneuron x")
    assert ShardedManifest.from_json(m.to_json()) == m


@pytest.mark.parametrize("over, says", [
    ({"format": "dsneuron-bundle"}, "not a dsneuron sharded bundle"),
    ({"schema_version": 7}, "schema_version 7"),
    ({"tp": 1, "world": 1}, "tp=1"),
    ({"world": 4}, "world=4"),
    ({"ep": 3}, "ep=3"),
    ({"tp": "2"}, "expected int"),
    ({"ranks": [{"dir": "rank-0-of-2", "manifest_sha256": SHA}]}, "1 rank bundles for a world of 2"),
    ({"ranks": [{"dir": "rank-1-of-2", "manifest_sha256": SHA}] * 2}, "must be 'rank-0-of-2'"),
    ({"ranks": [{"dir": "rank-0-of-2", "manifest_sha256": "xyz"},
                {"dir": "rank-1-of-2", "manifest_sha256": SHA}]}, "not a hex sha256"),
])
def test_a_malformed_parallel_json_is_refused_naming_the_field(over, says):
    with pytest.raises(BundleError, match=says):
        ShardedManifest.from_json(_raw(**over))


def test_not_json_is_refused():
    with pytest.raises(BundleError, match="not valid JSON"):
        ShardedManifest.from_json("{tp: 2")


def _fake_sharded(root: Path) -> Path:
    """A folder with parallel.json over two rank folders that hold only a manifest.json each."""
    hashes = []
    for r in range(2):
        d = root / rank_dir(r, 2)
        d.mkdir(parents=True)
        (d / MANIFEST).write_text(f"rank {r}\n")
        hashes.append(file_sha256(d / MANIFEST))
    (root / PARALLEL).write_text(ShardedManifest(2, 2, tuple(hashes)).to_json())
    return root


def test_rank_folders_are_checked_against_parallel_json(tmp_path):
    root = _fake_sharded(tmp_path / "b")
    assert read_sharded(root).world == 2
    assert read_sharded(tmp_path) is None  # no parallel.json: an ordinary bundle (or none)
    (root / rank_dir(1, 2) / MANIFEST).write_text("another compile\n")
    with pytest.raises(BundleError, match="not the rank bundle this sharded bundle was written with"):
        read_sharded(root)
    shutil.rmtree(root / rank_dir(1, 2))
    with pytest.raises(BundleError, match="rank 1's bundle rank-1-of-2 is missing"):
        read_sharded(root)


def test_a_sharded_folder_is_not_read_as_one_bundle(tmp_path):
    root = _fake_sharded(tmp_path / "b")
    with pytest.raises(BundleError, match="is a sharded bundle .*`dsneuron run` runs it"):
        read_manifest(root)


def test_a_torchrun_world_of_another_size_is_refused_naming_both(tmp_path, monkeypatch):
    root = _fake_sharded(tmp_path / "b")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")

    def job(*a, **k):
        raise AssertionError("no rank may start")

    with pytest.raises(BundleError, match="WORLD_SIZE=3, but .* compiled for 2 ranks"):
        launch(root, read_sharded(root), job, {}, lambda s, t: None)


def _resealed(src: Path, dst: Path, shard: dict | None) -> Path:
    shutil.copytree(src, dst)
    m = read_manifest(dst)
    compiler = {k: v for k, v in m.compiler.items() if k != "shard"}
    if shard is not None:
        compiler["shard"] = shard
    (dst / MANIFEST).write_text(dataclasses.replace(m, compiler=compiler).to_json())
    return dst


def test_a_rank_bundle_opens_only_as_its_rank(micro_bundle, tmp_path):
    rank0 = _resealed(micro_bundle.path, tmp_path / "rank0", {"tp": 2, "ep": 2, "rank": 0})
    with pytest.raises(BundleError, match="is rank 0 of a sharded bundle of 2 ranks: `dsneuron run` the folder above it"):
        open_bundle(rank0)
    with pytest.raises(BundleError, match="opened as rank 1 of tp=2, ep=2"):
        open_bundle(rank0, shard=(2, 2, 1))
    assert open_bundle(rank0, shard=(2, 2, 0)).manifest.compiler["shard"]["rank"] == 0
    with pytest.raises(BundleError, match="compiled as one process, opened as rank 0"):
        open_bundle(micro_bundle.path, shard=(2, 2, 0))
    assert isinstance(read_manifest(rank0), Manifest)  # inspect still reads it


@pytest.mark.parametrize("args, says", [
    (["--tp", "0"], "--tp must be a positive integer"),
    (["--ep", "2"], "--ep 2 needs --tp"),
    (["--tp", "2", "--target", "neuron"], "cpu target only"),
    (["--tp", "2", "--probes"], "no probe outputs"),
    (["--tp", "2", "--ep", "0"], "--ep must be a positive integer"),
    (["--tp", "2", "--ep", "1"], "use --ep 2"),
    (["--tp", "3"], "--tp 3"),
])
def test_bad_parallel_flags_exit_2_before_any_work(monkeypatch, capsys, tmp_path, args, says):
    out = tmp_path / "b"
    assert run_cli(monkeypatch, "compile", "--config", "micro", "--out", str(out), *args) == 2
    assert says in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow  # about 4 minutes: two ranks' executables of micro's batch-1 buckets
def test_a_two_rank_bundle_generates_the_one_process_text(micro_bundle, monkeypatch, capsys, tmp_path):
    """TP=2 / EP=2 compiled from the checkpoint and plan of the micro bundle: `dsneuron run` of the
    sharded bundle (two spawned gloo ranks) prints the one-process bundle's greedy completion of
    the shipped short prompt and of another."""
    from dsneuron.compiler.default_prompts import default_prompts
    from dsneuron.compiler.placement import Parallel
    from dsneuron.compiler.sharded_bundle import compile_sharded_bundle

    out = tmp_path / "sharded"
    compile_sharded_bundle(micro_bundle.model_cfg, micro_bundle.compile_cfg, out, Parallel(2, 2),
                           cache_dir=micro_bundle.cache)
    assert read_sharded(out).tp == 2
    for prompt in (default_prompts(("short",))[0][1], "Hello world"):
        texts = []
        for bundle in (micro_bundle.path, out):
            assert run_cli(monkeypatch, "run", str(bundle), "--prompt", prompt, "--max-new-tokens", "12") == 0
            texts.append(capsys.readouterr().out)
        assert texts[0].strip() and texts[0] == texts[1], prompt


def test_an_output_inside_a_sharded_bundle_is_refused(tmp_path):
    """A --force compile into a rank folder would leave the sharded bundle around it broken."""
    from dsneuron.compiler.bundle_writer import OutputError, check_output

    root = _fake_sharded(tmp_path / "b")
    with pytest.raises(OutputError, match="is inside the sharded bundle"):
        check_output(root / rank_dir(0, 2), force=True)


def test_a_one_process_bundle_under_torchrun_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_cli(monkeypatch, "run", str(tmp_path), "--prompt", "hi") == 2
    assert "one-process bundle, launched with WORLD_SIZE=2" in capsys.readouterr().err
