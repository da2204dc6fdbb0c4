"""Bundle format, verification and atomic writing: runtime_min/bundle/schema.py, runtime_min/bundle/bundle.py,
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
from dsneuron.runtime_min.bundle.bundle import (check_creator, check_toolchain, host_toolchain, missing_packages,
                                                open_bundle)
from dsneuron.runtime_min.bundle.schema import SCHEMA_VERSION, SEAL, BundleError, Manifest, content_sha256
from dsneuron.runtime_min.executors.executor_cpu import check_archive, register_custom_ops
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


def edit_manifest(folder: Path, change, seal: bool = True) -> None:
    """Apply change(manifest dict) and write it back, sealed again unless seal=False (a bundle
    writer that wrote this content, rather than a hand edit)."""
    m = json.loads((folder / "manifest.json").read_text())
    change(m)
    if seal:
        m[SEAL] = content_sha256(m)
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


class _BranchOnOneToken(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[1] == 1 else x + 1


class _SameForEveryCount(torch.nn.Module):
    def forward(self, x):
        return x.softmax(-1) + x.sum(1, keepdim=True)


def test_export_refuses_semantics_that_change_at_one_token():
    """A dynamic token count of 1..8 must mean every count: an export that would compile the branch
    taken for counts > 1 (torch's default 0/1 specialisation) is refused, naming the dimension."""
    graph = StepGraph(_BranchOnOneToken(), (("x", torch.randn(1, 8)),), ("y",), dynamic={"x": {1: "T"}},
                      bounds={"T": (1, 8, 1)})
    with pytest.raises(Exception, match="T"):
        export_step(graph, {}, "test")
    uniform = StepGraph(_SameForEveryCount(), (("x", torch.randn(1, 8)),), ("y",), dynamic={"x": {1: "T"}},
                        bounds={"T": (1, 8, 1)})
    program = export_step(uniform, {}, "test").program
    assert [(r.lower, r.upper) for r in program.range_constraints.values()] == [(1, 8)]


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
    with pytest.raises(BundleError, match=r"schema version 99 is not supported by this runtime \(supported: 1, 2, 3, 4, 5, 6, 7\)"):
        open_bundle(copy)
    for cmd in ("run", "inspect"):
        args = [cmd, str(copy)] + (["--prompt", "hi"] if cmd == "run" else [])
        assert run_cli(monkeypatch, *args) == 2
        assert "schema version 99" in capsys.readouterr().err


def test_numerics_field(copy):
    """A manifest without `numerics` (every bundle before the field) is exact, and an exact
    manifest does not write it; "fast" needs schema version 5 and round-trips; anything else is
    refused by name."""
    m = Manifest.from_json((copy / "manifest.json").read_text())
    assert m.numerics == "exact" and "numerics" not in json.loads(m.to_json())
    fast = dataclasses.replace(m, numerics="fast", schema_version=5)
    assert Manifest.from_json(fast.to_json()).numerics == "fast"
    with pytest.raises(BundleError, match="numerics 'fast' needs schema version 5"):
        Manifest.from_json(dataclasses.replace(fast, schema_version=4).to_json())
    with pytest.raises(BundleError, match="manifest numerics: 'quick' is not one of exact, fast"):
        Manifest.from_json(dataclasses.replace(fast, numerics="quick").to_json())


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
    with pytest.raises(BundleError, match="is not a dsneuron bundle: it has no manifest.json"):
        open_bundle(tmp_path / "x")
    with pytest.raises(BundleError, match="does not exist"):
        open_bundle(tmp_path / "nope")
    (tmp_path / "f").write_text("")
    with pytest.raises(BundleError, match="is not a folder"):
        open_bundle(tmp_path / "f")


@pytest.mark.parametrize("what", ["nope", "empty", "file"])
def test_run_and_inspect_word_a_missing_bundle_alike(monkeypatch, capsys, tmp_path, what):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    errs = []
    for args in (["run", str(tmp_path / what), "--prompt", "hi"], ["inspect", str(tmp_path / what)]):
        assert run_cli(monkeypatch, *args) == 2
        errs.append(capsys.readouterr().err)
    assert errs[0] == errs[1]
    assert str(tmp_path / what) in errs[0]
    if what == "empty":
        assert "is not a dsneuron bundle: it has no manifest.json" in errs[0]


# ------------------------------------------------------------------------------------------ malformed manifests
_LATIN1 = b'{"format": "dsneuron-bundle", "created_by": "caf\xe9"}'


@pytest.mark.parametrize("data, message", [
    (_LATIN1, rf"manifest.json: not UTF-8 text \(invalid byte 0xe9 at offset {_LATIN1.index(0xe9)}\)"),
    (b"\xff\xfe{}", r"manifest.json: not UTF-8 text \(invalid byte 0xff at offset 0\)"),
    (b'{"format": "dsneuron-bundle",', r"manifest.json: not valid JSON"),
    (b"[" * 100000, r"manifest.json: not valid JSON"),
    (b'{"schema_version": 1e999}', r"manifest.json: not valid JSON .*out of the float range"),
    (b"[1, 2]", r"manifest top level: expected a JSON object, got list"),
])
def test_unreadable_manifest(monkeypatch, capsys, copy, data, message):
    (copy / "manifest.json").write_bytes(data)
    with pytest.raises(BundleError, match=message):
        open_bundle(copy)
    for args in (["run", str(copy), "--prompt", "hi"], ["inspect", str(copy)]):
        assert run_cli(monkeypatch, *args) == 2
        err = capsys.readouterr().err
        assert "manifest" in err and "Traceback" not in err


def _bucket(m: dict, kind: str, length: int) -> dict:
    return next(b for b in m["buckets"] if b["kind"] == kind and (b["seq_len"] if kind == "prefill" else b["capacity"]) == length)


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(buckets=[]), r"manifest.json: buckets is empty"),
    (lambda m: m.update(buckets=[b for b in m["buckets"] if b["kind"] == "prefill"]), r"buckets has no decode bucket"),
    (lambda m: m["buckets"][0].pop("capacity"), r"manifest buckets\[0\].capacity: missing field"),
    (lambda m: m["buckets"][1].update(batch="2"), r"manifest buckets\[1\].batch: expected int, got str"),
    (lambda m: m["buckets"][0].update(inputs={}), r"manifest buckets\[0\].inputs: expected list, got dict"),
    (lambda m: m["buckets"][0]["inputs"][0].update(shape=[2, -8]), r"buckets\[0\].inputs\[0\].shape: expected a list of non-negative"),
    (lambda m: m["buckets"].append(m["buckets"][1]), r"buckets\[3\] \(decode b2 s8\) duplicates buckets\[1\]"),
    (lambda m: _bucket(m, "decode", 8)["inputs"][1].update(shape=[3]), r"inputs: pos must be int64 \[2\] \(got int64 \[3\]\)"),
    (lambda m: _bucket(m, "prefill", 8)["inputs"].reverse(), r"a prefill bucket takes tokens, valid_len, engram_ids first"),
    (lambda m: _bucket(m, "decode", 16)["inputs"][3].update(name="other"), r"inputs: other is neither a data input nor a state"),
    (lambda m: m["tokenizer"].update(pad_token_id=-1), r"tokenizer.pad_token_id -1 is not a token id in 0..257"),
    (lambda m: m.update(state="kv"), r"manifest state: expected list, got str"),
    (lambda m: m["host_preprocessing"]["engram"].update(n_heads=[]), r"manifest host_preprocessing.engram: int\(\) argument"),
    (lambda m: m["host_preprocessing"]["engram"].update(token_map=[0, 1]), r"token_map: maps 2 token ids, the model's vocabulary has 258"),
])
def test_malformed_manifest_names_the_field(monkeypatch, capsys, copy, change, message):
    """Sealed but malformed content (what a faulty writer could produce): the loader or the session
    names the field; the CLI exits 2 without a traceback."""
    edit_manifest(copy, change)
    with pytest.raises(BundleError, match=message):
        Session.load(copy)
    assert run_cli(monkeypatch, "run", str(copy), "--prompt", "hi", "--max-new-tokens", "2") == 2
    assert "Traceback" not in capsys.readouterr().err


