"""The compile cache (compiler/cache.py): key properties, entry atomicity, and its use by the pipeline."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import multiprocessing
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

import stand_in
from dsneuron import UserError
from dsneuron.compiler import backend_cpu
from dsneuron.compiler import compile as pipeline
from dsneuron.compiler.cache import (ENV_VAR, MARKER, CompileCache, cache_key, cache_root, default_cache_dir, file_sha256,
                                     normalise_flags, normalised_graph, source_digest)
from dsneuron.runtime_min.bundle.bundle import host_toolchain

QUIET = Console(file=io.StringIO())

MODULE_SOURCE = '''
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("table", torch.arange(8.0), persistent=False)

    def forward(self, x):
        return torch.relu(self.lin(x) + self.table)
'''


def _import_from(folder: Path, name: str):
    folder.mkdir(parents=True)
    path = folder / "tiny_mod.py"
    path.write_text(MODULE_SOURCE)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _export(mod, shape=(2, 8), table=None):
    torch.manual_seed(0)
    m = mod.Tiny().eval()
    if table is not None:
        m.table.copy_(table)
    return torch.export.export(m, (torch.zeros(shape),), strict=False)


# ------------------------------------------------------------------------------------------ keys
def test_two_checkouts_give_the_same_key(tmp_path):
    a = _import_from(tmp_path / "checkout_a" / "pkg", "ckout_a_tiny")
    b = _import_from(tmp_path / "elsewhere" / "b", "ckout_b_tiny")
    pa, pb = _export(a), _export(b)
    # the raw graphs do carry their source paths (so the test can fail) ...
    traces = [n.meta.get("stack_trace") or "" for n in pa.graph.nodes]
    assert any("checkout_a" in t for t in traces)
    # ... the normalised text and the key do not
    ga, gb = normalised_graph(pa), normalised_graph(pb)
    assert "checkout_a" not in ga and "tiny_mod.py" not in ga
    assert ga == gb
    tc = host_toolchain()
    assert cache_key(ga, {"x": 1}, tc, "cpu", "b") == cache_key(gb, {"x": 1}, tc, "cpu", "b")


def test_a_while_loop_graph_keys_the_same_in_every_process():
    """A higher-order op (the Sinkhorn rounds' while_loop) is keyed by its name: its repr holds a
    memory address, which made every export of a decode step key differently."""
    code = (
        "import torch\n"
        "from torch._higher_order_ops.while_loop import while_loop\n"
        "from dsneuron.compiler.cache import normalised_graph\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2), (torch.tensor(0), x))[1]\n"
        "print(normalised_graph(torch.export.export(M(), (torch.ones(4),), strict=False)))\n")
    texts = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout for _ in range(2)]
    assert "higher_order.while_loop" in texts[0] and " at 0x" not in texts[0]
    assert texts[0] == texts[1]


def test_key_changes_with_shape_constants_flags_toolchain_target(tmp_path):
    mod = _import_from(tmp_path / "m", "keys_tiny")
    tc = host_toolchain()
    base_graph = normalised_graph(_export(mod))
    base = cache_key(base_graph, {"a": 1}, tc, "cpu", "aot_inductor")
    variants = [
        cache_key(normalised_graph(_export(mod, shape=(3, 8))), {"a": 1}, tc, "cpu", "aot_inductor"),
        cache_key(normalised_graph(_export(mod, table=torch.arange(8.0) * 2)), {"a": 1}, tc, "cpu", "aot_inductor"),
        cache_key(base_graph, {"a": 2}, tc, "cpu", "aot_inductor"),
        cache_key(base_graph, {"a": 1, "b": 0}, tc, "cpu", "aot_inductor"),
        cache_key(base_graph, {"a": 1}, {**tc, "torch": "9.9.9"}, "cpu", "aot_inductor"),
        cache_key(base_graph, {"a": 1}, tc, "neuron", "aot_inductor"),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_key_sees_the_range_of_a_dynamic_dimension(tmp_path):
    """An executable exported for 1..16 tokens has the very graph of one for 1..64 (the size is a
    symbol in both): only the range tells them apart, and the 16 one must not serve a 40-token call."""
    mod = _import_from(tmp_path / "m", "range_tiny")

    def export(hi):
        tokens = torch.export.Dim("T", min=1, max=hi)
        return torch.export.export(mod.Tiny().eval(), (torch.zeros(4, 8),), dynamic_shapes=({0: tokens},), strict=False)

    g16, g64 = normalised_graph(export(16)), normalised_graph(export(64))
    assert g16.replace("16]", "64]") == g64  # the same graph but for the bound ...
    assert g16 != g64                         # ... which the key sees
    assert normalised_graph(export(16)) == g16


def test_flag_normalisation_ignores_order_and_spacing():
    assert normalise_flags("-O1 --lnc 2  --target trn2") == normalise_flags("--target=trn2   --lnc=2 -O1")
    assert normalise_flags(["--lnc", "2", "-O1"]) == normalise_flags("-O1 --lnc=2")
    assert normalise_flags({"b": 1, "a": [1, 2]}) == normalise_flags({"a": [1, 2], "b": 1})
    assert normalise_flags("-O1 --lnc 2") != normalise_flags("-O2 --lnc 2")
    # a repeated flag keeps every occurrence: accumulating options (--tensorizer-options) must not
    # collapse, so dropping one changes the key
    assert normalise_flags("--tensorizer-options=a --tensorizer-options=b") != normalise_flags("--tensorizer-options=b")
    assert normalise_flags("--auto-cast none") != normalise_flags("--auto-cast all")


def test_default_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(ENV_VAR)
    assert default_cache_dir() == Path.home() / ".cache" / "dsneuron"


def test_a_cache_dir_that_is_a_file_is_refused(monkeypatch, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UserError, match=rf"compile cache {afile} is not a folder"):
        cache_root(afile)
    monkeypatch.setenv(ENV_VAR, str(afile))
    with pytest.raises(UserError, match="is not a folder"):
        cache_root(None)
    assert cache_root(tmp_path / "new") == tmp_path / "new" and (tmp_path / "new").is_dir()


def test_an_out_folder_that_cannot_be_made_is_one_error(tmp_path, monkeypatch):
    """As a user without write access to the parent meets it (simulated: the tests may run as root)."""
    import errno

    from dsneuron.compiler.bundle_writer import BundleWriter, OutputError

    def refuse(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(OutputError, match=rf"output {tmp_path}/sub/bundle: cannot create its folder .*Permission denied"):
        with BundleWriter(tmp_path / "sub" / "bundle", force=False):
            pass
    with pytest.raises(UserError, match=rf"compile cache {tmp_path}/cache: cannot create it \(Permission denied"):
        cache_root(tmp_path / "cache")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_cache_dir_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    """An existing folder without write permission (simulated: root passes permission bits) is refused
    up front, not by a traceback when the checkpoint or the first executable is written."""
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != tmp_path and real(p, mode, **kw))
    with pytest.raises(UserError, match=rf"compile cache {tmp_path}: no permission to write in it"):
        cache_root(tmp_path)


def test_an_out_folder_that_is_a_mount_point_or_cannot_be_renamed_is_one_error(tmp_path, monkeypatch):
    """A mount point (a container volume) is refused before any work; a folder the final rename
    fails on (an immutable folder) is one error and leaves it and its files as they were."""
    import os

    from dsneuron.compiler import bundle_writer as bw

    out = tmp_path / "vol"
    out.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == out)
    with pytest.raises(bw.OutputError, match=rf"output {out} is a mount point.*--out {out}/bundle"):
        bw.check_output(out, force=False)
    monkeypatch.undo()
    (out / "README.md").write_text("kept")
    real = os.rename

    def refuse(src, dst):
        if Path(src) == out:
            raise PermissionError(1, "Operation not permitted")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(bw.OutputError, match=rf"output {out} cannot be replaced \(Operation not permitted\)"):
        with bw.BundleWriter(out, force=False) as w:
            (w.tmp / "x").write_text("y")
            bw._swap(w.tmp, out, tmp_path / ".old")  # commit's last step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vol"] and (out / "README.md").read_text() == "kept"


# ------------------------------------------------------------------------------------------ entries
KEY = "ab" * 32


def test_put_get_and_completion_marker(tmp_path):
    cache = CompileCache(tmp_path / "cache")
    art = tmp_path / "x.pt2"
    art.write_bytes(b"executable")
    assert cache.get(KEY) is None
    got = cache.put(KEY, art)
    assert got.read_bytes() == b"executable" and cache.get(KEY) == got
    # an entry without its marker, or whose artifact changed, does not count
    (got.parent / MARKER).unlink()
    assert cache.get(KEY) is None
    cache.put(KEY, art)
    got.write_bytes(b"executablX")
    assert cache.get(KEY) is None
    assert (cache.hits, cache.misses) == (1, 3)


def test_a_corrupted_entry_is_replaced_by_the_next_put(tmp_path):
    """One flipped byte makes an entry a miss; the recompiled artifact must replace it (before, the
    bad entry stayed and every later compile missed again)."""
    cache = CompileCache(tmp_path / "cache")
    art = tmp_path / "x.pt2"
    art.write_bytes(b"executable")
    got = cache.put(KEY, art)
    got.write_bytes(b"executablX")
    assert cache.get(KEY) is None
    again = cache.put(KEY, art)
    assert cache.get(KEY) == again and again.read_bytes() == b"executable"
    assert [p.name for p in again.parent.parent.iterdir() if p.name.startswith(".")] == []  # no stale leftovers


def _hammer(root: str, payload: bytes, n: int) -> None:
    cache = CompileCache(Path(root))
    art = Path(root).parent / f"art-{payload.decode()}.pt2"
    art.write_bytes(payload * 1000)
    for _ in range(n):
        cache.put(KEY, art)
        assert cache.get(KEY) is not None


def test_concurrent_puts_share_one_directory_safely(tmp_path):
    root = tmp_path / "cache"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_hammer, args=(str(root), p, 25)) for p in (b"A", b"B")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    got = CompileCache(root).get(KEY)
    assert got is not None and got.read_bytes() in (b"A" * 1000, b"B" * 1000)
    marker = json.loads((got.parent / MARKER).read_text())
    assert marker["sha256"] == file_sha256(got)
    assert [p.name for p in (root / "entries").iterdir()] == [KEY]  # no temporary folders left


# ------------------------------------------------------------------------------------------ pipeline
@pytest.fixture()
def fake_backend(monkeypatch):
    """Replace the AOTInductor compile by a stub that records its calls and writes the graph text."""
    calls = []

    def fake(program, out, flags):
        calls.append(out.name)
        out.write_text(normalised_graph(program))

    monkeypatch.setattr(backend_cpu, "compile_cpu", fake)
    return calls


def test_second_compile_compiles_nothing_and_a_changed_option_recompiles(tmp_path, fake_backend):
    kit = stand_in.make_kit(tmp_path, {"max_seq_len": 8, "decode_context_lens": [8]})
    cache = tmp_path / "cache"
    run = lambda out, flags=None: pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, tmp_path / out, kit.parts,
                                                          cache_dir=cache, flags=flags, console=QUIET)
    run("one")
    assert sorted(fake_backend) == ["decode_b2_s8.pt2", "prefill_b2_s8.pt2"]
    run("two")
    assert len(fake_backend) == 2, "an unchanged bucket was compiled twice"
    for name in ("decode_b2_s8.pt2", "prefill_b2_s8.pt2"):
        assert (tmp_path / "one/buckets" / name).read_bytes() == (tmp_path / "two/buckets" / name).read_bytes()
    run("three", flags={"aot_inductor.compile_wrapper_opt_level": "O1"})
    assert len(fake_backend) == 4, "a changed compiler option did not recompile"
    manifest = json.loads((tmp_path / "three/manifest.json").read_text())
    assert manifest["compiler"]["flags"]["aot_inductor.compile_wrapper_opt_level"] == "O1"


def test_fingerprint_skips_export_on_a_warm_compile(tmp_path, fake_backend, monkeypatch):
    kit = stand_in.make_kit(tmp_path, {"max_seq_len": 8, "decode_context_lens": [8]})
    exports = []
    real_export = pipeline.export_step
    monkeypatch.setattr(pipeline, "export_step", lambda *a, **k: exports.append(a[2]) or real_export(*a, **k))
    run = lambda out, parts: pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, tmp_path / out, parts,
                                                     cache_dir=tmp_path / "cache", console=QUIET)
    run("one", kit.parts)
    assert len(exports) == 2 and len(fake_backend) == 2
    run("two", kit.parts)
    assert len(exports) == 2, "a warm compile with an unchanged fingerprint exported again"
    assert (tmp_path / "one/manifest.json").read_text() == (tmp_path / "two/manifest.json").read_text()

    class Edited(stand_in.StandInFactory):  # the model source changed, its graphs did not
        def fingerprint(self):
            return "0" * 64

    run("three", dataclasses.replace(kit.parts, steps=Edited(kit.model)))
    assert len(exports) == 4 and len(fake_backend) == 2  # exported again, the graph key still hits

    class NoFingerprint:  # a factory without fingerprint() always exports
        def __init__(self, inner):
            self.prefill, self.decode, self.init_state = inner.prefill, inner.decode, inner.init_state

    run("four", dataclasses.replace(kit.parts, steps=NoFingerprint(kit.parts.steps)))
    assert len(exports) == 6 and len(fake_backend) == 2


def test_cache_dir_from_env(tmp_path, fake_backend, monkeypatch):
    kit = stand_in.make_kit(tmp_path, {"max_seq_len": 8, "decode_context_lens": [8]})
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "envcache"))
    pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, tmp_path / "b", kit.parts, console=QUIET)
    assert len(list((tmp_path / "envcache" / "entries").iterdir())) == 2


def test_real_recompile_with_the_same_cache_compiles_nothing(tmp_path, monkeypatch):
    bundle, kit = stand_in.shared_bundle()
    calls = []
    real = backend_cpu.compile_cpu
    monkeypatch.setattr(backend_cpu, "compile_cpu", lambda *a: calls.append(a) or real(*a))
    again = pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, tmp_path / "again", kit.parts,
                                    cache_dir=bundle.parent / "cache", console=QUIET)
    assert calls == []
    first = json.loads((bundle / "manifest.json").read_text())["files"]
    second = json.loads((again / "manifest.json").read_text())["files"]
    assert first == second  # same executables, weights and tokenizer, byte for byte


# ------------------------------------------------------------------------------------------ key properties
FLAG_NAME = st.from_regex(r"--[a-z][a-z0-9-]{0,10}", fullmatch=True)
FLAG_VALUE = st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9_.,:]{1,8}", fullmatch=True))
FLAG_SETS = st.dictionaries(FLAG_NAME, FLAG_VALUE, min_size=1, max_size=6)


def render(flags: dict, data, as_list: bool = False) -> str | list[str]:
    """`flags` ({name: value or None}) as a command line: a random order, `--n=v` or `--n v`, and
    random runs of spaces between tokens."""
    items = data.draw(st.permutations(sorted(flags.items())))
    tokens = []
    for name, value in items:
        if value is None:
            tokens.append(name)
        elif data.draw(st.booleans()):
            tokens.append(f"{name}={value}")
        else:
            tokens += [name, value]
    if as_list:
        return tokens
    return "".join(t + " " * data.draw(st.integers(1, 3)) for t in tokens)


@settings(max_examples=60, deadline=None)
@given(flags=FLAG_SETS, data=st.data())
def test_flag_order_spelling_and_spacing_never_change_the_key(flags, data):
    tc = {"torch": "2.13.0"}
    keys = {cache_key("graph", render(flags, data, as_list=bool(i % 2)), tc, "neuron", "neuronx-cc") for i in range(4)}
    assert len(keys) == 1


@settings(max_examples=60, deadline=None)
@given(flags=FLAG_SETS, data=st.data())
def test_any_flag_change_changes_the_key(flags, data):
    tc = {"torch": "2.13.0"}
    key = lambda f: cache_key("graph", render(f, data), tc, "neuron", "neuronx-cc")
    base = key(flags)
    name = data.draw(st.sampled_from(sorted(flags)))
    value = flags[name]
    variants = [{**flags, name: (value or "") + "x"},  # a value changed (or a bare flag given a value)
                {n: v for n, v in flags.items() if n != name} or {"--other": None},  # a flag dropped
                {**flags, name + "-extra": None}]  # a flag added
    if value is not None:
        variants.append({**flags, name: None})  # a value dropped
    for changed in variants:
        assert key(changed) != base, (flags, changed)
    # a second occurrence of a flag is a change too (some options accumulate)
    tokens = render(flags, data, as_list=True)
    assert cache_key("graph", tokens + tokens[:1], tc, "neuron", "neuronx-cc") != base


@settings(max_examples=40, deadline=None)
@given(flags=st.dictionaries(st.from_regex(r"[a-z_.]{1,12}", fullmatch=True),
                             st.one_of(st.booleans(), st.integers(-3, 3), st.text(max_size=4)), min_size=1, max_size=6),
       data=st.data())
def test_dict_flags_key_ignores_order_and_sees_values(flags, data):
    tc = {"torch": "2.13.0"}
    shuffled = dict(data.draw(st.permutations(list(flags.items()))))
    assert cache_key("g", flags, tc, "cpu", "aot_inductor") == cache_key("g", shuffled, tc, "cpu", "aot_inductor")
    name = data.draw(st.sampled_from(sorted(flags)))
    assert cache_key("g", {**flags, name: [flags[name]]}, tc, "cpu", "aot_inductor") != \
        cache_key("g", flags, tc, "cpu", "aot_inductor")


@settings(max_examples=30, deadline=None)
@given(graph=st.text(min_size=1, max_size=40), data=st.data())
def test_key_sees_graph_target_toolchain_and_backend(graph, data):
    tc = {"torch": "2.13.0", "neuronx_cc": "2.21"}
    base = cache_key(graph, "-O1", tc, "neuron", "neuronx-cc")
    assert base == cache_key(graph, "-O1", dict(reversed(list(tc.items()))), "neuron", "neuronx-cc")
    others = [cache_key(graph + data.draw(st.text(min_size=1, max_size=3)), "-O1", tc, "neuron", "neuronx-cc"),
              cache_key(graph, "-O1", tc, "cpu", "neuronx-cc"),
              cache_key(graph, "-O1", {**tc, "neuronx_cc": "2.22"}, "neuron", "neuronx-cc"),
              cache_key(graph, "-O1", tc, "neuron", "aot_inductor")]
    assert base not in others


# ------------------------------------------------------------------------------------------ shared cache, two checkouts
def _compile_in_child(kit, root: str, name: str, barrier) -> None:
    """Child process: compile the stand-in kit into its own output with the shared cache; the fake
    backend (inherited through fork) holds every process at the barrier inside its first compile, so
    both compile the same key at the same time and race to put it."""
    waited = []

    def fake(program, out, flags):
        if not waited:
            waited.append(barrier.wait(timeout=60))
        out.write_text(normalised_graph(program))

    backend_cpu.compile_cpu = fake
    pipeline.compile_bundle(kit.model_cfg, kit.compile_cfg, Path(root) / name, kit.parts, cache_dir=Path(root) / "cache",
                            console=QUIET)


def test_two_concurrent_compiles_share_one_cache_directory(tmp_path):
    kit = stand_in.make_kit(tmp_path, {"max_seq_len": 8, "decode_context_lens": [8]})
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_compile_in_child, args=(kit, str(tmp_path), name, barrier)) for name in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    ma, mb = (json.loads((tmp_path / n / "manifest.json").read_text()) for n in ("a", "b"))
    assert ma["files"] == mb["files"] and ma["buckets"] == mb["buckets"]
    cache = CompileCache(tmp_path / "cache")
    keys = sorted(b["cache_key"] for b in ma["buckets"])
    assert sorted(p.name for p in (tmp_path / "cache" / "entries").iterdir()) == keys  # no temporary folders left
    for key in keys:
        got = cache.get(key)
        assert got is not None and got.read_bytes() == (tmp_path / "a" / "buckets" / got.name).read_bytes()
    assert not [p for p in (tmp_path / "cache" / "aliases").iterdir() if not p.name.endswith(".json")]


KEYS_IN_CHECKOUT = '''
import dataclasses, json, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path[:0] = [str(root), str(root / "dsneuron" / "tests")]
import dsneuron
assert Path(dsneuron.__file__).resolve().is_relative_to(root.resolve()), dsneuron.__file__
import stand_in
from dsneuron.compiler import backend_cpu, backend_neuron, compile as pipeline
from dsneuron.compiler.buckets import plan_buckets
from dsneuron.compiler.cache import cache_key, normalised_graph, pre_key
from dsneuron.runtime_min.bundle.bundle import host_toolchain
kit = stand_in.make_kit(root / "kit", {"max_seq_len": 8, "decode_context_lens": [8]})
pb = plan_buckets(kit.compile_cfg, kit.model_cfg).buckets[0]
from types import SimpleNamespace
from dsneuron.kernels_nki.neuron_adapters import NkiBinding
record, program = pipeline.export_bucket(kit.parts, pb, pipeline.CpuBackend(None))
flags, tc = backend_cpu.effective_flags(None), host_toolchain()
binding = NkiBinding("stand_in:gated_mix", stand_in.in_order, "dsneuron_test::nki_gated_mix")
kernels = backend_neuron.kernel_sources({"dsneuron_test::gated_mix": binding})
from dsneuron.compiler.lower import KernelCalls
neuron = SimpleNamespace(lowering=lambda: KernelCalls({"dsneuron_test::gated_mix": binding}),
                         input_views=backend_neuron.INPUT_VIEWS, neuron_spelling=backend_neuron.NeffBackend.neuron_spelling)
nrecord, nprogram = pipeline.export_bucket(kit.parts, pb, neuron)
nflags = ["--target=trn2", "-O1"]
print(json.dumps({
    "cpu": cache_key(normalised_graph(program), flags, tc, "cpu", backend_cpu.BACKEND),
    "cpu_pre": pre_key(kit.parts.steps.fingerprint(), dataclasses.asdict(pb), pipeline._weights_digest(kit.parts.weights),
                       flags, tc, "cpu", backend_cpu.BACKEND),
    "neuron": cache_key(normalised_graph(nprogram), nflags, backend_neuron.key_toolchain(tc, kernels), "neuron",
                        backend_neuron.BACKEND),
    "paths_in_traces": str(root) in "".join(n.meta.get("stack_trace") or "" for n in program.graph.nodes),
}))
'''


def test_two_checkouts_in_different_folders_give_the_same_keys(tmp_path):
    """The package copied to two folders (as two clones would be): the cpu graph key, the pre-export
    key and the neuron key agree, although the traced graphs carry each copy's source paths."""
    repo = Path(__file__).resolve().parent.parent
    roots = [tmp_path / "checkout", tmp_path / "somewhere" / "else" / "clone"]
    for root in roots:
        pkg = root / "dsneuron"
        for part in ("compiler", "graphs", "kernels_nki", "runtime_min"):
            shutil.copytree(repo / part, pkg / part, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(repo / "__init__.py", pkg / "__init__.py")
        (pkg / "tests").mkdir()
        shutil.copy(repo / "tests" / "stand_in.py", pkg / "tests" / "stand_in.py")
    assert source_digest(roots[0] / "dsneuron" / "compiler") == source_digest(roots[1] / "dsneuron" / "compiler")
    procs = [subprocess.Popen([sys.executable, "-c", KEYS_IN_CHECKOUT, str(root)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=root) for root in roots]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0]["paths_in_traces"] and outs[1]["paths_in_traces"]  # so the test can fail
    for key in ("cpu", "cpu_pre", "neuron"):
        assert outs[0][key] == outs[1][key], key


def test_build_folders_of_dead_processes_are_removed(tmp_path):
    """A compile worker killed mid-build (SIGTERM, SIGKILL) leaves its .build.<pid>- folder; the next
    build in the cache removes it, and leaves a live process's build folder and other files alone."""
    import os
    import subprocess

    from dsneuron.compiler.cache import BUILD_PREFIX, CompileCache

    child = subprocess.Popen(["true"])  # a pid that has exited
    child.wait()
    stale = tmp_path / f"{BUILD_PREFIX}{child.pid}-abc"
    (stale / "sub").mkdir(parents=True)
    live = tmp_path / f"{BUILD_PREFIX}{os.getppid()}-def"
    live.mkdir()
    other = tmp_path / f"{BUILD_PREFIX}notapid"
    other.mkdir()
    with CompileCache(tmp_path).build_folder() as tmp:
        assert Path(tmp).name.startswith(f"{BUILD_PREFIX}{os.getpid()}-")
        assert not stale.exists() and live.is_dir() and other.is_dir()
    assert not Path(tmp).exists()
