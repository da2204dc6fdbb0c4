"""The neuron target: NEFF header checks (runtime_min/executors/neff.py), neuronx-cc flags and cache keys
(compiler/backend_neuron.py), the fail-fast without the SDK, the bundle pipeline (one loop for both
targets, compiler/compile.py) and the executor choice with a stand-in for the SDK seam, the NKI
kernel adapters (kernels_nki/neuron_adapters.py) run against the NumPy stand-in of `nki` and
compared with the torch reference ops, what a host needs to compile or only to run a neuron bundle
(runtime_min/bundle/bundle.py), and SDK-gated tests that compile and run on Trainium.

Every NEFF written here is a SYNTHETIC test file: a header laid out by hand from the documented
struct (aws-neuron-sdk:neuron-runtime/explore/work-with-neff-files.rst) in front of a small gzip'd
tar. Nothing here produces or claims a real NEFF.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.machinery
import importlib.util
import io
import json
import shutil
import struct
import tarfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from rich.console import Console

import stand_in
from oracles import assert_close, f64, ulp_distance_bf16
from stand_in import run_cli
from test_mqa_logits import MqaCase, make_blocks, make_mqa_inputs
from test_nki_kernels import KERNEL_MODULES
from test_sparse_attn import ABS_TOL, COS_TOL, REL_TOL
from test_sparse_attn import Case as AttnCase
from test_sparse_attn import make_inputs as make_attn_inputs
from dsneuron.compiler import backend_cpu, backend_neuron
from dsneuron.compiler import compile as pipeline
from dsneuron.compiler.cache import cache_key, normalised_graph
from dsneuron.compiler.export import CompileError, export_step
from dsneuron.graphs.config import ConfigError
from dsneuron.compiler.lower import finish
from dsneuron.kernels_nki import sim
from dsneuron.kernels_nki.neuron_adapters import (BINDINGS, NkiBinding, call_mqa_logits, call_mqa_logits_sparse,
                                                  call_sparse_attn)
from dsneuron.runtime_min.bundle import bundle as bundle_mod
from dsneuron.runtime_min.bundle.bundle import missing_packages, open_bundle
from dsneuron.runtime_min.executors.executor_neuron import NeuronExecutor, check_sdk_versions, neff_records
from dsneuron.runtime_min.executors.neff import (HEADER_SIZE, NeffError, NeffRecord, check_header, host_lnc,
                                                 parse_header, read_header, verify_neff)
from dsneuron.runtime_min.bundle.schema import SEAL, BundleError, Manifest, content_sha256
from dsneuron.runtime_min.session import Session

QUIET = Console(file=io.StringIO())

# Field offsets of the NEFF header, added up by hand from the documented struct (8+8+8+8+8 = 40,
# +128 = 168, +4 = 172, +32 = 204, +16 = 220, +256 = 476, +4 = 480, +64 = 544, +8 = 552, +4 = 556,
# + 468 bytes of padding = 1024). Independent of runtime_min/executors/neff.py's struct format.
U64 = {"pkg_version": 0, "header_size": 8, "data_size": 16, "neff_version_major": 24, "neff_version_minor": 32,
       "feature_bits": 544}
U32 = {"num_tpb": 168, "requested_tpb_count": 476, "lnc_size": 552}
BYTES = {"build_version": (40, 128), "hash": (172, 32), "uuid": (204, 16), "name": (220, 256),
         "tpb_per_node": (480, 64)}


def synthetic_payload(note: str = "") -> bytes:
    """A gzip'd tar with one JSON member: stands in for the NEFF tarball (tests only)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        body = json.dumps({"synthetic test file, not a NEFF": True, "note": note}).encode()
        info = tarfile.TarInfo("neff.json")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    return gzip.compress(raw.getvalue(), mtime=0)


def synthetic_header(data_size: int, **fields) -> bytes:
    """1024 header bytes; `fields` override the defaults (names as in the struct)."""
    values = {"pkg_version": 3, "header_size": HEADER_SIZE, "data_size": data_size, "neff_version_major": 2,
              "neff_version_minor": 0, "feature_bits": 0, "num_tpb": 1, "requested_tpb_count": 1, "lnc_size": 1,
              "build_version": b"synthetic-test", "hash": b"\x11" * 32, "uuid": b"\x22" * 16,
              "name": b"synthetic", "tpb_per_node": b"\x01", **fields}
    buf = bytearray(HEADER_SIZE)
    for name, off in U64.items():
        struct.pack_into("<Q", buf, off, values[name])
    for name, off in U32.items():
        struct.pack_into("<I", buf, off, values[name])
    for name, (off, size) in BYTES.items():
        raw = values[name]
        assert len(raw) <= size
        buf[off:off + len(raw)] = raw
    return bytes(buf)


def write_synthetic_neff(path: Path, note: str = "", **fields) -> Path:
    payload = synthetic_payload(note)
    path.write_bytes(synthetic_header(fields.pop("data_size", len(payload)), **fields) + payload)
    return path


RECORD = NeffRecord(flags=("--target=trn2",), lnc_size=1, feature_bits=0, neff_version="2.0")


# ------------------------------------------------------------------------------------------ NEFF header
def test_header_fields_decode_at_the_documented_offsets():
    raw = synthetic_header(1234, pkg_version=7, neff_version_major=2, neff_version_minor=5, feature_bits=0x1_0000_0005,
                           num_tpb=3, requested_tpb_count=4, lnc_size=2, name=b"graph.neff", build_version=b"2.21.1")
    h = parse_header(raw, "x.neff")
    assert (h.pkg_version, h.header_size, h.data_size) == (7, 1024, 1234)
    assert (h.neff_version, h.num_tpb, h.requested_tpb_count) == ("2.5", 3, 4)
    assert (h.feature_bits, h.lnc_size) == (0x1_0000_0005, 2)
    assert (h.name, h.build_version, h.hash, h.uuid) == ("graph.neff", "2.21.1", b"\x11" * 32, b"\x22" * 16)
    assert h.tpb_per_node == b"\x01"


def test_valid_synthetic_neff_passes(tmp_path):
    path = write_synthetic_neff(tmp_path / "prefill_b1_s8.neff")
    h = verify_neff(path, RECORD, lnc=1)
    assert h.data_size == path.stat().st_size - 1024


