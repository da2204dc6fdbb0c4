"""Block-scaled GEMM of fast numerics on the cpu target: bf16 dot products, C++ ops and a reference.

Importing this module builds (first use, cached) and loads kernels_nki/cpu/gemm_fast.cpp, which registers

    torch.ops.dsneuron.gemm_fast(a, w, w_scale, fmt, n)                       -> fp32 [M, n]
    torch.ops.dsneuron.gemm_fast_acc(a, w, w_scale, fmt, n, init)            -> fp32 [M, n]   (sum from init)
    torch.ops.dsneuron.gemm_fast_segments(a, offsets, w, w_scale, fmt, n)    -> fp32 [R, n]

with fake implementations here (export, AOTInductor proxy executor), taking the prepared panels of
kernels_nki/cpu_gemm.py `prepare_weight` for fmt 0 fp8, 1 fp4, 2 bf16 (fp32 weights have no fast
path: graphs/model.py keeps them on the exact `gemm_panels`).

Contract: a fp32 [M, K] is rounded to bf16 (nearest even); every weight is its code value as a
bf16 (exact: e4m3fn and e2m1 values have <= 3 mantissa bits; bf16 weights as stored); per output
element, each 32-k block's partial is 16 bf16 pair dot products in k order (VDPBF16PS on hosts with
AVX512-BF16: Intel SDM "VDPBF16PS", which flushes denormals; two fp32 fma per pair elsewhere), and
acc = fma(partial_b, scale_b, acc) over the blocks ascending (scale_b the block's power of two, 1
for bf16). On hosts with AMX-BF16 (variant "amx") the dot products are TDPBF16PS on AMX tiles
(Intel SDM "TDPBF16PS"; it rounds differently from VDPBF16PS, so there every row count runs on
AMX), and a panel whose scales all lie in [2^-64, 2^64] has them folded into its bf16 weights
(exact: the products are normal bf16 values), its tile accumulating the whole K in fp32, block
after block ascending; the other panels keep the per-block partial. Each output element is computed
by one thread with that one sequence, so a row's result does not depend on M, its row, its
neighbours or the thread count: deterministic and batch-invariant on one host. It is not
bit-identical across hosts (the ISA decides the pair rounding), and differs from the exact kernel
(cpu_gemm.py) by the activation's bf16 rounding and the summation order: `gemm_fast_ref` is the
float64 value it approximates, within `error_bound`.

Build: variant "amx" (the flags below plus -mamx-tile -mamx-bf16) where /proc/cpuinfo also lists
amx_bf16 and amx_tile and Linux grants the process the AMX tile state (`request_amx`;
DSNEURON_FAST_NO_AMX=1 skips it: the A/B switch of the benchmarks), else "avx512bf16" (-mavx512f
-mavx512bw -mavx512vl -mavx512bf16 on top of the AVX2 flags) where /proc/cpuinfo lists avx512_bf16
and avx512bw and torch runs at AVX512 capability, or "avx512vbmi" (those plus -mavx512vbmi) where
it also lists avx512vbmi: the same kernel, its FP8 weights expanded to bf16 by byte-table lookups
(VPERMI2B) instead of arithmetic, the same bits; else cpu_gemm's variant ("avx2", "generic").
Cached under $XDG_CACHE_HOME/dsneuron/cpu_gemm like cpu_gemm.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import torch

from dsneuron.kernels_nki import cpu_gemm
from dsneuron.kernels_nki.cpu_gemm import (BLOCK, FORMATS, check_args, check_build, cpu_flags, dequant_weight,
                                             register_gemm_fakes)

_SOURCE = Path(__file__).parent / "cpu" / "gemm_fast.cpp"
#: the fast kernel's formats, by code (the first three of cpu_gemm.FORMATS)
FAST_FORMATS = FORMATS[:3]
_AVX512BF16 = [*cpu_gemm.ISA_FLAGS["avx2"], "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
ISA_FLAGS = {"amx": [*_AVX512BF16, "-mamx-tile", "-mamx-bf16"], "avx512vbmi": [*_AVX512BF16, "-mavx512vbmi"],
             "avx512bf16": _AVX512BF16, **cpu_gemm.ISA_FLAGS}
_NEEDS_BF16 = {*cpu_gemm.ISA_NEEDS["avx2"], "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
#: the /proc/cpuinfo flags a variant's code needs
ISA_NEEDS = {"amx": {*_NEEDS_BF16, "amx_tile", "amx_bf16"}, "avx512vbmi": {*_NEEDS_BF16, "avx512vbmi"},
             "avx512bf16": _NEEDS_BF16, **cpu_gemm.ISA_NEEDS}

# Linux: a process must ask for the AMX tile state before its first AMX instruction (else SIGILL):
# arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), kernel Documentation/arch/x86/xstate.rst
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def request_amx() -> bool:
    """Ask Linux for this process's AMX tile state; True when granted (x86-64 Linux only)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def host_variant() -> str:
    """"amx" when the CPU has AMX-BF16 and the kernel grants its tile state, else "avx512vbmi" when
    it has AVX512-BF16, AVX512BW and AVX512-VBMI, "avx512bf16" when it lacks VBMI; all three need
    torch at AVX512 capability (ATEN_CPU_CAPABILITY can lower it; DSNEURON_FAST_NO_AMX=1 keeps AMX
    off and DSNEURON_FAST_NO_VBMI=1 the table expansion: the benchmarks' A/B switches); else
    cpu_gemm.host_variant()."""
    flags = cpu_flags()
    if cpu_gemm.host_variant() == "avx2" and torch.backends.cpu.get_cpu_capability() == "AVX512" and \
            ISA_NEEDS["avx512bf16"] <= flags:
        if ISA_NEEDS["amx"] <= flags and os.environ.get("DSNEURON_FAST_NO_AMX") != "1" and request_amx():
            return "amx"
        vbmi = ISA_NEEDS["avx512vbmi"] <= flags and os.environ.get("DSNEURON_FAST_NO_VBMI") != "1"
        return "avx512vbmi" if vbmi else "avx512bf16"
    return cpu_gemm.host_variant()