def _with_verify(m: dict, version: int = 7, logits: list | None = None, hidden: str = "main_hidden") -> None:
    """Add a verify bucket (b2, 3 tokens, capacity 16) built from the decode bucket of capacity 16."""
    import copy as copying

    b = copying.deepcopy(_bucket(m, "decode", 16))
    E, C = b["inputs"][2]["shape"][2:]
    b.update(kind="verify", seq_len=3)  # its file stays the decode executable: only the manifest is read
    b["inputs"][:3] = [{"name": "tokens", "shape": [2, 3], "dtype": "int64"}, {"name": "pos", "shape": [2], "dtype": "int64"},
                       {"name": "valid_len", "shape": [2], "dtype": "int64"},
                       {"name": "engram_ids", "shape": [2, 3, E, C], "dtype": "int64"}]
    b["outputs"][:1] = [{"name": "logits", "shape": logits or [2, 3, 258], "dtype": "float32"},
                        {"name": hidden, "shape": [2, 3, 32], "dtype": "bfloat16"}]
    m["buckets"].append(b)
    m["schema_version"] = version


def _with_draft(m: dict, version: int = 7, swap: bool = False, ring_out: list | None = None) -> None:
    """Add a draft bucket (b2, block 3, capacity 16; vocabulary 258, one ring [2, 4, 16]); swap:
    its first two inputs swapped; ring_out: the ring output's shape."""
    B, K, V = 2, 3, 258
    spec = lambda n, shape, dtype: {"name": n, "shape": shape, "dtype": dtype}  # noqa: E731
    ins = [spec("token", [B], "int64"), spec("pos", [B], "int64"), spec("main_hidden", [B, 4, 32], "bfloat16"),
           spec("seed_pos", [B], "int64"), spec("seed_count", [B], "int64"), spec("gumbel", [B, K, V], "float32"),
           spec("temperature", [B], "float32"), spec("mtp.0.ring", [B, 4, 16], "bfloat16")]
    if swap:
        ins[0], ins[1] = ins[1], ins[0]
    outs = [spec("draft_tokens", [B, K], "int64"), spec("draft_logits", [B, K, V], "float32"),
            spec("confidence", [B, K], "float32"), spec("mtp.0.ring", ring_out or [B, 4, 16], "bfloat16")]
    d = _bucket(m, "decode", 16)
    m["buckets"].append({"kind": "draft", "batch": B, "seq_len": K, "capacity": 16, "file": d["file"], "weights": [],
                         "inputs": ins, "outputs": outs, "cache_key": d["cache_key"]})
    m["schema_version"] = version