def test_truncated_file_is_refused(tmp_path):
    whole = write_synthetic_neff(tmp_path / "a.neff").read_bytes()
    (tmp_path / "short.neff").write_bytes(whole[:700])
    with pytest.raises(NeffError, match=r"short.neff: 700 bytes, shorter than the 1024-byte NEFF header"):
        verify_neff(tmp_path / "short.neff", RECORD, lnc=1)
    (tmp_path / "cut.neff").write_bytes(whole[:-10])
    with pytest.raises(NeffError, match=rf"cut.neff: data_size is {len(whole) - 1024} bytes but the file holds "
                                        rf"{len(whole) - 1034} after the header"):
        verify_neff(tmp_path / "cut.neff", RECORD, lnc=1)


def test_wrong_sizes_in_the_header_are_refused(tmp_path):
    payload_len = len(synthetic_payload())
    bad = write_synthetic_neff(tmp_path / "d.neff", data_size=payload_len + 1)
    with pytest.raises(NeffError, match=rf"data_size is {payload_len + 1} bytes but the file holds {payload_len}"):
        verify_neff(bad, RECORD, lnc=1)
    bad = write_synthetic_neff(tmp_path / "h.neff", header_size=512)
    with pytest.raises(NeffError, match="header_size is 512, a NEFF header is 1024 bytes"):
        verify_neff(bad, RECORD, lnc=1)


def test_unknown_feature_bits_are_refused(tmp_path):
    path = write_synthetic_neff(tmp_path / "f.neff", feature_bits=0x101)
    verify_neff(path, NeffRecord(RECORD.flags, 1, 0x101, "2.0"), lnc=1)  # what the compiling SDK produced
    with pytest.raises(NeffError, match=r"feature_bits 0x101 include 0x100, outside the features this host accepts \(0x1\)"):
        verify_neff(path, NeffRecord(RECORD.flags, 1, 0x1, "2.0"), lnc=1)


def test_lnc_mismatch_is_refused(tmp_path):
    path = write_synthetic_neff(tmp_path / "l.neff", lnc_size=2)
    with pytest.raises(NeffError, match=r"lnc_size is 2, this host runs logical NeuronCores of size 1 "
                                        r"\(NEURON_LOGICAL_NC_CONFIG=1\); set NEURON_LOGICAL_NC_CONFIG=2"):
        verify_neff(path, NeffRecord(RECORD.flags, 2, 0, "2.0"), *host_lnc({"NEURON_LOGICAL_NC_CONFIG": "1"}))
    verify_neff(path, NeffRecord(RECORD.flags, 2, 0, "2.0"), *host_lnc({"NEURON_LOGICAL_NC_CONFIG": "2"}))
    with pytest.raises(NeffError, match="lnc_size is 2 but the manifest records 1"):  # header vs bundle record
        verify_neff(path, RECORD, lnc=2)


def test_checks_run_in_the_documented_order():
    """A header wrong in every field names header_size first, then data_size, feature_bits, lnc_size."""
    wrong = {"header_size": 9, "data_size": 99, "feature_bits": 0x8, "lnc_size": 2}
    right = {"header_size": HEADER_SIZE, "data_size": 10, "feature_bits": 0, "lnc_size": 1}
    named = []
    for fixed in range(len(wrong)):
        fields = {k: (right if i < fixed else wrong)[k] for i, k in enumerate(wrong)}
        header = parse_header(synthetic_header(**fields), "x.neff")
        with pytest.raises(NeffError) as e:
            check_header(header, HEADER_SIZE + 10, "x.neff", allowed_feature_bits=0, lnc=1)
        named.append(str(e.value).removeprefix("x.neff: ").split(" ")[0])
    assert named == list(wrong)


def test_host_lnc_from_env_and_instance_type():
    assert host_lnc({"NEURON_LOGICAL_NC_CONFIG": "2"}, "trn1.32xlarge") == (2, "NEURON_LOGICAL_NC_CONFIG=2")
    assert host_lnc({}, "trn2.48xlarge")[0] == 2
    assert host_lnc({}, "trn1.32xlarge")[0] == 1
    assert host_lnc({}, "")[0] == 1
    with pytest.raises(NeffError, match="NEURON_LOGICAL_NC_CONFIG='4': the logical NeuronCore size must be 1 or 2"):
        host_lnc({"NEURON_LOGICAL_NC_CONFIG": "4"})


def test_neff_record_round_trip_and_bad_fields():
    assert NeffRecord.from_dict(RECORD.to_dict(), "r") == RECORD
    for change, msg in (({"flags": "-O1"}, r"r.flags: expected a list of strings"),
                        ({"lnc_size": True}, r"r.lnc_size: expected a non-negative integer"),
                        ({"feature_bits": -1}, r"r.feature_bits: expected a non-negative integer"),
                        ({"neff_version": 2}, r"r.neff_version: expected a string")):
        with pytest.raises(BundleError, match=msg):
            NeffRecord.from_dict({**RECORD.to_dict(), **change}, "r")


# ------------------------------------------------------------------------------------------ flags
def flags(overrides=None, env=None, product="", stems=("prefill_b1_s8", "decode_b1_s8")):
    return backend_neuron.plan_flags(overrides, list(stems), environ=env or {}, product_name=product)


def test_flag_spellings_agree():
    a = flags({"args": "-O2 --target trn2 --logical-nc-config 1"})
    b = flags({"args": ["--lnc=1", "--optlevel=2"], "target": "trn2"})
    c = flags(env={"NEURON_CC_FLAGS": "--target=trn2  -O 2"})
    assert a == b == c
    assert a.common == ("--auto-cast=none", "--lnc=1", "--model-type=transformer", "--target=trn2", "-O2")
    assert a.lnc == 1


def test_flag_precedence_and_bucket_args():
    f = flags({"args": "--auto-cast matmult", "bucket_args": {"prefill_b1_s8": "-O3 --tensorizer-options='--a  --b'"}},
              env={"NEURON_CC_FLAGS": "--auto-cast all -O2"}, product="trn2.48xlarge")
    assert "--auto-cast=matmult" in f.common and "-O2" in f.common and "--target=trn2" in f.common
    assert "-O3" in f.per_bucket["prefill_b1_s8"] and "--tensorizer-options=--a --b" in f.per_bucket["prefill_b1_s8"]
    assert f.per_bucket["decode_b1_s8"] == f.common
    # a repeated accumulating option keeps both occurrences; a single-valued one keeps the last
    assert backend_neuron.canonical_args(["--tensorizer-options=x", "--target", "trn1", "--tensorizer-options=y",
                                          "--target=trn2"], "t") == \
        ("--target=trn2", "--tensorizer-options=x", "--tensorizer-options=y")


