"""Block-scaled GEMM kernels of the cpu target with a fixed summation order: C++ ops, layout, reference.

Importing this module builds (first use, cached) and loads kernels_nki/cpu/gemm.cpp, sparse_attn.cpp,
act_quant.cpp, rms_norm.cpp and index_scores.cpp (one extension), which register (besides the QDQ
and state ops below)

    torch.ops.dsneuron.gemm_panels(a, w, w_scale, fmt, n)                        -> fp32 [M, n]
    torch.ops.dsneuron.gemm_panels_acc(a, w, w_scale, fmt, n, init)             -> fp32 [M, n]   (sum from init)
    torch.ops.dsneuron.gemm_panels_segments(a, offsets, w, w_scale, fmt, n)     -> fp32 [R, n]
    torch.ops.dsneuron.sparse_attn_cpu(q, kv, sink, idx, scale)                 -> bf16 [B,S,H,D]  (cpu_attn.py)
    torch.ops.dsneuron.exp_cpu(x)                                               -> fp32            (cpu_attn.py)
    torch.ops.dsneuron.mean_square(xf)                                          -> fp32 [..., 1]   (rms_norm.py)
    torch.ops.dsneuron.index_scores(q, index_k, w)                              -> bf16 [B,S,T]    (cpu_index.py)

with fake implementations here, so both export (symbolic M included) and run inside AOTInductor
packages through the proxy executor (this module must be imported before such a package runs).

Contract, bit for bit: a fp32 [M, K], K a positive multiple of 32, weight W [N, K] in format fmt
(FORMATS: 0 fp8, 1 fp4, 2 bf16, 3 fp32) whose value w[n, k] is the exact fp32 dequantised weight:
fp8 = e4m3fn code [N, K] * 2^(e8m0 byte - 127) of tile [n // 32, k // 32]; fp4 = e2m1 nibble of
packed [N, K/2] (even k in the low nibble) * 2^(byte - 127) of [n, k // 32]; bf16 / fp32 values.

    partial_b = 0; for k in block b (32 k) ascending: partial_b = fma(a[m, k], w[n, k], partial_b)
    acc = 0;       for b = 0 .. K/32 - 1:            acc = acc + partial_b          (fp32, RN)
    out[m, n] = acc

The kernels vectorise across n (one SIMD lane per output column), never across k, and each output
element is computed by one thread, so a row's result does not depend on M, on the row's place in
the call, on the thread count, on alignment or on the ISA (the AVX2 and the portable build are
checked equal in tests). For the model's operands (bf16 or FP8-dequantised activations against
fp8/fp4/bf16 weights) every product is exact in fp32, so fma only matters for fp32 weights; each
add of a block's chain still rounds, unlike graphs.quant.block_scaled_matmul, whose float64 block
partials round once per block. `gemm_panels_ref` is the torch reference of exactly this contract,
on the checkpoint-format weight. The block structure is that of the V4 GEMM kernels (per-block
partial, then accumulated): reference/deepseek_v4_arch.md section 2, DeepSeek-V4-Pro:inference/
kernel.py `fp8_gemm_kernel`.

Prepared layout (`prepare_weight`, once per process at load; same bytes as the checkpoint except
the scales, decoded to fp32 powers of two): N is padded with zero rows to Np = 16 * ceil(N/16) and
cut into panels of 16 output rows; in [P, K, 16] the last axis is the lane r = row 16p + r.
    fp8   w uint8 [P, K, 16]      w_scale fp32 [P, K/32]       (a panel lies inside one 32-row tile)
    fp4   w uint8 [P, K/2, 16]    w_scale fp32 [P, K/32, 16]   (byte of lane r holds k = 2j, 2j+1)
    bf16  w bf16  [P, K, 16]      w_scale fp32 [0]
    fp32  w fp32  [P, K, 16]      w_scale fp32 [0]
`gemm_panels_segments` takes these stacked per expert, [E, ...], and offsets int64 [E+1] (rows
offsets[e] .. offsets[e+1]-1 of a use expert e; 0 = offsets[0] <= ... <= offsets[E] = R): each row
is bit-identical to `gemm_panels` of that row alone with its expert's weight. Bad arguments raise
ValueError naming the argument and the expected value, from the C++ op and the fake alike.

Build: torch.utils.cpp_extension.load (ninja, g++) against torch's stable C ABI, -O3
-ffp-contract=off (no contraction the source does not spell); "avx2" adds -mavx2 -mfma -mf16c (no
-march=native, so the binary runs on any AVX2 host: Zen, and Intel with or without AVX-512),
"generic" is portable C++ for other hosts. The op namespace, variant and torch version name the
cache folder under $XDG_CACHE_HOME (default ~/.cache)/dsneuron/cpu_gemm. A cold build takes ~10-20 s.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from dsneuron.kernels_nki.formats import dequantize_e2m1, ue8m0_to_float

FORMATS = ("fp8", "fp4", "bf16", "fp32")
#: Output rows per prepared panel: two 8-lane AVX2 vectors (one 16-lane AVX-512 vector).
PANEL = 16
#: k per block partial: the UE8M0 scale block of the V4.1 FP8 weights and FP4 experts.
BLOCK = 32

_SOURCES = [Path(__file__).parent / "cpu" / name for name in ("gemm.cpp", "sparse_attn.cpp", "act_quant.cpp",
                                                                 "rms_norm.cpp", "index_scores.cpp")]
#: -ffp-contract=off: no fusing of what the source writes as a multiply and an add; the bindings use
#: torch's stable C ABI of 2.10 (its headers compile in seconds)
CFLAGS = ["-O3", "-ffp-contract=off", "-DTORCH_TARGET_VERSION=0x020a000000000000"]
#: Per build variant; no -march=native, so a cached binary fits every host of its variant.
ISA_FLAGS = {"avx2": ["-mavx2", "-mfma", "-mf16c"], "generic": []}


#: the /proc/cpuinfo flags a variant's code needs
ISA_NEEDS = {"avx2": {"avx2", "fma", "f16c"}, "generic": set()}

#: (family, namespace) -> the variant whose library registered that family's ops there, this process
_LOADED: dict[tuple[str, str], str] = {}


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (the first "flags" line of /proc/cpuinfo), empty where there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def check_build(family: str, variant: str, namespace: str, needs: dict[str, set[str]]) -> None:
    """The checks before `family`'s build of `variant` under torch.ops.<namespace>, each a ValueError
    naming the problem: an unknown variant; a namespace that is no identifier; one that already
    holds this family's ops from another variant in this process (registering them twice aborts
    the process); a variant whose instructions the CPU lacks (its first call would die of SIGILL).
    The flags are checked where /proc/cpuinfo lists them (Linux)."""
    if variant not in needs:
        raise ValueError(f"{family}.build: variant must be one of {tuple(needs)}, got {variant!r}")
    if not namespace.isidentifier():
        raise ValueError(f"{family}.build: namespace must be a Python identifier (torch.ops.<namespace>), got {namespace!r}")
    have = _LOADED.get((family, namespace))
    if have is not None and have != variant:
        raise ValueError(f"{family}.build: torch.ops.{namespace} already holds the {have!r} variant's ops in this "
                         f"process; load {variant!r} under another namespace")
    flags = cpu_flags()
    missing = sorted(needs[variant] - flags) if flags else []
    if missing:
        raise ValueError(f"{family}.build: this CPU cannot run variant {variant!r}: /proc/cpuinfo lacks {', '.join(missing)}")


def host_variant() -> str:
    """"avx2" on x86-64 hosts whose CPU torch runs at AVX2 or AVX512 capability (these have FMA and
    F16C too), else "generic" (also when ATEN_CPU_CAPABILITY=default lowers torch's capability)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return "avx2" if x86 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "generic"


def build(variant: str, namespace: str = "dsneuron", verbose: bool = False) -> str:
    """Compile (or reuse from the cache) cpu/gemm.cpp as `variant`, registering its ops under
    torch.ops.<namespace>; returns the loaded library's path. A second namespace lets tests load
    another variant beside the one this module registers. Raises RuntimeError naming the compiler
    when it is missing or the build fails, ValueError as `check_build` (an unknown variant, a bad or
    taken namespace, a variant this CPU cannot run)."""
    check_build("cpu_gemm", variant, namespace, ISA_NEEDS)
    cxx = os.environ.get("CXX", "c++")  # the compiler torch.utils.cpp_extension invokes
    if shutil.which(cxx) is None:
        raise RuntimeError(f"dsneuron cpu GEMM kernels: C++ compiler {cxx!r} ($CXX, default c++) not found on PATH; "
                           "they are compiled on first import (install g++, e.g. apt-get install g++)")
    from torch.utils import cpp_extension

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = cache / "dsneuron" / "cpu_gemm" / f"{namespace}-{variant}-torch{torch.__version__}"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        path = cpp_extension.load(
            name=f"{namespace}_cpu_gemm_{variant}", sources=[str(s) for s in _SOURCES], build_directory=str(folder),
            extra_cflags=[*CFLAGS, f"-DDSN_NS={namespace}", *ISA_FLAGS[variant]],
            is_python_module=False, verbose=verbose)
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"dsneuron cpu GEMM kernels: building {variant} with {cxx!r} in {folder} failed: {e}") from e
    _LOADED[("cpu_gemm", namespace)] = variant
    return path