def _prefill_seeds(m: dict, version: int = 7, shape: list | None = None, dtype: str = "bfloat16") -> None:
    """The prefill bucket of 8 tokens returns main_hidden after its logits (a speculative compile's
    neuron prefill; only the manifest is read)."""
    b = _bucket(m, "prefill", 8)
    b["outputs"].insert(1, {"name": "main_hidden", "shape": shape or [b["batch"], 4, 32], "dtype": dtype})
    m["schema_version"] = version


@pytest.mark.parametrize("change, message", [
    (lambda m: _prefill_seeds(m, version=6), r"a prefill returning main_hidden needs schema version 7 \(the manifest says 6\)"),
    (lambda m: _prefill_seeds(m, dtype="float32"), r"a prefill's main_hidden must be bfloat16 \[batch=\d+, 1..seq_len=8, "
                                                   r"T\*D > 0\] \(got float32"),
    (lambda m: _prefill_seeds(m, shape=[1, 9, 32]), r"a prefill's main_hidden must be bfloat16 .* \(got bfloat16 \[1, 9, 32\]\)"),
    (lambda m: _with_verify(m, version=6), r"buckets\[3\]: a verify bucket needs schema version 7 \(the manifest says 6\)"),
    (lambda m: _with_verify(m, logits=[2, 258]), r"a verify bucket's first output must be the logits float32 "
                                                 r"\[batch=2, seq_len=3, V > 0\]"),
    (lambda m: _with_verify(m, hidden="layers.0.kv"), r"a verify bucket's second output must be main_hidden bfloat16"),
    (lambda m: _with_draft(m, version=6), r"a draft bucket needs schema version 7"),
    (lambda m: _with_draft(m, swap=True), r"a draft bucket takes token, pos, main_hidden, seed_pos, seed_count, gumbel, "
                                          r"temperature, then one ring per drafter stage"),
    (lambda m: _with_draft(m, ring_out=[2, 5, 16]), r"ring mtp.0.ring must be bfloat16 \[2, W, head_dim\] in and out"),
])
def test_malformed_verify_or_draft_bucket_names_the_field(copy, change, message):
    """A verify bucket (schema version 7) returns the logits at every position, then main_hidden; a
    draft bucket takes its named data inputs, then rings it returns as it takes them; the loader
    names what is wrong before any executable is touched."""
    edit_manifest(copy, change)
    with pytest.raises(BundleError, match=message):
        Session.load(copy)


