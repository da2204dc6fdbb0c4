"""Bundle format, verification and atomic writing: runtime_min/schema.py, runtime_min/bundle.py,
compiler/bundle_writer.py, and the compile/inspect CLI on bad input (exit code 2, message names the
problem and the limit, nothing overwritten or left half-written)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from rich.console import Console

import stand_in
from stand_in import run_cli
from dsneuron.compiler import backend_cpu
from dsneuron.compiler import compile as pipeline
from dsneuron.compiler.bundle_writer import OutputExistsError
from dsneuron.compiler.cache import normalised_graph
from dsneuron.compiler.export import CompileError, StepGraph, export_step
from dsneuron.compiler.lower import finish, inline_mode
from dsneuron.runtime_min.bundle import check_toolchain, host_toolchain, missing_packages, open_bundle
from dsneuron.runtime_min.executor_cpu import check_archive, register_custom_ops
from dsneuron.runtime_min.schema import SCHEMA_VERSION, BundleError, Manifest
from dsneuron.runtime_min.session import Session

QUIET = Console(file=io.StringIO())


def tree_digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def copy(tmp_path):
    """A private copy of the compiled stand-in bundle."""
    src, _ = stand_in.shared_bundle()
    dst = tmp_path / "bundle"
    shutil.copytree(src, dst)
    return dst


def edit_manifest(folder: Path, change) -> None:
    m = json.loads((folder / "manifest.json").read_text())
    change(m)
    (folder / "manifest.json").write_text(json.dumps(m))


# ------------------------------------------------------------------------------------------ format
def test_manifest_round_trips_and_lists_every_file():
    src, _ = stand_in.shared_bundle()
    text = (src / "manifest.json").read_text()
    m = Manifest.from_json(text)
    assert Manifest.from_json(m.to_json()) == m
    on_disk = {p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(m.files) == on_disk
    assert m.schema_version == SCHEMA_VERSION and m.target == "cpu"
    assert m.compiler["custom_ops"] == {"dsneuron_test::gated_mix": "inline"}
    assert sorted(b.file for b in m.buckets) == ["buckets/decode_b2_s16.pt2", "buckets/decode_b2_s8.pt2",
                                                 "buckets/prefill_b2_s8.pt2"]
    assert {s.name for s in m.state} == {"layers.0.kv", "layers.0.ring", "layers.1.kv", "layers.1.ring"}
    assert m.host_preprocessing["engram"]["max_ngram_size"] == 3


@torch.library.custom_op("dsneuron_test::branchy", mutates_args=(), device_types="cpu")
def branchy(x: torch.Tensor) -> torch.Tensor:
    """A reference with data-dependent Python control flow: export cannot trace it."""
    return x + 1 if bool(x.sum() > 0) else x - 1


@branchy.register_fake
def _branchy_fake(x):
    return torch.empty_like(x)


class _Both(torch.nn.Module):
    def forward(self, x):
        return torch.ops.dsneuron_test.branchy(torch.ops.dsneuron_test.gated_mix(x, x, 0.5))


def test_lowering_inlines_traceable_references_and_calls_the_rest():
    mode = inline_mode("cpu")
    graph = StepGraph(_Both(), (("x", torch.randn(3, 4)),), ("y",))
    exported = export_step(graph, {}, "test", mode=mode)
    modes = finish(exported.program, mode, "test")
    assert modes == {"dsneuron_test::branchy": "call", "dsneuron_test::gated_mix": "inline"}
    targets = {str(n.target) for n in exported.program.graph.nodes}
    assert "dsneuron_test.branchy.default" in targets
    assert not any("gated_mix" in t for t in targets)
    assert "aten._assert_tensor_metadata.default" not in targets
    with pytest.raises(CompileError, match="no lowering for target 'neuron'"):
        inline_mode("neuron")


def test_runtime_registers_called_ops():
    register_custom_ops({"dsneuron_test::branchy": "call", "dsneuron::whatever": "inline"})
    with pytest.raises(BundleError, match="call custom op nowhere::x at run time, but no loaded module registers it"):
        register_custom_ops({"nowhere::x": "call"})


def test_weights_stored_once_and_bundle_size(tmp_path):
    """Every bucket takes the same weight names from one file; the executables add little."""
    src, kit = stand_in.shared_bundle()
    m = Manifest.from_json((src / "manifest.json").read_text())
    assert len({b.weights for b in m.buckets}) == 1
    # norm is stored bf16 and promoted at load (load_casts); everything else as the model holds it
    assert m.load_casts == {"norm": "float32"}
    weights_bytes = sum(t.numel() * (2 if n == "norm" else t.element_size()) for n, t in kit.parts.weights.items())
    assert 0 < m.files["weights.safetensors"]["size"] - weights_bytes < 4096  # the safetensors header on top


def test_inexact_narrowing_is_refused_before_compiling(tmp_path):
    kit = stand_in.make_kit(tmp_path, {"max_seq_len": 8, "decode_context_lens": [8]})
    parts = dataclasses.replace(kit.parts, stored_dtypes={"wq.0": torch.bfloat16})
    with pytest.raises(CompileError, match="weight wq.0: storing float32 as bfloat16 is not exact"):
        pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, tmp_path / "b", parts, cache_dir=tmp_path / "c", console=QUIET)
    assert not (tmp_path / "b").exists()


def test_moved_bundle_loads_and_generates_the_same(tmp_path, copy):
    src, _ = stand_in.shared_bundle()
    moved = tmp_path / "elsewhere" / "deeper" / "renamed"
    moved.parent.mkdir(parents=True)
    shutil.move(copy, moved)
    assert Session.load(moved).generate("hi", max_new_tokens=4) == Session.load(src).generate("hi", max_new_tokens=4)


# ------------------------------------------------------------------------------------------ verification
def test_missing_file(monkeypatch, capsys, copy):
    (copy / "buckets" / "decode_b2_s16.pt2").unlink()
    with pytest.raises(BundleError, match="bundle file buckets/decode_b2_s16.pt2 is missing"):
        open_bundle(copy)
    assert run_cli(monkeypatch, "run", str(copy), "--prompt", "hi") == 2
    assert "decode_b2_s16.pt2 is missing" in capsys.readouterr().err


@pytest.mark.parametrize("rel", ["weights.safetensors", "buckets/prefill_b2_s8.pt2", "tokenizer/tokenizer.json"])
def test_tampered_file(monkeypatch, capsys, copy, rel):
    data = bytearray((copy / rel).read_bytes())
    data[len(data) // 2] ^= 0x01
    (copy / rel).write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"bundle file {rel} does not match its sha256"):
        open_bundle(copy)
    assert run_cli(monkeypatch, "run", str(copy), "--prompt", "hi") == 2
    assert "does not match its sha256" in capsys.readouterr().err


def test_truncated_file(copy):
    path = copy / "weights.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(BundleError, match=r"weights.safetensors has \d+ bytes, the manifest records \d+"):
        open_bundle(copy)


def test_unknown_schema_version(monkeypatch, capsys, copy):
    edit_manifest(copy, lambda m: m.update(schema_version=99))
    with pytest.raises(BundleError, match=rf"schema version 99 is not supported by this runtime \(supported: {SCHEMA_VERSION}\)"):
        open_bundle(copy)
    for cmd in ("run", "inspect"):
        args = [cmd, str(copy)] + (["--prompt", "hi"] if cmd == "run" else [])
        assert run_cli(monkeypatch, *args) == 2
        assert "schema version 99" in capsys.readouterr().err


@pytest.mark.skipif(not missing_packages("neuron"), reason="the Neuron SDK is installed here")
def test_unavailable_target(monkeypatch, capsys, copy):
    edit_manifest(copy, lambda m: m.update(target="neuron"))
    with pytest.raises(BundleError, match=r"target 'neuron' is not available on this host for running bundles: "
                                          r"missing Python packages torch_neuronx; .*AWS Neuron pip index"):
        open_bundle(copy)
    assert run_cli(monkeypatch, "run", str(copy), "--prompt", "hi") == 2


def test_file_used_but_unlisted(copy):
    edit_manifest(copy, lambda m: m["files"].pop("buckets/decode_b2_s8.pt2"))
    with pytest.raises(BundleError, match="buckets/decode_b2_s8.pt2 is used by the bundle but has no checksum"):
        open_bundle(copy)


def test_path_outside_the_bundle(copy):
    edit_manifest(copy, lambda m: m["files"].update({"../escape": {"sha256": "0" * 64, "size": 1}}))
    with pytest.raises(BundleError, match="leaves the bundle folder"):
        open_bundle(copy)


def test_not_a_bundle(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(BundleError, match="is not a bundle: manifest.json is missing"):
        open_bundle(tmp_path / "x")
    with pytest.raises(BundleError, match="does not exist"):
        open_bundle(tmp_path / "nope")


def test_toolchain_rules():
    host = {"python": "3.11.7", "torch": "2.13.0+cpu", "machine": "x86_64", "cpu_isa": ["avx", "avx2", "fma"]}
    check_toolchain({**host, "torch": "2.13.0", "python": "3.12.1", "cpu_isa": ["avx2"]}, host)  # compatible
    with pytest.raises(BundleError, match=r"compiled with torch 2.12.0, this host has torch 2.13.0\+cpu"):
        check_toolchain({**host, "torch": "2.12.0"}, host)
    with pytest.raises(BundleError, match="compiled for machine 'aarch64'"):
        check_toolchain({**host, "machine": "aarch64"}, host)
    with pytest.raises(BundleError, match="lacks ISA extensions the bundle's executables may use: avx512f"):
        check_toolchain({**host, "cpu_isa": ["avx2", "avx512f"]}, host)
    check_toolchain(host_toolchain())


def test_archive_with_pickle_is_refused(tmp_path):
    src, _ = stand_in.shared_bundle()
    check_archive(src / "buckets" / "prefill_b2_s8.pt2")
    bad = tmp_path / "bad.pt2"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("m/archive_format", "pt2")
        z.writestr("m/data/aotinductor/model/x.so", b"\0")
        z.writestr("m/data/weights/w.pkl", b"\x80\x04")
    with pytest.raises(BundleError, match="unexpected archive member 'm/data/weights/w.pkl'"):
        check_archive(bad)


def test_inspect_prints_the_bucket_table(monkeypatch, capsys):
    src, _ = stand_in.shared_bundle()
    assert run_cli(monkeypatch, "inspect", str(src)) == 0
    out = capsys.readouterr().out
    for text in ("target cpu", "buckets/prefill_b2_s8.pt2", "buckets/decode_b2_s16.pt2", "torch 2.13",
                 "weights", "verified"):
        assert text in out


# ------------------------------------------------------------------------------------------ writing
@pytest.fixture()
def cli_kit(tmp_path, monkeypatch):
    """The compile CLI wired to the stand-in (with a stub backend that writes the graph text):
    returns (kit, config path, backend calls)."""
    kit = stand_in.make_kit(tmp_path, {"max_seq_len": 8, "decode_context_lens": [8]})
    config = tmp_path / "stand_in.json"
    config.write_text(json.dumps({"model": kit.model_cfg.to_dict(), "compile": kit.compile_cfg.to_dict()}))
    monkeypatch.setattr(pipeline, "build_steps_for_config", lambda m, c, cache_dir=None, probes=False: kit.parts)
    calls = []

    def fake(program, out, flags):
        calls.append(out.name)
        out.write_text(normalised_graph(program))

    monkeypatch.setattr(backend_cpu, "compile_cpu", fake)
    return kit, config, calls


def compile_args(config: Path, out: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["compile", "--config", str(config), "--out", str(out), "--cache-dir", str(tmp_path / "cache"), *extra]


def test_existing_output_folder(monkeypatch, capsys, tmp_path, cli_kit):
    _, config, _ = cli_kit
    out = tmp_path / "art"
    assert run_cli(monkeypatch, *compile_args(config, out, tmp_path)) == 0
    before = tree_digest(out)
    assert run_cli(monkeypatch, *compile_args(config, out, tmp_path)) == 2
    assert "already holds a bundle; pass --force" in capsys.readouterr().err
    assert tree_digest(out) == before
    assert run_cli(monkeypatch, *compile_args(config, out, tmp_path, "--force")) == 0
    open_bundle(out)


def test_interrupted_compile_keeps_the_old_bundle(monkeypatch, tmp_path, cli_kit):
    kit, config, calls = cli_kit
    out = tmp_path / "art"
    assert run_cli(monkeypatch, *compile_args(config, out, tmp_path)) == 0
    before = tree_digest(out)

    def interrupt(program, path, flags):
        calls.append(path.name)
        if len(calls) == 3:  # the second bucket of the second compile
            raise KeyboardInterrupt
        path.write_text("partial")

    monkeypatch.setattr(backend_cpu, "compile_cpu", interrupt)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C mid-compile, with --force
        pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, out, kit.parts, force=True,
                                cache_dir=tmp_path / "fresh", console=QUIET)
    assert tree_digest(out) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".art")] == []
    open_bundle(out)


def test_interrupted_first_compile_leaves_no_folder(monkeypatch, tmp_path, cli_kit):
    kit, _, _ = cli_kit

    def interrupt(program, path, flags):
        raise KeyboardInterrupt

    monkeypatch.setattr(backend_cpu, "compile_cpu", interrupt)
    with pytest.raises(KeyboardInterrupt):
        pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, tmp_path / "art", kit.parts,
                                cache_dir=tmp_path / "c", console=QUIET)
    assert not (tmp_path / "art").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".art")] == []


def test_placeholder_folder_counts_as_empty(monkeypatch, tmp_path, cli_kit):
    _, config, _ = cli_kit
    out = tmp_path / "artifacts"
    out.mkdir()
    (out / "README.md").write_text("the default output folder\n")
    assert run_cli(monkeypatch, *compile_args(config, out, tmp_path)) == 0
    assert (out / "README.md").read_text() == "the default output folder\n"
    assert "README.md" not in Manifest.from_json((out / "manifest.json").read_text()).files
    open_bundle(out)


def test_foreign_folder_is_never_replaced(monkeypatch, capsys, tmp_path, cli_kit):
    _, config, _ = cli_kit
    out = tmp_path / "home"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    assert run_cli(monkeypatch, *compile_args(config, out, tmp_path, "--force")) == 2
    assert "is not a dsneuron bundle" in capsys.readouterr().err
    assert (out / "thesis.tex").read_text() == "precious"


def test_leftovers_of_dead_processes_are_removed(monkeypatch, tmp_path, cli_kit):
    _, config, _ = cli_kit
    dead = tmp_path / ".art.tmp-999999999-0123abcd"
    dead.mkdir()
    (dead / "weights.safetensors").write_bytes(b"half")
    assert run_cli(monkeypatch, *compile_args(config, tmp_path / "art", tmp_path)) == 0
    assert not dead.exists()


def test_neuron_target_fails_fast(monkeypatch, capsys, tmp_path, cli_kit):
    if not missing_packages("neuron"):
        pytest.skip("the Neuron SDK is installed here")
    _, config, calls = cli_kit
    monkeypatch.setattr(pipeline, "build_steps_for_config", lambda m, c, cache_dir=None, probes=False: pytest.fail("did work before failing"))
    out = tmp_path / "art"
    assert run_cli(monkeypatch, *compile_args(config, out, tmp_path, "--target", "neuron")) == 2
    err = capsys.readouterr().err
    for text in ("torch_neuronx", "neuronxcc", "nki", "AWS Neuron pip index"):
        assert text in err
    assert not out.exists() and calls == []


def test_config_error_exits_2(monkeypatch, capsys, tmp_path, cli_kit):
    kit, config, calls = cli_kit
    raw = json.loads(config.read_text())
    raw["compile"]["prefill_seq_lens"] = [7]
    config.write_text(json.dumps(raw))
    assert run_cli(monkeypatch, *compile_args(config, tmp_path / "art", tmp_path)) == 2
    assert "compile.prefill_seq_lens: 7 is not a multiple of 2" in capsys.readouterr().err
    assert calls == [] and not (tmp_path / "art").exists()


def test_output_check_runs_before_compiling(tmp_path):
    kit = stand_in.make_kit(tmp_path, {"max_seq_len": 8, "decode_context_lens": [8]})
    out = tmp_path / "busy"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    with pytest.raises(OutputExistsError):
        pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, out, kit.parts, cache_dir=tmp_path / "c", console=QUIET)
    assert os.listdir(out) == ["manifest.json"]