@pytest.mark.parametrize("overrides, env, product, message", [
    (None, {}, "", r"no --target; this host is not a trn1/trn2 instance, so name one: NEURON_CC_FLAGS='--target trn2'"),
    ({"target": "inf2"}, {}, "", r"--target inf2 is not one of trn1, trn2"),
    ({"lnc": 2}, {}, "trn1.2xlarge", r"--lnc 2 needs --target trn2 \(on trn1 only lnc=1 is supported, NCC_EARG001\)"),
    ({"lnc": 4, "target": "trn2"}, {}, "", r"--lnc 4 must be 1 or 2"),
    ({"args": "-O4"}, {}, "trn2.3xlarge", r"-O 4 must be 1, 2 or 3"),
    ({"args": "--output x.neff"}, {}, "trn2.3xlarge", r"--output is set by the neuron backend itself"),
    (None, {"NEURON_CC_FLAGS": "model.hlo --target trn2"}, "", r"'model.hlo' is not a neuronx-cc option"),
    ({"opt": 1}, {}, "trn2.3xlarge", r"unknown key 'opt'"),
    ({"bucket_args": {"prefill_b9_s8": "-O2"}}, {}, "trn2.3xlarge", r"'prefill_b9_s8' is not a bucket of this plan"),
    ({"bucket_args": {"prefill_b1_s8": "--lnc 2"}}, {}, "trn2.3xlarge", r"every bucket of a bundle needs the same --target and --lnc"),
])
def test_bad_flags_are_named(overrides, env, product, message):
    with pytest.raises(ConfigError, match=message):
        flags(overrides, env, product)


# ------------------------------------------------------------------------------------------ keys
@pytest.fixture(scope="module")
def tiny_program():
    class Tiny(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x * 2 + 1)

    return torch.export.export(Tiny(), (torch.zeros(2, 8),), strict=False)


def kernel_entry(sha: str) -> dict:
    return {"kernel": "m:f", "kernel_sha256": sha, "adapter": "a:g", "adapter_sha256": "aa"}


def neuron_key(program, args, toolchain=None, kernels=None):
    tc = backend_neuron.key_toolchain(toolchain or {"torch": "2.9.0", "neuronx_cc": "2.21"}, kernels or {})
    return cache_key(normalised_graph(program), list(args), tc, "neuron", backend_neuron.BACKEND)


def test_neuron_key_ignores_spelling_and_order_and_sees_every_change(tiny_program):
    base = flags({"target": "trn2"}).per_bucket["prefill_b1_s8"]
    same = flags(env={"NEURON_CC_FLAGS": "--model-type=transformer  --target=trn2 -O 1"}).per_bucket["prefill_b1_s8"]
    assert neuron_key(tiny_program, base) == neuron_key(tiny_program, same)
    changed = [flags({"target": "trn1"}), flags({"target": "trn2", "lnc": 2}), flags({"target": "trn2", "args": "-O2"}),
               flags({"target": "trn2", "args": "--auto-cast matmult"}),
               flags({"target": "trn2"}, env={"NEURON_CC_FLAGS": "--enable-saturate-infinity"})]
    keys = {neuron_key(tiny_program, f.per_bucket["prefill_b1_s8"]) for f in changed}
    keys |= {neuron_key(tiny_program, base, toolchain={"torch": "2.9.0", "neuronx_cc": "2.22"}),
             neuron_key(tiny_program, base, kernels={"dsneuron::sparse_attn": kernel_entry("00")}),
             neuron_key(tiny_program, base, kernels={"dsneuron::sparse_attn": kernel_entry("01")}),
             neuron_key(tiny_program, base, kernels={"dsneuron::sparse_attn": {**kernel_entry("00"), "adapter_sha256": "ab"}})}
    assert len(keys | {neuron_key(tiny_program, base)}) == len(changed) + 5


def test_key_toolchain_leaves_out_the_compiling_host():
    a = backend_neuron.key_toolchain({"torch": "2.9.0", "machine": "x86_64", "cpu_isa": ["avx2"], "python": "3.11.7"}, {})
    b = backend_neuron.key_toolchain({"torch": "2.9.0", "machine": "aarch64", "cpu_isa": [], "python": "3.12.1"}, {})
    assert a == b