def build(variant: str, namespace: str = "dsneuron", verbose: bool = False) -> str:
    """Compile (or reuse from the cache) cpu/gemm_fast.cpp as `variant`, registering its ops under
    torch.ops.<namespace>; returns the loaded library's path. Raises RuntimeError naming the
    compiler when it is missing or the build fails, ValueError as cpu_gemm.check_build (an unknown
    variant, a bad or taken namespace, a variant this CPU cannot run) and for "amx" where Linux
    refuses the process the AMX tile state."""
    check_build("cpu_gemm_fast", variant, namespace, ISA_NEEDS)
    if variant == "amx" and not request_amx():
        raise ValueError("cpu_gemm_fast.build: Linux refused this process the AMX tile state (arch_prctl "
                         "ARCH_REQ_XCOMP_PERM), so variant 'amx' cannot run here")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"dsneuron fast GEMM kernels: C++ compiler {cxx!r} ($CXX, default c++) not found on PATH")
    from torch.utils import cpp_extension

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = cache / "dsneuron" / "cpu_gemm" / f"{namespace}-fast-{variant}-torch{torch.__version__}"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        path = cpp_extension.load(
            name=f"{namespace}_cpu_gemm_fast_{variant}", sources=[str(_SOURCE)], build_directory=str(folder),
            extra_cflags=[*cpu_gemm.CFLAGS, f"-DDSN_NS={namespace}", *ISA_FLAGS[variant]],
            is_python_module=False, verbose=verbose)
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"dsneuron fast GEMM kernels: building {variant} with {cxx!r} in {folder} failed: {e}") from e
    cpu_gemm._LOADED[("cpu_gemm_fast", namespace)] = variant
    return path


VARIANT = host_variant()
build(VARIANT)


def gemm(a: torch.Tensor, prepared: dict[str, torch.Tensor], fmt: str, n: int) -> torch.Tensor:
    """a fp32 [M, K] @ W.T -> fp32 [M, n], fast numerics, W prepared by cpu_gemm.prepare_weight(fmt, ...)."""
    return torch.ops.dsneuron.gemm_fast(a, prepared["w"], prepared["w_scale"], _code(fmt), n)


def gemm_acc(a: torch.Tensor, prepared: dict[str, torch.Tensor], fmt: str, n: int, init: torch.Tensor) -> torch.Tensor:
    """`gemm` with each element's block sum continued from init fp32 [M, n] (cpu_gemm.gemm_acc's use)."""
    return torch.ops.dsneuron.gemm_fast_acc(a, prepared["w"], prepared["w_scale"], _code(fmt), n, init)


def gemm_segments(a: torch.Tensor, offsets: torch.Tensor, prepared: dict[str, torch.Tensor], fmt: str,
                  n: int) -> torch.Tensor:
    """Grouped `gemm`: rows offsets[e] .. offsets[e+1]-1 of a fp32 [R, K] against expert e -> fp32 [R, n]."""
    return torch.ops.dsneuron.gemm_fast_segments(a, offsets, prepared["w"], prepared["w_scale"], _code(fmt), n)


def _code(fmt: str) -> int:
    if fmt not in FAST_FORMATS:
        raise ValueError(f"cpu_gemm_fast: fmt must be one of {FAST_FORMATS} (fp32 weights stay on gemm_panels), "
                         f"got {fmt!r}")
    return FAST_FORMATS.index(fmt)


def _check(fn: str, a, w, w_scale, fmt: int, n: int, experts: int | None = None) -> None:
    if fmt not in range(len(FAST_FORMATS)):
        raise ValueError(f"{fn}: fmt must be 0 (fp8), 1 (fp4) or 2 (bf16), got {fmt} (fp32 weights have no fast "
                         "path: gemm_panels)")
    check_args(fn, a, w, w_scale, fmt, n, experts)


register_gemm_fakes("dsneuron::gemm_fast", _check)


# ------------------------------------------------------------------------------------------ reference

def gemm_fast_ref(a: torch.Tensor, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The value the fast GEMM rounds, in float64: bf16(a) fp32 [M, K] @ W.T with W the exact
    dequantised checkpoint-format weight [N, K] (cpu_gemm.dequant_weight) -> float64 [M, N]."""
    return a.to(torch.bfloat16).double() @ dequant_weight(fmt, weight, scale).double().T


def error_bound(a: torch.Tensor, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [M, N]: a bound on |gemm_fast - gemm_fast_ref|: each of the K/32 block partials takes
    <= 32 fp32 roundings and the block sum K/32 more, so (K + K/32 + 1) * 2^-24 * sum_k |a_bf16 w|
    (flushed denormals add at most K * 2^-126 * max|scale|, far below it for the model's values)."""
    k = a.shape[1]
    mag = a.to(torch.bfloat16).double().abs() @ dequant_weight(fmt, weight, scale).double().abs().T
    return (k + k // BLOCK + 1) * 2.0**-24 * mag
