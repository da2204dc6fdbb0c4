"""AOTInductor's runtime compiled once per set of compile flags instead of once per executable.

Inductor writes an executable's wrapper translation unit in two parts: first the AOTI runtime's C
interface (`AOTInductorModelContainerCreate` ... up to the closing `} // extern "C"`), the same text
for every graph, then the graph's own `AOTInductorModel` methods. Compiling that unit instantiates
the whole header-only runtime again (the model container, the `AOTInductorModelBase` template,
std::regex for device names, ...): measured with g++ 13 on a 2-core Zen 4 host at the wrapper's -O0,
3.3 s for a one-op graph, 3.75 s for a tiny decode attention stage, of which 1.95 s remain once the
runtime is left out. A cold tiny compile builds 32 such units.

While `shared_runtime(folder)` is active (in the process that runs the AOTInductor compile), the
wrapper's compile command is split in two:
- the interface part plus an explicit instantiation of `AOTInductorModelBase<AOTInductorModel>` is
  compiled once into `folder/runtime-<key>.o` (with its sha256 in `runtime-<key>.sha256`: an object
  that does not match is built again), key = sha256 of that text, the full compile command (flags,
  precompiled header, include folders) and the torch version;
- the graph's part (written beside it; Inductor's generated source is left as it is) is compiled
  with `extern template` for the base class, so g++ instantiates only the graph's own code;
and the link of the executable's shared object gets the runtime object beside the wrapper's. Both
objects come from the same command, so the shared object holds the same code as before, its
exported C interface included (the package loader finds the same symbols).

The split relies on the text Inductor generates (torch pinned in pyproject.toml); a wrapper that
does not have that shape (the interface's end marker missing or not unique), or a `folder` that
cannot be written, is compiled whole, as Inductor would.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Iterator

import torch

from dsneuron.runtime_min.bundle.bundle import file_sha256

INTERFACE_END = '} // extern "C"\n'
_BASE = "torch::aot_inductor::AOTInductorModelBase<torch::aot_inductor::AOTInductorModel>"


def split_wrapper(source: str) -> tuple[str, str] | None:
    """(runtime text, graph text) of a generated AOTInductor wrapper source, or None when it does
    not have the expected shape. The runtime text is the C interface plus the base class's explicit
    instantiation; the graph text keeps the source's #include lines, declares the base class's
    instantiation extern and goes on with everything after the interface."""
    if source.count(INTERFACE_END) != 1:
        return None
    head, tail = source.split(INTERFACE_END)
    if "AOTInductorModel::" in head or "AOTInductorModelContainerRun" not in head:
        return None
    includes = "".join(line for line in head.splitlines(keepends=True) if line.startswith("#include"))
    runtime = f"{head}{INTERFACE_END}\ntemplate class {_BASE};\n"
    graph = f"{includes}\nextern template class {_BASE};\n{tail}"
    return runtime, graph


@contextlib.contextmanager
def shared_runtime(folder: Path) -> Iterator[None]:
    """Compile AOTInductor wrappers in this process with the runtime shared (module docstring);
    the runtime objects live in `folder` (created when needed). Not thread-safe: it replaces
    torch._inductor.cpp_builder.run_compile_cmd while active."""
    from torch._inductor import cpp_builder

    original: Callable[[str, str], None] = cpp_builder.run_compile_cmd
    runtimes: dict[str, str] = {}  # wrapper object -> its runtime object

    def run(cmd_line: str, cwd: str) -> None:
        args = shlex.split(cmd_line)
        if "-c" in args:
            sources = [a for a in args if a.endswith(".wrapper.cpp")]
            if len(sources) == 1:
                runtime_o = _compile_split(args, sources[0], Path(folder), original, cwd)
                if runtime_o is not None:
                    runtimes[args[args.index("-o") + 1]] = runtime_o
                    return
        elif "-shared" in args:
            wrapper_o = next((a for a in args if a in runtimes), None)
            if wrapper_o is not None:
                args.insert(args.index(wrapper_o) + 1, runtimes[wrapper_o])
                return original(shlex.join(args), cwd)
        return original(cmd_line, cwd)

    cpp_builder.run_compile_cmd = run
    try:
        yield
    finally:
        cpp_builder.run_compile_cmd = original


def _compile_split(args: list[str], source: str, folder: Path, compile_cmd: Callable[[str, str], None],
                   cwd: str) -> str | None:
    """Compile wrapper `source` (args: its -c command) as its graph part, after making the runtime
    object if `folder` holds no intact one (its sha256 beside it); returns the runtime object's
    path, or None (nothing done: compile it whole) when the source cannot be split or `folder`
    cannot be used. The generated source is left as it is: Inductor keeps it in its cache and
    compiles it again, unchanged, when the same graph comes back; the sources written here live in
    a private temporary folder."""
    text = Path(source).read_text()
    parts = split_wrapper(text)
    if parts is None or "-o" not in args:
        return None
    runtime, graph = parts
    out = args.index("-o") + 1
    command = [a for i, a in enumerate(args) if a != source and i != out]
    key = hashlib.sha256("\0".join([runtime, torch.__version__, *command]).encode()).hexdigest()[:32]
    runtime_o, mark = folder / f"runtime-{key}.o", folder / f"runtime-{key}.sha256"
    with tempfile.TemporaryDirectory(prefix="dsneuron-aoti-") as tmp:
        if not _intact(runtime_o, mark):
            built = Path(tmp) / "runtime.o"
            (Path(tmp) / "runtime.cpp").write_text(runtime)
            compile_cmd(shlex.join([f"{tmp}/runtime.cpp" if a == source else str(built) if i == out else a
                                    for i, a in enumerate(args)]), cwd)
            part = folder / f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            try:  # copied in under a private name, then renamed: a reader sees a whole object or none
                folder.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(built, f"{part}.o")
                Path(f"{part}.sha256").write_text(file_sha256(built))
                os.replace(f"{part}.o", runtime_o)
                os.replace(f"{part}.sha256", mark)
            except OSError:  # the folder cannot take it: this wrapper compiles whole, as Inductor's
                for leftover in (f"{part}.o", f"{part}.sha256"):
                    with contextlib.suppress(OSError):
                        os.unlink(leftover)
                return None
            if not _intact(runtime_o, mark):  # a concurrent writer's pair, half renamed
                return None
        (Path(tmp) / "graph.cpp").write_text(graph)
        compile_cmd(shlex.join([f"{tmp}/graph.cpp" if a == source else a for a in args]), cwd)
    return str(runtime_o)


def _intact(runtime_o: Path, mark: Path) -> bool:
    """Whether `runtime_o` is there with the sha256 its mark file records (an empty or truncated
    object would link into an executable that fails to load: it is rebuilt instead)."""
    try:
        return runtime_o.is_file() and mark.read_text().strip() == file_sha256(runtime_o)
    except OSError:
        return False
