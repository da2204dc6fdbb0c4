"""cpu backend: an exported, lowered step graph -> an AOTInductor package (`.pt2`) for this host.

The package holds the generated C++ (wrapper + kernels) built into a shared object that links
against libtorch; it contains no pickled data and no weights (they are graph inputs, see
compiler/export.py), only small non-weight constants such as RoPE tables. runtime_min loads it with
the C++ package loader (`torch._C._aoti.AOTIModelPackageLoader`).

Flags (measured on this 2-core host):
- the wrapper, the glue that calls the kernels, is built at -O0: that halves the g++ time of the
  largest translation unit (9.2 s -> 4.9 s for a one-linear graph) while kernels keep -O3; and the
  AOTI runtime inside it is compiled once per flag set, not once per executable
  (compiler/aoti_runtime.py: 3.75 -> 1.95 s of g++ for a tiny decode attention stage's wrapper);
- no line tables (-g1 off): g++ spends a quarter of a kernel TU's time and a sixth of a wrapper
  TU's on them (one block kernel TU 8.4 -> 6.3 s, the 13-node embedding's wrapper 7.7 -> 6.6 s);
  a crash inside an executable then shows function names but no source lines;
- explicit SIMD code generation at a fixed width of 256 bits (`cpp.simdlen`: AVX2 on AVX2 and
  AVX-512 hosts alike, scalar where AVX2 is missing), so the lanes an fp32 reduction is split
  into do not depend on the host's widest ISA. Since the GEMMs, attention and QDQs run in the
  C++ kernels (kernels_nki/cpu), what Inductor generates is the elementwise and reduction glue
  between them, and there vectorised code pays: on tiny it cut prefill 715 from 4.4 to 3.2 s and
  a decode step from ~80 to ~52 ms (one side-by-side run, bundles otherwise equal), for ~50% more
  compile time. Without the kernels (whole-step graphs of 21k nodes, mostly tiny elementwise ops)
  it had been slower and compiled longer, hence once off;
- bf16 rounding points kept (`emulate_precision_casts`): without it Inductor fuses chains of bf16
  ops in fp32 and skips the intermediate roundings the reference makes (measured on the inlined
  kernels: 24-33% of elements one bf16 step off; micro logits cosine 0.73 against the golden);
- the glue kernels run on every thread (`cpp.dynamic_threads`, `cpp.threads` = the compiling
  process's torch thread count, `cpp.min_chunk_size`): Inductor decides a kernel's OpenMP loops
  from the thread count it sees, and the compile workers run torch single-threaded
  (compiler/staged.py), so every kernel had been generated serial (in perf, the generated kernels
  took ~16% of a tiny verify's time on one core while the other waited; on every thread: prefill
  715 0.94x, a verify of 1 + 5 0.93-0.98x, the same bits). A loop nest goes parallel from
  threads x 4096 elements, below which an OpenMP fork costs about what it saves. A reduction is
  never split across threads (`rows_to_threads`): each output element is reduced by one thread in
  one order, so the bits do not depend on the thread count;
- no lower-bound check of dynamic sizes at run time (`aot_inductor.check_lowerbound`; the upper
  bound is still checked with AOTI_RUNTIME_CHECK_INPUTS=1). The per-token executables take 1..N
  tokens and are exported size-obliviously (compiler/export.py `size_oblivious`: the export fails
  if the model's semantics branch on a size being 1), but Inductor's own lowering of a view still
  assumes a size > 1 for its stride arithmetic (strides along a size-1 dimension are never used)
  and raises the executable's recorded lower bound to 2, which the check would then refuse;
- no max-autotune. Other knobs (pattern matcher, constant folding, size/scalar asserts, peak-memory
  reordering, batch fusion) changed nothing measurable and keep their defaults.
Generated code uses `-march=native`, so a package runs only on CPUs with the compiling host's ISA
extensions; the manifest records them (runtime_min/bundle/bundle.py checks them).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from .aoti_runtime import shared_runtime
from .export import CompileError, quiet_treespec_warning, size_oblivious

BACKEND = "aot_inductor"
DEFAULT_FLAGS: dict[str, Any] = {
    "aot_inductor.check_lowerbound": False,
    "aot_inductor.compile_wrapper_opt_level": "O0",
    "aot_inductor.enable_line_tables": False,
    "emulate_precision_casts": True,
    "cpp.dynamic_threads": True,
    "cpp.min_chunk_size": 4096,
    "cpp.simdlen": 256,
    "max_autotune": False,
}


# Weight dtypes Inductor's cpu codegen cannot take as kernel arguments, passed as same-width views.
INPUT_VIEWS = {torch.float8_e8m0fnu: torch.uint8}


def effective_flags(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """DEFAULT_FLAGS plus `cpp.threads` (this process's torch thread count: the thread count the
    runtime uses by default, which Inductor's choice of parallel loops assumes; at least 2, since
    at 1 Inductor would let every thread of a parallel region run the serial nests that follow a
    parallel one instead of wrapping them in `omp single`), updated with `overrides` (Inductor
    config keys), sorted by key."""
    flags = {**DEFAULT_FLAGS, "cpp.threads": max(2, torch.get_num_threads())}
    flags.update(overrides or {})
    return dict(sorted(flags.items()))


def warm_up() -> threading.Thread:
    """Start Inductor's vector-ISA probe in a thread of this process and return the thread.

    Inductor settles which vector ISAs this host can build and load once per process: one g++
    build of a probe library per ISA (seconds each with a cold Inductor cache) and one Python
    subprocess per ISA that loads it. Made here before the compile workers are forked, they
    inherit the answer instead of each working it out (the first worker building the probes while
    the other waits on their file locks). Mostly subprocess time, so the thread runs beside the
    parent's own planning; join it before forking (a fork must not copy a half-run probe)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    thread = threading.Thread(target=valid_vec_isa_list, name="dsneuron-vec-isa-probe", daemon=True)
    thread.start()
    return thread