def test_well_formed_verify_and_draft_buckets_are_read(copy):
    edit_manifest(copy, lambda m: (_with_verify(m), _with_draft(m), _prefill_seeds(m)))
    assert next(b for b in open_bundle(copy).manifest.buckets if b.kind == "prefill" and b.seq_len == 8
                ).outputs[1].name == "main_hidden"
    m = open_bundle(copy).manifest
    b = next(b for b in m.buckets if b.kind == "verify")
    assert (b.batch, b.seq_len, b.capacity, b.length) == (2, 3, 16, 16) and b.outputs[1].name == "main_hidden"
    d = next(b for b in m.buckets if b.kind == "draft")
    assert (d.batch, d.seq_len, d.length, d.inputs[-1].name) == (2, 3, 16, "mtp.0.ring")


def test_executable_argument_count_is_cross_checked(copy):
    edit_manifest(copy, lambda m: _bucket(m, "prefill", 8)["weights"].pop())
    session = Session.load(copy)
    with pytest.raises(BundleError, match=r"prefill_b2_s8.pt2: the executable takes 13 arguments, the manifest gives it "
                                          r"9 weights \+ 3 inputs"):
        session.generate("hi", max_new_tokens=1)


# ------------------------------------------------------------------------------------------ seal
def test_hand_edited_capacity_is_refused(monkeypatch, capsys, copy):
    """The trial's edit: a decode bucket's capacity 16 -> 32 ran into a C++ index error deep in the
    executable; it is now refused up front, naming the manifest as edited."""
    edit_manifest(copy, lambda m: _bucket(m, "decode", 16).update(capacity=32), seal=False)
    with pytest.raises(BundleError, match=r"manifest.json: was edited after `dsneuron compile` wrote it \(its content "
                                          r"does not match its manifest_sha256\)"):
        open_bundle(copy)
    for args in (["run", str(copy), "--prompt", "hi"], ["inspect", str(copy)]):
        assert run_cli(monkeypatch, *args) == 2
        assert "was edited" in capsys.readouterr().err


@pytest.mark.parametrize("change", [
    lambda m: _bucket(m, "decode", 8)["inputs"][3]["shape"].__setitem__(1, 9),
    lambda m: m["state"][0].update(fill="1.0"),
    lambda m: m["tokenizer"].update(eos_token_id=5),
    lambda m: m.update(extra_field=1),
])
def test_any_edit_breaks_the_seal(copy, change):
    edit_manifest(copy, change, seal=False)
    with pytest.raises(BundleError, match="was edited"):
        open_bundle(copy)