def test_kernel_sources_hash_kernel_and_adapter_modules_without_importing_the_kernel(tmp_path, monkeypatch):
    mod = tmp_path / "fake_nki_kernel_mod.py"
    mod.write_text("import nki_that_is_not_installed\n\ndef kernel(x):\n    return x\n")
    adapter = tmp_path / "fake_adapter_mod.py"
    adapter.write_text("def call(kernel, x):\n    return kernel(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fake_adapter_mod

    def sources(kernel="fake_nki_kernel_mod:kernel"):
        return backend_neuron.kernel_sources({"ns::op": NkiBinding(kernel, fake_adapter_mod.call)})["ns::op"]

    first = sources()
    assert (first["kernel"], first["adapter"]) == ("fake_nki_kernel_mod:kernel", "fake_adapter_mod:call")
    mod.write_text("import nki_that_is_not_installed\n\ndef kernel(x):\n    return x + 0\n")
    second = sources()
    assert second["kernel_sha256"] != first["kernel_sha256"] and second["adapter_sha256"] == first["adapter_sha256"]
    adapter.write_text("def call(kernel, x):\n    return kernel(x + 0)\n")
    assert sources()["adapter_sha256"] != first["adapter_sha256"]
    with pytest.raises(CompileError, match="fake_nki_kernel_mod defines no top-level other_kernel"):
        sources("fake_nki_kernel_mod:other_kernel")
    with pytest.raises(CompileError, match="module no_such_kernel_mod not found"):
        sources("no_such_kernel_mod:kernel")
    assert set(backend_neuron.kernel_sources()) == set(BINDINGS)  # the real table: every kernel module found


# ------------------------------------------------------------------------------------------ fail fast
@pytest.mark.skipif(not missing_packages("neuron"), reason="the Neuron SDK is installed here")
def test_compile_without_sdk_fails_before_any_work(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(pipeline, "build_steps_for_config", lambda *a, **k: pytest.fail("did work before failing"))
    monkeypatch.setenv("DSNEURON_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "art"
    assert run_cli(monkeypatch, "compile", "--config", "micro", "--target", "neuron", "--out", str(out)) == 2
    err = " ".join(capsys.readouterr().err.split())
    for text in ("target 'neuron' is not available", "neuronxcc", "nki", "https://pip.repos.neuron.amazonaws.com"):
        assert text in err
    assert not out.exists() and not (tmp_path / "cache").exists()
    kit = stand_in.make_kit(tmp_path, {"max_seq_len": 8, "decode_context_lens": [8]})
    with pytest.raises(BundleError, match="missing Python packages neuronxcc, nki"):
        pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, out, kit.parts, target="neuron",
                                cache_dir=tmp_path / "cache", console=QUIET)
    assert not out.exists() and not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------------------------ pipeline with a stand-in SDK seam
GATED_MIX = NkiBinding("stand_in:gated_mix", stand_in.in_order, "dsneuron_test::nki_gated_mix")


class FakeSeam:
    """Stands in for `compile_neff` (the only step that needs the SDK): writes a synthetic NEFF whose
    payload depends on the StableHLO module and records each call."""

    def __init__(self, lnc_written: int | None = None):
        self.calls: list[dict] = []
        self.lnc_written = lnc_written

    def __call__(self, module, out, args, lnc):
        facts = module.facts()
        self.calls.append({"file": out.name, "args": tuple(args), "lnc": lnc, "n_inputs": facts.arguments,
                           "composites": facts.composites, "f64": facts.f64_ops})
        write_synthetic_neff(out, note=module.text[:2000] + " ".join(args), lnc_size=self.lnc_written or lnc,
                             feature_bits=0x3)


@pytest.fixture()
def fake_sdk(monkeypatch):
    """The Neuron SDK 'present' for check_target, the stand-in's custom op mapped to an 'NKI kernel'
    (stand_in.gated_mix), a neuronx-cc path, and FakeSeam for the compile step."""
    real = bundle_mod.missing_packages
    monkeypatch.setattr(bundle_mod, "missing_packages", lambda t, use="compile": [] if t == "neuron" else real(t, use))
    monkeypatch.setattr(backend_neuron, "NKI_KERNELS", {"dsneuron_test::gated_mix": GATED_MIX})
    monkeypatch.setattr(backend_neuron, "require_compiler", lambda: "/opt/aws/neuron/bin/neuronx-cc")
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    seam = FakeSeam()
    monkeypatch.setattr(backend_neuron, "compile_neff", seam)
    return seam


@pytest.fixture()
def neuron_kit(tmp_path):
    kit = stand_in.make_kit(tmp_path, {"max_seq_len": 8, "decode_context_lens": [8]})

    def compile_to(name, flags=None, cache="cache"):  # in this process: FakeSeam records its calls here
        return pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, tmp_path / name, kit.parts, target="neuron",
                                       cache_dir=tmp_path / cache, flags=flags, console=QUIET, bucket_workers=1)
    return kit, compile_to


def test_neuron_bundle_records_flags_and_headers_per_bucket(fake_sdk, neuron_kit, tmp_path):
    kit, compile_to = neuron_kit
    out = compile_to("b", {"target": "trn2", "bucket_args": {"prefill_b2_s8": "-O2"}})
    m = Manifest.from_json((out / "manifest.json").read_text())
    assert m.target == "neuron" and m.compiler["backend"] == "neuronx-cc"
    assert sorted(b.file for b in m.buckets) == ["buckets/decode_b2_s8.neff", "buckets/prefill_b2_s8.neff"]
    assert m.compiler["flags"] == ["--auto-cast=none", "--lnc=1", "--model-type=transformer", "--target=trn2", "-O1"]
    neff = m.compiler["neff"]
    assert neff["buckets/prefill_b2_s8.neff"]["flags"][-1] == "-O2" and neff["buckets/decode_b2_s8.neff"]["flags"][-1] == "-O1"
    for b in m.buckets:
        header = read_header(out / b.file)
        assert neff[b.file] == {"flags": neff[b.file]["flags"], "lnc_size": header.lnc_size,
                                "feature_bits": header.feature_bits, "neff_version": header.neff_version}
        assert (header.lnc_size, header.feature_bits) == (1, 0x3)
    # the op answered by its kernel: one kernel call, a composite in the StableHLO neuronx-cc gets;
    # weights are module arguments (NEFF inputs), stored once beside
    assert m.compiler["custom_ops"] == {"dsneuron_test::gated_mix": "kernel", "dsneuron_test::nki_gated_mix": "call"}
    assert m.compiler["nki_kernels"] == {"dsneuron_test::gated_mix": "stand_in:gated_mix"}
    assert all(c["composites"] == {"dsneuron.nki.gated_mix": 2} and c["f64"] == 0 for c in fake_sdk.calls)
    for b, call in zip(sorted(m.buckets, key=lambda b: b.file), sorted(fake_sdk.calls, key=lambda c: c["file"])):
        assert call["n_inputs"] == len(b.weights) + len(b.inputs) and len(b.weights) == len(kit.parts.weights)
    assert m.weight_views == {"proj": "uint8", "proj_scale": "uint8"}  # fp8 / e8m0 cross the NEFF as bytes
    assert m.toolchain["cpu_isa"] == [] and {"torch_neuronx", "neuronx_cc", "nki", "torch_mlir"} <= set(m.toolchain)
    assert "torch_xla" not in m.toolchain
    open_bundle(out)


def test_second_build_compiles_nothing_and_any_flag_change_recompiles(fake_sdk, neuron_kit, monkeypatch):
    _, compile_to = neuron_kit
    compile_to("one", {"target": "trn2"})
    assert len(fake_sdk.calls) == 2
    compile_to("two", {"target": "trn2"})
    assert len(fake_sdk.calls) == 2, "a warm build with a shared cache invoked the compiler"
    compile_to("three", {"args": "--target=trn2  -O 1"})  # same flags, other spelling
    assert len(fake_sdk.calls) == 2
    compile_to("four", {"target": "trn2", "bucket_args": {"decode_b2_s8": "-O2"}})
    assert [c["file"] for c in fake_sdk.calls[2:]] == ["decode_b2_s8.neff"]
    monkeypatch.setenv("NEURON_CC_FLAGS", "--enable-saturate-infinity")
    compile_to("five", {"target": "trn1"})
    assert len(fake_sdk.calls) == 5
    assert all("--enable-saturate-infinity" in c["args"] for c in fake_sdk.calls[3:])


def test_a_neff_with_the_wrong_lnc_is_never_bundled(fake_sdk, neuron_kit, tmp_path):
    _, compile_to = neuron_kit
    fake_sdk.lnc_written = 2
    with pytest.raises(NeffError, match=r"lnc_size is 2, this host runs logical NeuronCores of size 1 \(requested with --lnc 1\)"):
        compile_to("bad", {"target": "trn2"})
    assert not (tmp_path / "bad").exists()


def test_one_loop_makes_both_targets_bundles_alike(fake_sdk, neuron_kit, monkeypatch, tmp_path):
    """cpu and neuron bundles of one model come from the same loop: everything but the target's
    own entries (target, toolchain, compiler, executable files, input views) is equal."""
    kit, compile_to = neuron_kit
    monkeypatch.setattr(backend_cpu, "compile_cpu", lambda program, out, flags: out.write_text(normalised_graph(program)))
    cpu_out = pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, tmp_path / "cpu", kit.parts,
                                      cache_dir=tmp_path / "cache", console=QUIET)
    cpu = Manifest.from_json((cpu_out / "manifest.json").read_text())
    neuron = Manifest.from_json((compile_to("neuron", {"target": "trn2"}) / "manifest.json").read_text())
    own = {"target", "toolchain", "compiler", "files", "buckets", "weight_views"}
    shared = [f.name for f in dataclasses.fields(Manifest) if f.name not in own]
    assert [getattr(cpu, n) for n in shared] == [getattr(neuron, n) for n in shared]
    strip = lambda b: dataclasses.replace(b, file=Path(b.file).stem, cache_key="")  # noqa: E731
    assert [strip(b) for b in cpu.buckets] == [strip(b) for b in neuron.buckets]
    assert (cpu.compiler["backend"], neuron.compiler["backend"]) == ("aot_inductor", "neuronx-cc")
    assert set(cpu.compiler) == {"backend", "flags", "custom_ops"} and "neff" in neuron.compiler
    assert cpu.compiler["custom_ops"] == {"dsneuron_test::gated_mix": "inline"}
    assert cpu.weight_views == {"proj_scale": "uint8"} and neuron.weight_views == {"proj": "uint8", "proj_scale": "uint8"}
    with pytest.raises(BundleError, match="unknown target 'tpu'"):
        pipeline.make_backend("tpu", None, [])