_PATCH_LOCK = threading.RLock()  # Inductor's class attributes, patched by one compile at a time


@contextlib.contextmanager
def rows_to_threads():
    """Inductor's cpp codegen, patched for the duration of a compile (process-wide: Inductor's
    classes) in two choices it has no option for:

    - a loop nest's parallel loops are its outer (non-reduction) loops, never a reduction loop: a
      reduction split across threads adds per-thread partial sums, whose grouping depends on the
      thread count at run time, where the cpu target's results may not (docs/numerics.md). Where
      Inductor would move the threads onto a long reduction under few outer loops, they take the
      outer loops instead;
    - a nest with fewer than `cpp.threads x cpp.min_chunk_size` elements at the trace's sizes
      stays serial: with `cpp.dynamic_threads` Inductor otherwise makes every nest parallel however
      small, and each OpenMP fork of a decode executable's small kernels costs more than it saves.
      (A per-token executable is traced at its largest token count, so its nests go parallel
      also where a decode step calls it with one token.)

    Neither choice is in the compile cache's key (compiler/cache.py): a change to them must come
    with a change of the flags or of the key's format. Stores that add atomically (Inductor's
    scatter-add lowering) would make a parallel nest's sums order-dependent; `compile_cpu` refuses
    an executable that has them."""
    from torch._inductor import config
    from torch._inductor.codegen.cpp import CppKernel, LoopNest, ParallelDepth

    widest, decide = LoopNest.max_parallel_depth, CppKernel.decide_parallel_depth

    def outer_loops_only(nest: LoopNest) -> ParallelDepth:
        depth = widest(nest)
        if depth.parallel_depth and nest.loops[depth.start_depth].is_reduction:
            outer = 0
            while outer < len(nest.loops) and not nest.loops[outer].is_reduction:
                outer += 1
            return ParallelDepth(parallel_depth=outer, start_depth=0)
        return depth

    def large_nests_only(kernel: CppKernel, depth: ParallelDepth, threads: int) -> ParallelDepth:
        if kernel.size_hint() < threads * config.cpp.min_chunk_size:
            return ParallelDepth(parallel_depth=0, start_depth=depth.start_depth)
        return decide(kernel, depth, threads)

    with _PATCH_LOCK, mock.patch.object(LoopNest, "max_parallel_depth", outer_loops_only), \
            mock.patch.object(CppKernel, "decide_parallel_depth", large_nests_only):
        yield


def compile_cpu(program: torch.export.ExportedProgram, out: Path, flags: dict[str, Any]) -> None:
    """AOTInductor-compile `program` into the package file `out` (written whole, then renamed).

    The package is built under its final file name in a private folder, because the archive's
    root folder is named after the file: the same graph then gives the same member names. The
    runtime objects the wrappers share (compiler/aoti_runtime.py) live in Inductor's cache folder
    beside its precompiled headers, whose paths their keys take. Raises CompileError (nothing
    written at `out`) when the generated kernels add atomically (`rows_to_threads`).
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    with tempfile.TemporaryDirectory(prefix=f".{out.stem}.", dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        with quiet_treespec_warning(), size_oblivious(), rows_to_threads(), \
                shared_runtime(Path(cache_dir()) / "dsneuron-aoti-runtime"):
            torch._inductor.aoti_compile_and_package(program, package_path=str(built), inductor_configs=dict(flags))
        atomic = [n for n, text in kernel_sources(built).items() if "atomic_add" in text]
        if atomic:
            raise CompileError(f"{out.stem}: Inductor lowered a scatter-add to atomic adds ({atomic[0]}), whose "
                               "order across threads would change the sums; use an ATen scatter-add or a custom op")
        os.replace(built, out)


def kernel_sources(package: Path) -> dict[str, str]:
    """{member name: text} of the generated kernel sources (`*.kernel.cpp`) in an AOTInductor package."""
    with zipfile.ZipFile(package) as z:
        return {n: z.read(n).decode() for n in z.namelist() if n.endswith(".kernel.cpp")}