def test_seal_ignores_layout_and_is_required(copy):
    m = json.loads((copy / "manifest.json").read_text())
    assert m[SEAL] == content_sha256(m) == hashlib.sha256(json.dumps(
        {k: v for k, v in m.items() if k != SEAL}, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    reordered = dict(reversed(list(m.items())))
    (copy / "manifest.json").write_text(json.dumps(reordered, indent=4))
    open_bundle(copy)
    del m[SEAL]
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="manifest.json: has no manifest_sha256 seal.*recompile the bundle"):
        open_bundle(copy)


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


def test_version_rule():
    """A runtime runs the bundles of its own major.minor release line, any patch."""
    for ok in ("dsneuron 0.1.0", "dsneuron 0.1.7", "dsneuron 0.1.2+local"):
        check_creator(ok, "0.1.0")
    for bad, message in [("dsneuron 0.0.1", r"written by dsneuron 0.0.1; this runtime \(dsneuron 0.1.0\) runs bundles "
                                            r"of dsneuron 0.1.x only"),
                         ("dsneuron 1.1.0", "runs bundles of dsneuron 0.1.x only"),
                         ("", "created_by is '', not 'dsneuron X.Y.Z'"),
                         ("optimum 0.1.0", "created_by is 'optimum 0.1.0'")]:
        with pytest.raises(BundleError, match=message):
            check_creator(bad, "0.1.0")


def test_bundle_of_another_release_is_refused_before_anything_loads(copy, monkeypatch, capsys):
    edit_manifest(copy, lambda m: m.update(created_by="dsneuron 0.0.1"))  # resealed, as a writer would
    for args in (["run", str(copy), "--prompt", "hi"], ["inspect", str(copy)]):
        assert run_cli(monkeypatch, *args) == 2
        assert "written by dsneuron 0.0.1" in capsys.readouterr().err


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
    monkeypatch.setattr(pipeline, "build_steps_for_config", lambda m, c, cache_dir=None, probes=False, target="cpu": kit.parts)
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
    monkeypatch.setattr(pipeline, "build_steps_for_config", lambda m, c, cache_dir=None, probes=False, target="cpu": pytest.fail("did work before failing"))
    out = tmp_path / "art"
    assert run_cli(monkeypatch, *compile_args(config, out, tmp_path, "--target", "neuron")) == 2
    err = capsys.readouterr().err
    for text in ("neuronxcc", "nki", "AWS Neuron pip index"):
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


def _disk_usage_with_free(free: int):
    real = shutil.disk_usage

    def fake(path):
        u = real(path)
        return type(u)(u.total, u.total - free, free)
    return fake


def test_too_little_disk_for_the_weights_exits_2_before_writing(monkeypatch, capsys, tmp_path, cli_kit):
    _, config, _ = cli_kit
    monkeypatch.setattr(shutil, "disk_usage", _disk_usage_with_free(5 * 2**20))
    assert run_cli(monkeypatch, *compile_args(config, tmp_path / "art", tmp_path)) == 2
    err = capsys.readouterr().err
    assert "not enough disk space for the bundle's weights.safetensors" in err and "5.0 MiB free" in err
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.tmp-*"))


def test_disk_full_while_writing_weights_exits_2_and_leaves_nothing(monkeypatch, capsys, tmp_path, cli_kit):
    """ENOSPC from a write of the streamed weights file, after part of it was written."""
    import errno

    from dsneuron.compiler import bundle_writer

    _, config, _ = cli_kit
    real = bundle_writer.tensor_chunks

    def full(t, size):
        yield from real(t[:1], size)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(bundle_writer, "tensor_chunks", full)
    assert run_cli(monkeypatch, *compile_args(config, tmp_path / "art", tmp_path)) == 2
    err = capsys.readouterr().err
    assert "disk full while writing the bundle's weights.safetensors" in err and "MiB free now" in err
    assert "Traceback" not in err
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.tmp-*"))


def test_output_check_runs_before_compiling(tmp_path):
    kit = stand_in.make_kit(tmp_path, {"max_seq_len": 8, "decode_context_lens": [8]})
    out = tmp_path / "busy"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    with pytest.raises(OutputExistsError):
        pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, out, kit.parts, cache_dir=tmp_path / "c", console=QUIET)
    assert os.listdir(out) == ["manifest.json"]