VARIANT = host_variant()
build(VARIANT)


# ------------------------------------------------------------------------------------------ layout

def _panels(x: torch.Tensor) -> torch.Tensor:
    """[..., N, C] -> [..., ceil(N/16), C, 16], zero rows appended."""
    n = x.shape[-2]
    if n % PANEL:  # pad copies: the head's 0.26 GiB would be held three times at load
        x = torch.nn.functional.pad(x, (0, 0, 0, -n % PANEL))
    return x.unflatten(-2, (-1, PANEL)).transpose(-1, -2).contiguous()


def _check_dtype(fn: str, name: str, t: torch.Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{fn}: {name} must be one of {allowed}, got {t.dtype}")


def _check_shape(fn: str, name: str, t: torch.Tensor, want: tuple) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"{fn}: {name} must have shape {want}, got {tuple(t.shape)}")


def prepare_weight(fmt: str, weight: torch.Tensor, scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint weight -> {"w", "w_scale"} in the panel layout of the module docstring.

    fmt "fp8": weight float8_e4m3fn/uint8 [..., N, K], scale float8_e8m0fnu/uint8 [..., ceil(N/32), K/32];
    "fp4": weight int8/uint8/float4_e2m1fn_x2 [..., N, K/2], scale e8m0/uint8 [..., N, K/32];
    "bf16" / "fp32": weight of that dtype [..., N, K], no scale. K % 32 == 0. A leading expert dim
    [E, ...] gives the stacked form of `gemm_panels_segments`. Plain torch ops on static shapes,
    so it also runs under torch.export on fake tensors; `prepared_specs` gives the outputs' shapes
    and dtypes without running it. Raises ValueError on a dtype or shape off the contract.
    """
    prepared_specs(fmt, weight, scale)
    if fmt in ("bf16", "fp32"):
        return {"w": _panels(weight), "w_scale": weight.new_empty(0, dtype=torch.float32)}
    s = ue8m0_to_float(scale)
    if fmt == "fp8":
        # panel p lies in scale tile p // 2
        s = s.repeat_interleave(BLOCK // PANEL, dim=-2)[..., : -(-weight.shape[-2] // PANEL), :].contiguous()
    else:
        s = _panels(s)
    return {"w": _panels(weight.view(torch.uint8)), "w_scale": s}


def prepared_specs(fmt: str, weight: Any, scale: Any | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{"w", "w_scale"}: (shape, dtype) of what `prepare_weight(fmt, weight, scale)` returns (all
    contiguous), from the .shape and .dtype of `weight` and `scale` alone (tensors, or anything
    with those two attributes): no tensor op runs, so nothing is read or dispatched. Raises
    ValueError as prepare_weight does, for the same dtypes and shapes."""
    fn = "prepare_weight"
    if fmt not in FORMATS:
        raise ValueError(f"{fn}: fmt must be one of {FORMATS}, got {fmt!r}")
    if len(weight.shape) < 2:
        raise ValueError(f"{fn}: weight must be [..., N, K], got shape {tuple(weight.shape)}")
    lead, (n, kw) = tuple(weight.shape[:-2]), tuple(weight.shape[-2:])
    k = 2 * kw if fmt == "fp4" else kw
    if k == 0 or k % BLOCK:
        raise ValueError(f"{fn}: K must be a positive multiple of {BLOCK}, got {k}")
    panels = -(-n // PANEL)
    if fmt in ("bf16", "fp32"):
        _check_dtype(fn, "weight", weight, (torch.bfloat16,) if fmt == "bf16" else (torch.float32,))
        if scale is not None:
            raise ValueError(f"{fn}: fmt {fmt!r} takes no scale")
        return {"w": ((*lead, panels, k, PANEL), weight.dtype), "w_scale": ((0,), torch.float32)}
    if scale is None:
        raise ValueError(f"{fn}: fmt {fmt!r} needs its UE8M0 scale")
    _check_dtype(fn, "scale", scale, (torch.float8_e8m0fnu, torch.uint8))
    w = ((*lead, panels, kw, PANEL), torch.uint8)
    if fmt == "fp8":
        _check_dtype(fn, "weight", weight, (torch.float8_e4m3fn, torch.uint8))
        _check_shape(fn, "scale", scale, (*lead, -(-n // BLOCK), k // BLOCK))
        return {"w": w, "w_scale": ((*lead, panels, k // BLOCK), torch.float32)}
    _check_dtype(fn, "weight", weight, (torch.int8, torch.uint8, torch.float4_e2m1fn_x2))
    _check_shape(fn, "scale", scale, (*lead, n, k // BLOCK))
    return {"w": w, "w_scale": ((*lead, panels, k // BLOCK, PANEL), torch.float32)}


# ------------------------------------------------------------------------------------------ ops

def gemm(a: torch.Tensor, prepared: dict[str, torch.Tensor], fmt: str, n: int) -> torch.Tensor:
    """a fp32 [M, K] @ W.T -> fp32 [M, n] with W prepared by `prepare_weight(fmt, ...)` of true N = n."""
    return torch.ops.dsneuron.gemm_panels(a, prepared["w"], prepared["w_scale"], FORMATS.index(fmt), n)


def gemm_acc(a: torch.Tensor, prepared: dict[str, torch.Tensor], fmt: str, n: int, init: torch.Tensor) -> torch.Tensor:
    """`gemm` with each output element's block sum continued from init fp32 [M, n] instead of 0
    (acc = init; acc = acc + partial_b for the K blocks ascending): a row-parallel shard's GEMM
    continued from the previous ranks' sum gives the unsharded GEMM bit for bit."""
    return torch.ops.dsneuron.gemm_panels_acc(a, prepared["w"], prepared["w_scale"], FORMATS.index(fmt), n, init)


def gemm_segments(a: torch.Tensor, offsets: torch.Tensor, prepared: dict[str, torch.Tensor], fmt: str,
                  n: int) -> torch.Tensor:
    """Grouped GEMM: rows offsets[e] .. offsets[e+1]-1 of a fp32 [R, K] against expert e of a stacked
    prepared weight [E, ...] -> fp32 [R, n]."""
    return torch.ops.dsneuron.gemm_panels_segments(a, offsets, prepared["w"], prepared["w_scale"],
                                                   FORMATS.index(fmt), n)


def fp8_act_dequant(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The FP8 activation of a GEMM in one op (cpu/act_quant.cpp): x bf16/fp32 [..., K] -> fp32
    [..., K] = e4m3(x / s) * s, one UE8M0 scale s per `block` contiguous elements; bit-identical
    to graphs.quant.fp8_activation on every input (NaN and inf included). Raises ValueError for
    another dtype or K % block != 0."""
    return torch.ops.dsneuron.fp8_act_dequant(x, block)


@torch.library.register_fake("dsneuron::fp8_act_dequant")
def _fp8_act_dequant_fake(x, block):
    return _act_dequant_fake("fp8_act_dequant", x, block)


#: scale formats of fp4_act_dequant, by code
FP4_SCALE_FMTS = ("ue8m0", "e4m3")


def fp4_act_dequant(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    """FP4 QDQ in one op (cpu/act_quant.cpp): x bf16/fp32 [..., K] -> fp32 [..., K] = e2m1(x / s) * s,
    one scale per `block` contiguous elements, `scale_fmt` "ue8m0" or "e4m3"; bit-identical to
    graphs.quant.fp4_act_quant_qdq before its cast to x.dtype. Raises ValueError for another dtype,
    K % block != 0 or an unknown scale_fmt."""
    if scale_fmt not in FP4_SCALE_FMTS:
        raise ValueError(f"fp4_act_dequant: scale_fmt must be one of {FP4_SCALE_FMTS}, got {scale_fmt!r}")
    return torch.ops.dsneuron.fp4_act_dequant(x, block, FP4_SCALE_FMTS.index(scale_fmt))


def _act_dequant_fake(fn: str, x: torch.Tensor, block: int) -> torch.Tensor:
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{fn}: x must be a bfloat16 or float32 tensor, got {x.dtype}")
    if x.dim() < 1 or block <= 0 or x.shape[-1] % block:
        raise ValueError(f"{fn}: K = x.size(-1) must be a multiple of block = {block}, got shape {tuple(x.shape)}")
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.register_fake("dsneuron::fp4_act_dequant")
def _fp4_act_dequant_fake(x, block, scale_fmt):
    if scale_fmt not in (0, 1):
        raise ValueError(f"fp4_act_dequant: scale_fmt must be 0 (ue8m0) or 1 (e4m3), got {scale_fmt}")
    return _act_dequant_fake("fp4_act_dequant", x, block)


def mean_square(xf: torch.Tensor) -> torch.Tensor:
    """RMSNorm's reduction in one op (cpu/rms_norm.cpp): xf fp32 [..., D] -> fp32 [..., 1], the
    golden's ATen expression (kernels_nki/rms_norm.py `mean_square`) called from C++, so bit-identical
    to it on this host. Raises ValueError for another dtype or a 0-dim xf."""
    return torch.ops.dsneuron.mean_square(xf)


@torch.library.register_fake("dsneuron::mean_square")
def _mean_square_fake(xf):
    if xf.dtype != torch.float32 or xf.dim() < 1:
        raise ValueError(f"mean_square: expected fp32 [..., D], got {xf.dtype} with {xf.dim()} dims")
    return xf.new_empty((*xf.shape[:-1], 1))


#: state formats of state_quant / state_dequant, by code: (element codes, scale bytes)
STATE_FMTS = (("e4m3", "ue8m0"), ("e2m1", "ue8m0"), ("e2m1", "e4m3"))


def state_quant(x: torch.Tensor, block: int, elem: str, scale: str) -> torch.Tensor:
    """A decode-state cache row in one op (cpu/act_quant.cpp): x bf16/fp32 [..., K] -> uint8
    [..., codes | K/block scale bytes], bit-identical to graphs.quant.quantize_state with that
    format. Raises ValueError for another dtype, K % block != 0 or an unknown format."""
    return torch.ops.dsneuron.state_quant(x, block, _state_fmt("state_quant", elem, scale))


def state_dequant(b: torch.Tensor, K: int, block: int, elem: str, scale: str) -> torch.Tensor:
    """`state_quant`'s rows uint8 [..., row bytes] -> bf16 [..., K], exact (graphs.quant.dequantize_state,
    cast to bf16, which holds every such value). Raises ValueError for a wrong row width or format."""
    return torch.ops.dsneuron.state_dequant(b, K, block, _state_fmt("state_dequant", elem, scale))


def _state_fmt(fn: str, elem: str, scale: str) -> int:
    if (elem, scale) not in STATE_FMTS:
        raise ValueError(f"{fn}: (elem, scale) must be one of {STATE_FMTS}, got {(elem, scale)!r}")
    return STATE_FMTS.index((elem, scale))


def _state_row(fn: str, K: int, block: int, fmt: int) -> int:
    if fmt not in range(len(STATE_FMTS)):
        raise ValueError(f"{fn}: fmt must be 0, 1 or 2 {STATE_FMTS}, got {fmt}")
    if block <= 0 or K <= 0 or K % block or (fmt and block % 2):
        raise ValueError(f"{fn}: K must be a positive multiple of block (an even block for e2m1), got K = {K}, "
                         f"block = {block}")
    return (K if fmt == 0 else K // 2) + K // block


@torch.library.register_fake("dsneuron::state_quant")
def _state_quant_fake(x, block, fmt):
    _act_dequant_fake("state_quant", x, block)
    return x.new_empty((*x.shape[:-1], _state_row("state_quant", x.shape[-1], block, fmt)), dtype=torch.uint8)


@torch.library.register_fake("dsneuron::state_dequant")
def _state_dequant_fake(b, K, block, fmt):
    row = _state_row("state_dequant", K, block, fmt)
    if b.dtype != torch.uint8 or b.dim() < 1 or b.shape[-1] != row:
        raise ValueError(f"state_dequant: b's last dimension must be {row} bytes for K = {K}, got {b.dtype} "
                         f"{tuple(b.shape)}")
    return b.new_empty((*b.shape[:-1], K), dtype=torch.bfloat16)


def check_args(fn: str, a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, fmt: int, n: int,
               experts: int | None = None) -> None:
    """The C++ argument checks, on fake tensors too (experts: E of the stacked form, else None).
    Raises ValueError naming the argument and the expected value."""
    if a.dim() != 2 or a.dtype != torch.float32:
        raise ValueError(f"{fn}: a must be a Float tensor [M, K], got {a.dtype} {tuple(a.shape)}")
    k = a.shape[1]
    if k == 0 or k % BLOCK:
        raise ValueError(f"{fn}: K = a.size(1) must be a positive multiple of {BLOCK}, got {k}")
    if fmt not in range(len(FORMATS)):
        raise ValueError(f"{fn}: fmt must be 0 (fp8), 1 (fp4), 2 (bf16) or 3 (fp32), got {fmt}")
    lead = () if experts is None else (experts,)
    dtype = {2: torch.bfloat16, 3: torch.float32}.get(fmt, torch.uint8)
    kw = k // 2 if fmt == 1 else k
    if w.dtype != dtype or w.dim() != 3 + len(lead) or tuple(w.shape[:len(lead)]) != lead or \
            tuple(w.shape[len(lead) + 1:]) != (kw, PANEL) or not w.is_contiguous():
        raise ValueError(f"{fn}: w must be a contiguous {dtype} tensor [{'E, ' if lead else ''}P, {kw}, 16] for fmt "
                         f"{fmt} ({FORMATS[fmt]}), got {w.dtype} {tuple(w.shape)}")
    p = w.shape[len(lead)]
    if fmt in (0, 1):
        want = (*lead, p, k // BLOCK) + ((PANEL,) if fmt == 1 else ())
        if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != want or not w_scale.is_contiguous():
            raise ValueError(f"{fn}: w_scale must be a contiguous fp32 tensor {want} for fmt {fmt} ({FORMATS[fmt]}), "
                             f"got {w_scale.dtype} {tuple(w_scale.shape)}")
    elif w_scale.numel() != 0:
        raise ValueError(f"{fn}: w_scale must be empty for fmt {fmt} ({FORMATS[fmt]}), got {tuple(w_scale.shape)}")
    if not (n == 0 if p == 0 else PANEL * (p - 1) < n <= PANEL * p):
        raise ValueError(f"{fn}: n must be in (16*(P-1), 16*P] = ({PANEL * (p - 1)}, {PANEL * p}] for w with "
                         f"P = {p} panels, got {n}")


def register_gemm_fakes(plain: str, check: Callable[..., None]) -> None:
    """Fake (meta) implementations of one GEMM op family, `plain` ("ns::op"), `plain`_acc and
    `plain`_segments (gemm.cpp's and gemm_fast.cpp's three ops share their signatures): each runs
    check(fn, a, w, w_scale, fmt, n, experts=None) (`check_args` or the fast family's), the acc
    op's init check and the segments op's offsets check, then returns fp32 [rows of a, n]."""
    name = plain.split("::")[-1]

    @torch.library.register_fake(plain)
    def _plain_fake(a, w, w_scale, fmt, n):
        check(name, a, w, w_scale, fmt, n)
        return a.new_empty((a.shape[0], n))

    @torch.library.register_fake(f"{plain}_acc")
    def _acc_fake(a, w, w_scale, fmt, n, init):
        check(f"{name}_acc", a, w, w_scale, fmt, n)
        if init.dim() != 2 or init.dtype != torch.float32 or tuple(init.shape) != (a.shape[0], n):
            raise ValueError(f"{name}_acc: init must be a Float tensor [M, n] = [{a.shape[0]}, {n}], got "
                             f"{init.dtype} {tuple(init.shape)}")
        return a.new_empty((a.shape[0], n))

    @torch.library.register_fake(f"{plain}_segments")
    def _segments_fake(a, offsets, w, w_scale, fmt, n):
        if offsets.dim() != 1 or offsets.dtype != torch.int64 or offsets.numel() < 1:
            raise ValueError(f"{name}_segments: offsets must be a Long tensor [E+1], got {offsets.dtype} "
                             f"{tuple(offsets.shape)}")
        check(f"{name}_segments", a, w, w_scale, fmt, n, experts=offsets.shape[0] - 1)
        return a.new_empty((a.shape[0], n))


register_gemm_fakes("dsneuron::gemm_panels", check_args)


# ------------------------------------------------------------------------------------------ reference

def dequant_weight(fmt: str, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Checkpoint weight [N, K] (fp4: packed [N, K/2]) -> its exact fp32 values [N, K] (kernels_nki
    codecs; equal to graphs.quant.dequant_fp8_weight / dequant_fp4_weight)."""
    if fmt == "fp8":
        n, k = weight.shape
        s = ue8m0_to_float(scale).repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
        return weight.view(torch.float8_e4m3fn).float() * s
    if fmt == "fp4":
        return dequantize_e2m1(weight, scale)
    return weight.float()


def fma32(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """fp32 fma(x, y, z), one rounding, for finite fp32 operands (broadcasting).

    x*y is exact in float64 (24 + 24 bits). The float64 sum s = x*y + z is rounded to odd: TwoSum
    gives its exact error e, and where e != 0 and s has an even last bit, s steps one ulp towards e.
    A round-to-odd result with >= 2 extra bits rounds to fp32 as the exact value would (Boldo and
    Melquiond, "Emulation of FMA and correctly rounded sums", IEEE TC 2008), so s.float() is the fma.
    """
    p, zd = x.double() * y.double(), z.double()
    s = p + zd
    bb = s - p
    e = (p - (s - bb)) + (zd - bb)
    even = (s.view(torch.int64) & 1) == 0
    s = torch.where((e != 0) & even, torch.nextafter(s, torch.where(e > 0, torch.inf, -torch.inf).double()), s)
    return s.float()


def gemm_panels_ref(a: torch.Tensor, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of the contract on the checkpoint-format weight: a fp32 [M, K] -> fp32 [M, N].

    The 32-step fma chains of all blocks run side by side ([K/32, M, N] at a time, each element its own
    sequential chain), then acc = acc + partial_b in ascending b. Any speed; for tests.
    """
    w = dequant_weight(fmt, weight, scale)
    (m, k), n = a.shape, w.shape[0]
    kb = k // BLOCK
    ab = a.reshape(m, kb, BLOCK).permute(1, 0, 2)  # [KB, M, 32]
    wb = w.reshape(n, kb, BLOCK).permute(1, 2, 0)  # [KB, 32, N]
    part = a.new_zeros(kb, m, n)
    for j in range(BLOCK):
        part = fma32(ab[:, :, j, None], wb[:, None, j, :], part)
    acc = a.new_zeros(m, n)
    for b in range(kb):
        acc = acc + part[b]
    return acc
