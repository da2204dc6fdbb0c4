"""compiler/aoti_runtime.py: the AOTI runtime compiled once and linked into every executable."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch

from dsneuron.compiler import aoti_runtime
from dsneuron.compiler.aoti_runtime import INTERFACE_END, shared_runtime, split_wrapper

WRAPPER = (
    "#include <torch/csrc/inductor/aoti_include/cpu.h>\n"
    "// Definition of AOTI runtime interface functions\n"
    "#include <torch/csrc/inductor/aoti_runtime/interface.h>\n"
    "extern \"C\" {\nAOTIRuntimeError AOTInductorModelContainerRun() { return 0; }\n"
    f"{INTERFACE_END}"
    "namespace torch::aot_inductor {\nvoid AOTInductorModel::run_impl() {}\n}\n"
)


def test_split_keeps_the_includes_and_declares_the_base_extern():
    runtime, graph = split_wrapper(WRAPPER)
    assert runtime.startswith(WRAPPER[:WRAPPER.index(INTERFACE_END)])
    assert runtime.rstrip().endswith("template class torch::aot_inductor::AOTInductorModelBase"
                                     "<torch::aot_inductor::AOTInductorModel>;")
    assert "AOTInductorModel::run_impl" not in runtime
    assert graph.splitlines()[:2] == ["#include <torch/csrc/inductor/aoti_include/cpu.h>",
                                      "#include <torch/csrc/inductor/aoti_runtime/interface.h>"]
    assert "extern template class torch::aot_inductor::AOTInductorModelBase" in graph
    assert "AOTInductorModelContainerRun" not in graph and "void AOTInductorModel::run_impl() {}" in graph


@pytest.mark.parametrize("text", [
    WRAPPER.replace(INTERFACE_END, ""),  # no end marker
    WRAPPER + INTERFACE_END,  # two
    WRAPPER.replace("AOTInductorModelContainerRun", "Other"),  # not the interface
    WRAPPER.replace("// Definition", "void AOTInductorModel::f() {}\n// Definition"),  # graph code before it
])
def test_a_wrapper_of_another_shape_is_not_split(text):
    assert split_wrapper(text) is None


class _Relu(torch.nn.Module):
    def forward(self, x, w):
        return torch.relu(x @ w) + 1


class _Scale(torch.nn.Module):
    def forward(self, x, w):
        return (x @ w) * 2 - x.sum()


def test_executables_share_one_runtime_object_and_compute_the_same(tmp_path, monkeypatch):
    """Two graphs, then the first again: Inductor finds its generated wrapper source in its cache
    the second time and compiles it again, which must still give a whole executable (the first
    version of the split rewrote that source and left the second build without its runtime)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    commands: list[list[str]] = []
    from torch._inductor import cpp_builder
    real = cpp_builder.run_compile_cmd
    monkeypatch.setattr(cpp_builder, "run_compile_cmd", lambda cmd, cwd: (commands.append(shlex.split(cmd)), real(cmd, cwd))[1])
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    flags = {"aot_inductor.compile_wrapper_opt_level": "O0"}
    models = (_Relu(), _Scale(), _Relu())
    with shared_runtime(tmp_path / "rt"):
        for i, model in enumerate(models):
            program = torch.export.export(model, (x, w))
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / f"m{i}.pt2"),
                                                     inductor_configs=flags)
    assert len(list((tmp_path / "rt").glob("runtime-*.o"))) == 1
    runtime_o = str(next((tmp_path / "rt").glob("runtime-*.o")))
    links = [c for c in commands if "-shared" in c and any(a.endswith(".wrapper.o") for a in c)]
    assert len(links) == 3 and all(runtime_o in c for c in links)
    sources = list((tmp_path / "inductor").rglob("*.wrapper.cpp"))
    assert len(sources) == 2 and all(INTERFACE_END in f.read_text() for f in sources)  # left as generated
    for i, model in enumerate(models):
        got = torch._inductor.aoti_load_package(str(tmp_path / f"m{i}.pt2"))(x, w)
        torch.testing.assert_close(got, model(x, w), rtol=0, atol=1e-5)


def test_the_patch_is_undone(tmp_path):
    from torch._inductor import cpp_builder
    before = cpp_builder.run_compile_cmd
    with pytest.raises(RuntimeError):
        with shared_runtime(tmp_path):
            assert cpp_builder.run_compile_cmd is not before
            raise RuntimeError
    assert cpp_builder.run_compile_cmd is before


def _fake_compiler(calls: list, fail_graph: bool = False):
    """A stand-in for the compile command: writes its -o file, records its arguments, fails on the
    graph part when asked."""
    def compile_cmd(cmd: str, cwd: str) -> None:
        args = shlex.split(cmd)
        calls.append(args)
        if fail_graph and any(a.endswith("graph.cpp") for a in args):
            raise RuntimeError("g++ failed")
        if "-o" in args:
            source = next(a for a in args if a.endswith(".cpp"))
            Path(args[args.index("-o") + 1]).write_bytes(b"obj of " + Path(source).read_bytes())
    return compile_cmd


def _split(tmp_path, compile_cmd, folder=None):
    source = tmp_path / "x.wrapper.cpp"
    source.write_text(WRAPPER)
    return aoti_runtime._compile_split(["g++", str(source), "-c", "-o", str(tmp_path / "x.o")], str(source),
                                       folder or tmp_path / "rt", compile_cmd, str(tmp_path))


def test_a_failed_graph_compile_leaves_nothing_behind(tmp_path):
    calls = []
    with pytest.raises(RuntimeError, match="g\\+\\+ failed"):
        _split(tmp_path, _fake_compiler(calls, fail_graph=True))
    assert (tmp_path / "x.wrapper.cpp").read_text() == WRAPPER
    names = sorted(p.name for p in (tmp_path / "rt").iterdir())
    assert len(names) == 2 and names[0].endswith(".o") and names[1].endswith(".sha256")  # no leftovers


@pytest.mark.parametrize("damage", [b"", b"obj of #include"])
def test_a_damaged_runtime_object_is_built_again(tmp_path, damage):
    calls = []
    runtime_o = _split(tmp_path, _fake_compiler(calls))
    intact = Path(runtime_o).read_bytes()
    assert len(calls) == 2  # the runtime, then the graph
    assert _split(tmp_path, _fake_compiler(calls)) == runtime_o and len(calls) == 3  # reused
    Path(runtime_o).write_bytes(damage)  # an empty object links "fine" into an executable that cannot load
    assert _split(tmp_path, _fake_compiler(calls)) == runtime_o and len(calls) == 5
    assert Path(runtime_o).read_bytes() == intact


def test_a_folder_that_cannot_be_used_compiles_the_wrapper_whole(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert _split(tmp_path, _fake_compiler([]), folder=blocker) is None
    assert blocker.read_text() == "x"