def test_compile_checks_out_before_making_the_checkpoint(monkeypatch, capsys, tmp_path, cli_kit):
    """--out is refused before the (possibly minutes-long) checkpoint and weights step."""
    _, config, calls = cli_kit
    monkeypatch.setattr(pipeline, "build_steps_for_config",
                        lambda m, c, cache_dir=None, probes=False, target="cpu": pytest.fail("made the checkpoint before checking --out"))
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    assert run_cli(monkeypatch, *compile_args(config, foreign, tmp_path)) == 2
    assert "is not a dsneuron bundle" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert run_cli(monkeypatch, *compile_args(config, blocker / "sub" / "out", tmp_path)) == 2
    assert f"{blocker} is not a folder" in capsys.readouterr().err
    assert calls == [] and not (blocker.parent / "sub").exists()


def test_unwritable_parent_is_refused(tmp_path, monkeypatch):
    """No write permission where the temporary folder goes (simulated: tests may run as root,
    who may write anywhere)."""
    from dsneuron.compiler import bundle_writer

    real = os.access
    monkeypatch.setattr(bundle_writer.os, "access", lambda p, mode: False if Path(p) == tmp_path else real(p, mode))
    with pytest.raises(bundle_writer.OutputError, match=f"no permission to write in {tmp_path}"):
        bundle_writer.check_output(tmp_path / "new" / "out", force=False)


def test_treespec_deprecation_is_hidden_only_inside_the_backend_compile(tmp_path, monkeypatch):
    """torch's `isinstance(treespec, LeafSpec)` FutureWarning fired once per bucket from
    aoti_compile_and_package; exactly that warning is filtered there, others still show."""
    import warnings

    def fake_aoti(program, package_path, inductor_configs):
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
                      "treespec.is_leaf()` instead.", FutureWarning)
        warnings.warn("some other future change", FutureWarning)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", DeprecationWarning)
        with zipfile.ZipFile(package_path, "w") as z:  # a package: compile_cpu reads its kernel sources
            z.writestr("m/data/aotinductor/model/k.kernel.cpp", "// no kernels")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_aoti)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        backend_cpu.compile_cpu(None, tmp_path / "m.pt2", {})
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning)  # outside: shown
    assert [(w.category, str(w.message)[:30]) for w in seen] == [
        (FutureWarning, "some other future change"), (DeprecationWarning, "`isinstance(treespec, LeafSpec"),
        (FutureWarning, "`isinstance(treespec, LeafSpec")]
    assert zipfile.ZipFile(tmp_path / "m.pt2").namelist() == ["m/data/aotinductor/model/k.kernel.cpp"]


def test_compile_without_a_terminal_logs_each_event_as_a_line(tmp_path):
    """Piped or logged (no terminal), compile prints one plain line per bucket event, as it happens,
    instead of rich's live display (which shows only at the end there)."""
    src, kit = stand_in.shared_bundle()
    log = io.StringIO()
    console = Console(file=log, width=300)
    assert not console.is_terminal
    pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, tmp_path / "again", kit.parts, cache_dir=src.parent / "cache",
                            console=console)
    lines = log.getvalue().splitlines()
    labels = [pb.label for pb in pipeline.plan_buckets(kit.compile_cfg, kit.model_cfg).buckets]
    for label in labels:
        assert f"{label}: waiting" in lines and any(ln.startswith(f"{label}: cached") for ln in lines), lines
    assert not any(ch in log.getvalue() for ch in "⠋⠙⠹━"), "no spinner or bar characters in a log"
    assert lines[-1].startswith("bundle written to")