def test_neuron_lowering_calls_the_kernel_op_and_inlines_the_rest(neuron_kit, monkeypatch):
    kit, _ = neuron_kit
    step = kit.parts.steps.decode(2, 8)
    for table, want in (({"dsneuron_test::gated_mix": GATED_MIX},
                         {"dsneuron_test::gated_mix": "kernel", "dsneuron_test::nki_gated_mix": "call"}),
                        ({}, {"dsneuron_test::gated_mix": "inline"})):
        monkeypatch.setattr(backend_neuron, "NKI_KERNELS", table)
        mode = backend_neuron.lowering()
        exported = export_step(step, kit.parts.weights, "decode b2 s8", backend_neuron.INPUT_VIEWS, mode)
        assert finish(exported.program, mode, "decode") == want


def test_the_lowering_runs_the_adapter_around_the_kernel_op():
    """The kernel op of an exported neuron graph takes the kernel's own arguments: sparse_attn's
    index list of 63 slots reaches `dsneuron::nki_sparse_attn` padded to 64, and the program
    computes what the op does."""
    q, kv, sink, idx, scale = make_attn_inputs(AttnCase("k63", 1, 3, 4, 128, 90, 63, seed=90))

    class Attn(torch.nn.Module):
        def forward(self, q, kv, sink, idx):
            return torch.ops.dsneuron.sparse_attn(q, kv, sink, idx, scale)

    mode = backend_neuron.lowering()
    with mode:
        program = torch.export.export(Attn(), (q, kv, sink, idx), strict=False)
    assert finish(program, mode, "attn") == {"dsneuron::nki_sparse_attn": "call", "dsneuron::sparse_attn": "kernel"}
    calls = [n for n in program.graph.nodes if n.op == "call_function" and "nki_sparse_attn" in str(n.target)]
    assert len(calls) == 1 and tuple(calls[0].args[3].meta["val"].shape) == (1, 3, 64) and calls[0].args[4] == scale
    assert torch.equal(program.module()(q, kv, sink, idx), torch.ops.dsneuron.sparse_attn(q, kv, sink, idx, scale))