def test_weights_in_shards_load_as_one_file(micro_bundle, tmp_path):
    """The micro bundle rewritten with its weights in shards of at most 1 MiB of tensors
    (BundleWriter.write_weight_shards, Manifest.weight_files at schema version 3) loads the same
    tensors and generates the same tokens; a version-2 manifest naming weight_files is refused."""
    from safetensors.torch import load_file

    from dsneuron.compiler.bundle_writer import BundleWriter
    from dsneuron.runtime_min.bundle.bundle import read_manifest
    from dsneuron.runtime_min.bundle.schema import WEIGHT_FILES_SCHEMA_VERSION, WEIGHTS

    src = micro_bundle.path
    m = read_manifest(src)
    stored = load_file(str(src / WEIGHTS))
    with BundleWriter(tmp_path / "sharded_weights", force=False) as w:
        for rel in m.files:
            if rel != WEIGHTS:
                w.copy_in(src / rel, rel)
        names = w.write_weight_shards(stored, shard_bytes=2**20)
        out = w.commit(dataclasses.replace(m, weight_files=names, schema_version=max(m.schema_version, WEIGHT_FILES_SCHEMA_VERSION)))
    assert len(names) > 2 and not (out / WEIGHTS).exists()
    assert all(sum(t.numel() * t.element_size() for t in load_file(str(out / n)).values()) <= 2**20 or
               len(load_file(str(out / n))) == 1 for n in names)
    one, split = Session.load(src), Session.load(out)
    assert one.runner.weights.keys() == split.runner.weights.keys()
    assert all(torch.equal(one.runner.weights[n], split.runner.weights[n]) for n in one.runner.weights)
    assert one.generate_ids(["Hello world"], 6) == split.generate_ids(["Hello world"], 6)
    old = dataclasses.replace(read_manifest(out), schema_version=2).to_json()
    with pytest.raises(BundleError, match="weight_files needs schema version 3"):
        Manifest.from_json(old)


# ------------------------------------------------------------------------------------------ prepare recipes
def test_prepared_specs_are_what_prepare_tensors_makes(micro_cfg, micro_checkpoint):
    """Every recipe of the micro model (fp8, fp4, bf16, fp32; stacked experts; grouped wo_a):
    the shapes and dtypes without running it equal what the recipe makes from the real tensors."""
    from dsneuron.graphs import checkpoint as ck
    from dsneuron.graphs.engram import engram_layout
    from dsneuron.graphs.kernel_weights import kernel_recipes
    from dsneuron.graphs.model import Transformer
    from dsneuron.graphs.weights import model_weights
    from dsneuron.kernels_nki.prepare import prepare_tensors, prepared_specs

    rows = engram_layout(micro_cfg).num_embeddings
    weights = model_weights(ck.load_checkpoint(micro_checkpoint, micro_cfg, rows), micro_cfg)
    recipes = kernel_recipes(Transformer(micro_cfg, rows, 64), weights)
    assert {r.fmt for r in recipes} >= {"fp8", "fp4"} and any(len(r.weights) > 1 for r in recipes)
    for r in recipes:
        made = prepare_tensors(r, weights)
        assert all(t.is_contiguous() for t in made.values())
        assert prepared_specs(r, weights) == {n: (tuple(t.shape), t.dtype) for n, t in made.items()}, r.outputs


def test_prepared_specs_refuse_what_prepare_tensors_cannot_make():
    from dsneuron.kernels_nki.prepare import Prepare, prepared_specs

    t = {"a": torch.zeros(4, 64, dtype=torch.bfloat16), "b": torch.zeros(5, 64, dtype=torch.bfloat16),
         "s": torch.zeros(4, 2, dtype=torch.uint8)}
    for message, recipe in [("differ in shape", Prepare("bf16", ("a", "b"), (), 0, ("w", "ws"))),
                            ("do not split into 3 groups", Prepare("bf16", ("a",), (), 3, ("w", "ws"))),
                            ("takes no scale", Prepare("bf16", ("a",), ("s",), 0, ("w", "ws"))),
                            ("weight must be one of", Prepare("fp8", ("a",), ("s",), 0, ("w", "ws")))]:
        with pytest.raises(ValueError, match=message):
            prepared_specs(recipe, t)