# ------------------------------------------------------------------------------------------ NKI kernel adapters
class TorchKernel:
    """What `@nki.jit` does with framework tensors, around a kernel of the NumPy stand-in: torch
    tensors in, torch tensors out (bf16 through ml_dtypes). Only the dtypes the NKI kernels read
    cross (bf16, fp32, int32, uint8): an fp8 tensor an adapter forgot to pass as bytes raises
    TypeError. `calls` records each call's arguments as (dtype, shape) or the constant."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __call__(self, *args):
        self.calls.append([(a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else a for a in args])
        return self._to_torch(self.kernel(*(self._to_numpy(a) for a in args)))

    @staticmethod
    def _to_numpy(a):
        if not isinstance(a, torch.Tensor):
            return a
        if a.dtype == torch.bfloat16:
            return a.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        if a.dtype not in (torch.float32, torch.int32, torch.uint8):
            raise TypeError(f"the NKI kernels take no {a.dtype} tensor")
        return a.contiguous().numpy()

    @staticmethod
    def _to_torch(a):
        assert a.dtype == ml_dtypes.bfloat16, a.dtype  # both kernels return bf16
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


@pytest.fixture(scope="module")
def nki_kernels():
    """The two kernel modules imported against the NumPy stand-in of `nki` (sim.installed)."""
    with sim.installed(KERNEL_MODULES) as modules:
        yield modules


@pytest.fixture()
def wrapped(nki_kernels, monkeypatch):
    """Each kernel of the real NKI_KERNELS table replaced by its TorchKernel in its module (the
    stand-in of `nki`); returns {op: TorchKernel}."""
    out = {}
    for op, binding in BINDINGS.items():
        module, _, name = binding.kernel.partition(":")
        mod = next(m for m in nki_kernels if m.__name__ == module)
        out[op] = TorchKernel(getattr(mod, name))
        monkeypatch.setattr(mod, name, out[op])
    return out


def _same_logits(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """The kernel contract against the torch op (test_nki_kernels.py): same shape, row stride and
    -inf positions; one bf16 step at most and equal almost everywhere."""
    assert (out.shape, out.stride(), out.dtype) == (ref.shape, ref.stride(), ref.dtype), what
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), what
    finite = torch.isfinite(ref)
    dist = ulp_distance_bf16(out[finite], ref[finite].float().numpy())
    assert dist.max(initial=0) <= 1 and (dist == 0).mean() >= 0.999, what


@pytest.mark.parametrize("case", [
    AttnCase("k63", 1, 3, 4, 128, 90, 63, seed=90),
    AttnCase("k64-empty-rows", 1, 4, 2, 128, 70, 64, empty_rows=0.3, seed=91),
    AttnCase("k130-d256-b2", 2, 2, 4, 256, 150, 130, seed=92),
    AttnCase("k0", 1, 2, 2, 128, 30, 0, seed=93),
], ids=lambda c: c.id)
def test_sparse_attn_adapter_pads_the_index_list_and_matches_the_op(wrapped, case):
    args = make_attn_inputs(case)
    kernel = wrapped["dsneuron::sparse_attn"]
    out = call_sparse_attn(kernel, *args)
    padded = max(64, -(-case.k // 64) * 64)
    (_, q_shape), _, _, (idx_dtype, idx_shape), scale = kernel.calls[-1]
    assert idx_dtype == torch.int32 and idx_shape == (case.b, case.s, padded) and scale == args[4]
    ref = torch.ops.dsneuron.sparse_attn(*args)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert (ulp_distance_bf16(out, ref.float().numpy()) == 0).mean() >= 0.999, case.id
    assert_close(out, f64(ref), abs_tol=ABS_TOL, rel_tol=REL_TOL, cos_tol=COS_TOL, what=case.id)


def test_sparse_attn_adapter_pads_with_empty_slots(wrapped):
    """The padding must be empty slots: kv row 0 set far apart from the rest shows whether the
    pad reads it (a pad of 0 would attend to row 0 and move every output)."""
    q, kv, sink, idx, scale = make_attn_inputs(AttnCase("pad", 1, 2, 2, 128, 40, 10, invalid=0.0, seed=94))
    kv[0, 0] = 50.0
    idx = torch.where(idx == 0, 1, idx)
    out = call_sparse_attn(wrapped["dsneuron::sparse_attn"], q, kv, sink, idx, scale)
    ref = torch.ops.dsneuron.sparse_attn(q, kv, sink, idx, scale)
    assert_close(out, f64(ref), abs_tol=ABS_TOL, rel_tol=REL_TOL, cos_tol=COS_TOL, what="pad")


def _as_variant(args, fp4_dtype, scale_dtype):
    q, q_sf, kv, kv_sf, w, ks, ke = args
    if q.dtype != torch.float8_e4m3fn:
        q, kv = q.view(fp4_dtype), kv.view(fp4_dtype)
    return q, q_sf.view(scale_dtype), kv, kv_sf.view(scale_dtype), w, ks, ke


MQA_VARIANTS = [  # (case, packed fp4 dtype, scale dtype, columns)
    (MqaCase("fp8-e8m0-cols300", "fp8", 5, 4, 64, 300, "full", seed=95), None, torch.float8_e8m0fnu, 300),
    (MqaCase("fp4-int8-bf16w-cols256", "fp4", 4, 2, 64, 260, "random", weights="bf16", seed=96), torch.int8,
     torch.uint8, 256),
    (MqaCase("fp4-x2-cols513", "fp4", 3, 2, 32, 513, "cp", seed=97), torch.float4_e2m1fn_x2, torch.float8_e8m0fnu,
     513),
    (MqaCase("fp4-uint8-cols1", "fp4", 3, 1, 32, 9, "causal", seed=98), torch.uint8, torch.uint8, 1),
]


@pytest.mark.parametrize("case, fp4_dtype, scale_dtype, cols", MQA_VARIANTS, ids=lambda v: getattr(v, "id", ""))
def test_mqa_logits_adapter_passes_bytes_and_returns_the_ops_layout(wrapped, case, fp4_dtype, scale_dtype, cols):
    args = _as_variant(make_mqa_inputs(case), fp4_dtype, scale_dtype)
    kernel = wrapped["dsneuron::mqa_logits"]
    out = call_mqa_logits(kernel, *args, cols)
    call = kernel.calls[-1]
    assert [c[0] for c in call[:4]] == [torch.uint8] * 4 and call[-2:] == [cols, case.fmt]
    _same_logits(out, torch.ops.dsneuron.mqa_logits(*args, cols), case.id)


@pytest.mark.parametrize("block_size", [8, 16])
def test_mqa_logits_sparse_adapter_matches_the_op(wrapped, block_size):
    case = MqaCase("sparse", "fp4", 4, 2, 64, 120, "random", seed=99)
    args = _as_variant(make_mqa_inputs(case), torch.int8, torch.float8_e8m0fnu)
    blocks = make_blocks(args[5], args[6], case.t, 6, block_size, np.random.default_rng(99))
    kernel = wrapped["dsneuron::mqa_logits_sparse"]
    out = call_mqa_logits_sparse(kernel, *args, blocks, block_size)
    assert kernel.calls[-1][-2:] == [block_size, "fp4"]
    _same_logits(out, torch.ops.dsneuron.mqa_logits_sparse(*args, blocks, block_size), f"sparse B={block_size}")


def test_mqa_adapters_answer_empty_results_without_the_kernel(wrapped):
    args = make_mqa_inputs(MqaCase("empty", "fp8", 3, 2, 32, 10, "full", seed=100))
    dense, sparse = wrapped["dsneuron::mqa_logits"], wrapped["dsneuron::mqa_logits_sparse"]
    out = call_mqa_logits(dense, *args, 0)
    ref = torch.ops.dsneuron.mqa_logits(*args, 0)
    assert (out.shape, out.stride(), out.dtype) == (ref.shape, ref.stride(), ref.dtype)
    no_blocks = torch.zeros(3, 0, dtype=torch.int32)
    out = call_mqa_logits_sparse(sparse, *args, no_blocks, 8)
    assert out.shape == (3, 0) and dense.calls == [] and sparse.calls == []


def _kernel_op_inputs(d=128):
    q, kv, sink, idx, _ = make_attn_inputs(AttnCase("step", 1, 3, 2, d, 50, 20, seed=101))
    return (q, kv, sink, idx, *make_mqa_inputs(MqaCase("step", "fp8", 3, 2, 32, 40, "causal", seed=102)))


def test_each_kernel_op_is_its_nki_kernel_through_the_adapter(wrapped):
    """The decomposition a StableHLO consumer runs in a kernel's place (the kernel op's torch
    reference, compiler/stablehlo.py) and the NKI kernel (its NumPy stand-in) give the same result
    through the same adapter: the composite means what the kernel computes."""
    q, kv, sink, idx, mq, mq_sf, mkv, mkv_sf, w, ks, ke = _kernel_op_inputs()
    for op, args in (("dsneuron::sparse_attn", (q, kv, sink, idx, 0.125)),
                     ("dsneuron::mqa_logits", (mq, mq_sf, mkv, mkv_sf, w, ks, ke, 40))):
        binding = BINDINGS[op]
        ns, name = binding.op.split("::")
        via_op = binding.call(getattr(getattr(torch.ops, ns), name), *args)
        via_kernel = binding.call(wrapped[op], *args)
        assert len(wrapped[op].calls) == 1 and via_op.shape == via_kernel.shape and via_op.stride() == via_kernel.stride()
        if op == "dsneuron::sparse_attn":
            assert_close(via_kernel, f64(via_op), abs_tol=ABS_TOL, rel_tol=REL_TOL, cos_tol=COS_TOL, what=op)
        else:
            _same_logits(via_kernel, via_op, op)


# ------------------------------------------------------------------------------------------ runtime
def test_session_picks_the_neuron_executor_and_checks_every_neff(fake_sdk, neuron_kit, monkeypatch):
    _, compile_to = neuron_kit
    out = compile_to("b", {"target": "trn2"})
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(NeffError, match=r"lnc_size is 1, this host runs logical NeuronCores of size 2 "
                                        r"\(NEURON_LOGICAL_NC_CONFIG=2\)"):
        Session.load(out)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    session = Session.load(out)
    assert isinstance(session.runner.make_executable, NeuronExecutor)
    assert {h.lnc_size for h in session.runner.make_executable.headers.values()} == {1}
    if importlib.util.find_spec("torch_neuronx") is None:
        with pytest.raises(BundleError, match=r"running a NEFF needs torch-neuronx .* AWS Neuron pip index"):
            session.generate("hi", 2)


def test_executor_refuses_other_sdk_releases_and_missing_records(fake_sdk, neuron_kit):
    _, compile_to = neuron_kit
    out = compile_to("b", {"target": "trn2"})
    m = Manifest.from_json((out / "manifest.json").read_text())
    check_sdk_versions({"torch_neuronx": "2.9.0", "neuronx_cc": "2.21.1"}, {"torch_neuronx": "2.9.0", "neuronx_cc": "2.21.1"})
    check_sdk_versions({"torch_neuronx": "2.9.0", "neuronx_cc": "2.21.1"}, {"torch_neuronx": "2.9.0", "neuronx_cc": None})
    with pytest.raises(BundleError, match=r"compiled with torch-neuronx 2.9.0, this host has None"):
        check_sdk_versions({"torch_neuronx": "2.9.0", "neuronx_cc": "2.21.1"}, {"torch_neuronx": None, "neuronx_cc": "2.21.1"})
    with pytest.raises(BundleError, match=r"compiled with neuronx-cc 2.21.1, this host has 2.22.0; .* recompile"):
        check_sdk_versions({"torch_neuronx": "2.9.0", "neuronx_cc": "2.21.1"}, {"torch_neuronx": "2.9.0", "neuronx_cc": "2.22.0"})
    assert set(neff_records(m)) == {b.file for b in m.buckets}
    del m.compiler["neff"]["buckets/decode_b2_s8.neff"]
    with pytest.raises(BundleError, match=r"compiler.neff: no record for buckets/decode_b2_s8.neff"):
        neff_records(m)


def test_bundle_moved_to_another_folder_still_loads(fake_sdk, neuron_kit, tmp_path):
    _, compile_to = neuron_kit
    out = compile_to("b", {"target": "trn2"})
    moved = tmp_path / "elsewhere" / "deeper"
    moved.parent.mkdir()
    shutil.move(str(out), moved)
    manifest = Manifest.from_json((moved / "manifest.json").read_text())
    assert set(NeuronExecutor(moved, manifest, environ={}, product_name="").headers) == \
        {"buckets/decode_b2_s8.neff", "buckets/prefill_b2_s8.neff"}


@pytest.fixture()
def sdk_for_running_only(monkeypatch):
    """This host 'has' torch_neuronx but neither neuronxcc nor nki: a host that only runs bundles."""
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "torch_neuronx":
            return importlib.machinery.ModuleSpec(name, None)
        return None if name in ("neuronxcc", "nki") else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_running_needs_torch_neuronx_only_and_compiling_needs_the_whole_sdk(sdk_for_running_only):
    assert missing_packages("neuron", "run") == []
    assert missing_packages("neuron", "compile") == missing_packages("neuron") == ["neuronxcc", "nki"]
    bundle_mod.check_target("neuron", "run")
    with pytest.raises(BundleError, match=r"target 'neuron' is not available on this host for compiling: missing "
                                          r"Python packages neuronxcc, nki; they come from the AWS Neuron pip index"):
        bundle_mod.check_target("neuron", "compile")
    with pytest.raises(ValueError, match="use must be one of"):
        missing_packages("neuron", "deploy")


def test_a_run_only_host_opens_a_neuron_bundle_compiled_on_another_host(fake_sdk, neuron_kit, monkeypatch,
                                                                         sdk_for_running_only):
    """No cpu rule applies to a neuron bundle: another torch release, machine and CPU features of
    the compiling host do not matter (the NEFF holds no host code)."""
    _, compile_to = neuron_kit
    out = compile_to("b", {"target": "trn2"})
    monkeypatch.setattr(bundle_mod, "missing_packages", missing_packages)  # the real check, on the run-only host
    raw = json.loads((out / "manifest.json").read_text())
    raw["toolchain"].update(torch="2.1.0", machine="aarch64" if raw["toolchain"]["machine"] != "aarch64" else "x86_64",
                            cpu_isa=["no_such_isa_extension"])
    raw[SEAL] = content_sha256(raw)  # as if written on that host (schema.py seals the manifest)
    (out / "manifest.json").write_text(json.dumps(raw))
    assert open_bundle(out).manifest.target == "neuron"
    with pytest.raises(BundleError, match="compiled with torch 2.1.0"):  # the same record on cpu is refused
        bundle_mod.check_toolchain(raw["toolchain"], target="cpu")


def test_neuron_integration_modules_have_no_unused_names():
    """pyflakes over the modules of the neuron integration (unused imports, undefined names)."""
    api = pytest.importorskip("pyflakes.api", reason="pyflakes is not installed")
    reporter = pytest.importorskip("pyflakes.reporter")
    root = Path(backend_neuron.__file__).parent.parent
    warnings, errors = io.StringIO(), io.StringIO()
    for rel in ("compiler/compile.py", "compiler/backend_neuron.py", "compiler/stablehlo.py",
                "runtime_min/bundle/bundle.py", "runtime_min/executors/executor_stablehlo.py",
                "kernels_nki/neuron_adapters.py"):
        api.checkPath(str(root / rel), reporter.Reporter(warnings, errors))
    assert warnings.getvalue() + errors.getvalue() == ""


# ------------------------------------------------------------------------------------------ SDK-gated (Trainium)
def _require_sdk():
    for name in ("torch_neuronx", "neuronxcc", "nki"):
        pytest.importorskip(name, reason=f"needs the Neuron SDK ({name}), which comes only from the AWS Neuron pip index")
    if shutil.which("neuronx-cc") is None:
        pytest.skip("needs the neuronx-cc executable on PATH")


def _require_device():
    if not list(Path("/dev").glob("neuron*")):
        pytest.skip("needs a Neuron device (/dev/neuron*): a trn1/trn2 instance")


@pytest.mark.neuron
@pytest.mark.slow
def test_sdk_compile_micro_per_bucket(tmp_path, monkeypatch):
    _require_sdk()
    assert run_cli(monkeypatch, "compile", "--config", "micro", "--target", "neuron", "--out",
                   str(tmp_path / "neuron"), "--cache-dir", str(tmp_path / "cache")) == 0
    m = Manifest.from_json((tmp_path / "neuron" / "manifest.json").read_text())
    lnc = backend_neuron.plan_flags(None, ["x"]).lnc
    for b in m.buckets:
        record = NeffRecord.from_dict(m.compiler["neff"][b.file], b.file)
        verify_neff(tmp_path / "neuron" / b.file, record, lnc=lnc)
        assert "--model-type=transformer" in record.flags


@pytest.mark.neuron
@pytest.mark.slow
def test_sdk_run_micro_and_compare_with_the_cpu_bundle(tmp_path, monkeypatch):
    _require_sdk()
    _require_device()
    from dsneuron.compiler import cli
    if "compare" not in {c.name for c in cli.app.registered_commands}:
        pytest.skip("`dsneuron compare` (issue 6) is not in this build")
    mp = monkeypatch
    for target in ("cpu", "neuron"):
        assert run_cli(mp, "compile", "--config", "micro", "--target", target, "--out", str(tmp_path / target),
                       "--cache-dir", str(tmp_path / "cache")) == 0
    assert run_cli(mp, "run", str(tmp_path / "neuron"), "--prompt", "Hello", "--max-new-tokens", "4") == 0
    for target in ("cpu", "neuron"):
        assert run_cli(mp, "compare", str(tmp_path / target), "--json", str(tmp_path / f"{target}.json")) == 0


# ------------------------------------------------------------------------------------------ the SDK seam, stand-in compiler
FAKE_NEURONX_CC = r'''#!/usr/bin/env python3
import json, shutil, sys
args = sys.argv[1:]
out = next(a for a in args if a.startswith("--output=")) if any(a.startswith("--output=") for a in args) else \
    args[args.index("--output") + 1]
out = out.split("=", 1)[1] if out.startswith("--output=") else out
shutil.copy(args[1], sys.argv[0] + ".hlo.pb")
json.dump(args, open(sys.argv[0] + ".args.json", "w"))
open(out, "wb").write(b"NEFF stand-in")
'''


def _sparse_attn_module():
    """(the StableHLO module of one sparse_attn call lowered for neuron, its scale)."""
    from dsneuron.compiler.stablehlo import lower_program

    q, kv, sink, idx, scale = make_attn_inputs(AttnCase("seam", 1, 2, 2, 128, 30, 10, seed=7))

    class Attn(torch.nn.Module):
        def forward(self, q, kv, sink, idx):
            return (torch.ops.dsneuron.sparse_attn(q, kv, sink, idx, scale).float() * 2,)

    mode = backend_neuron.lowering()
    with mode:
        program = torch.export.export(Attn(), (q, kv, sink, idx), strict=False)
    return lower_program(program, backend_neuron.kernel_ops(backend_neuron.kernel_sources()), "seam"), scale


def test_compile_neff_binds_the_kernels_and_hands_neuronx_cc_the_hlo_module(tmp_path, monkeypatch):
    """compile_neff with a stand-in neuronx-cc on PATH and a stand-in for the one call that needs
    `nki` (the kernel's backend_config): every kernel composite becomes the documented custom-call
    AwsNeuronCustomNativeKernel with that config, the decomposition is gone, and neuronx-cc gets an
    HloModuleProto with `compile <hlo.pb> --framework XLA <the bucket's arguments>`."""
    from jax._src.lib import xla_client

    module, scale = _sparse_attn_module()
    exe = tmp_path / "neuronx-cc"
    exe.write_text(FAKE_NEURONX_CC)
    exe.chmod(0o755)
    monkeypatch.setattr(backend_neuron, "require_compiler", lambda: str(exe))
    seen = []

    def config(kernel, operands, results, attrs, lnc):
        seen.append((kernel, len(operands), results, attrs, lnc))
        return json.dumps({"func_name": kernel.split(":")[1], "grid": [lnc]})

    monkeypatch.setattr(backend_neuron, "nki_kernel_config", config)
    out = tmp_path / "prefill_b1_s2.neff"
    args = ("--lnc=1", "--target=trn2", "-O1")
    backend_neuron.compile_neff(module, out, args, 1)
    assert out.read_bytes() == b"NEFF stand-in"
    argv = json.loads(Path(f"{exe}.args.json").read_text())
    assert argv[0] == "compile" and argv[1].endswith("model.hlo.pb") and argv[2:5] == ["--framework", "XLA", *args[:1]]
    assert list(args) == argv[4:7] and "--output" in argv
    assert seen == [("dsneuron.kernels_nki.sparse_attn_nki:sparse_attn_kernel", 4, ["tensor<1x2x2x128xbf16>"],
                     {"kernel_sha256": backend_neuron.kernel_sources()["dsneuron::sparse_attn"]["kernel_sha256"],
                      "scale": pytest.approx(scale)}, 1)]
    hlo = xla_client.XlaComputation(Path(f"{exe}.hlo.pb").read_bytes()).as_hlo_text()
    assert 'custom_call_target="AwsNeuronCustomNativeKernel"' in hlo and '"func_name": "sparse_attn_kernel"' in hlo
    assert "composite" not in hlo and "sparse_attn_impl" not in module.text


def test_compile_neff_names_what_it_needs_without_the_sdk(tmp_path, monkeypatch):
    monkeypatch.setattr(backend_neuron, "require_compiler", lambda: "/opt/aws/neuron/bin/neuronx-cc")
    module, _ = _sparse_attn_module()
    with pytest.raises(CompileError, match=r"binding the NKI kernel dsneuron.kernels_nki.sparse_attn_nki:"
                                           r"sparse_attn_kernel into the module needs the Neuron SDK's nki package"):
        backend_neuron.compile_neff(module, tmp_path / "x.neff", ("--target=trn2",), 1)
    assert not (tmp_path / "x.neff").exists()
