"""Stand-in for `nki.isa`: the instructions the kernels use, dst first, with the documented semantics and limits.

Signatures and rules follow the docstrings of aws-neuron-sdk@81ce03a:nki/api/nki/isa/__init__.py
(dma_copy, tensor_copy, memset, tensor_copy_predicated, nc_matmul, nc_transpose, tensor_tensor,
tensor_scalar, scalar_tensor_tensor, tensor_reduce, activation, reciprocal, iota) and the NKI 0.3.0
breaking changes of nki/migration/index.rst (no DMA from PSUM, memset value type must match the dtype).
Every engine computes in fp32 and rounds once into the destination dtype (bf16 / fp8 through
ml_dtypes, round to nearest even); matmuls accumulate in fp32 PSUM. Deliberate simplifications:
a matmul's own sum is exact before its single fp32 rounding, fp32 -> integer conversion rounds half to
even and saturates, and partition start offsets (quadrant alignment) are not checked.
"""

from __future__ import annotations

import math
from enum import Enum

import numpy as np

from dsneuron.kernels_nki.sim import machine
from dsneuron.kernels_nki.sim.language import Op, add, multiply
from dsneuron.kernels_nki.sim.machine import NkiSimError
from dsneuron.kernels_nki.sim.tensor import INT_DTYPES, PSUM, SBUF, NkiTensor, is_float


class engine(Enum):  # noqa: N801  (NKI's spelling)
    tensor = 1
    vector = 5
    scalar = 2
    gpsimd = 3
    dma = 4
    sync = 6
    unknown = 0


class reduce_cmd(Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3


class oob_mode(Enum):  # noqa: N801
    error = 0
    skip = 1


class dge_mode(Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class matmul_perf_mode(Enum):  # noqa: N801
    none = "none"
    double_row = "double_row"


#: the enums under names that the instructions' keyword parameters do not shadow
_Engine, _Reduce, _Dge = engine, reduce_cmd, dge_mode

_MATMUL_DTYPES = ("float8_e4m3", "float8_e5m2", "bfloat16", "float16", "float32")


# ----------------------------------------------------------------------------------------- helpers
def _tensor(t, what: str) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise NkiSimError(f"{what}: expected an NkiTensor, got {type(t).__name__}")
    return t


def _on_chip(t, what: str) -> NkiTensor:
    t = _tensor(t, what)
    if not t.on_chip:
        raise NkiSimError(f"{what}: must be in SBUF or PSUM, got {t!r}")
    if t.partitions > machine.PMAX:
        raise NkiSimError(f"{what}: partition dim {t.partitions} > {machine.PMAX}")
    return t


def _same_layout(a: NkiTensor, b: NkiTensor, what: str) -> None:
    if a.partitions != b.partitions or a.free_size != b.free_size:
        raise NkiSimError(f"{what}: partitions/elements per partition differ: {a.shape} vs {b.shape}")


def _rows(t: NkiTensor) -> np.ndarray:
    """[P, F] copy of a direct on-chip view, in its own dtype."""
    return np.array(t.np()).reshape(t.partitions, t.free_size)


def _f32(t: NkiTensor) -> np.ndarray:
    return _rows(t).astype(np.float32)


def _cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if is_float(dtype):
        return np.asarray(values, dtype=np.float32).astype(dtype)
    values = np.asarray(values)
    if values.dtype.kind == "f":
        info = np.iinfo(dtype)
        values = np.clip(np.nan_to_num(np.rint(values.astype(np.float64)), nan=0.0), info.min, info.max)
    return values.astype(dtype)


def _write(dst: NkiTensor, values: np.ndarray) -> None:
    arr = dst.np()
    arr[...] = _cast(values, dst.dtype).reshape(arr.shape)
    if dst.buffer == PSUM:
        dst.flags()[...] = 0


def _scalar_or_vector(x, partitions: int, what: str, integer: bool = False) -> np.ndarray:
    """A compile-time scalar or an on-chip [P, 1] tile -> an array broadcastable to [P, F]."""
    if isinstance(x, NkiTensor):
        _on_chip(x, what)
        if x.partitions != partitions or x.free_size != 1:
            raise NkiSimError(f"{what}: a vector operand must have shape ({partitions}, 1), got {x.shape}")
        return _rows(x) if integer else _f32(x)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise NkiSimError(f"{what}: expected a number or a ({partitions}, 1) tile, got {x!r}")
    if integer:
        if not isinstance(x, int):
            raise NkiSimError(f"{what}: bitvec operators take integer operands, got {x!r}")
        return np.array(x, dtype=np.int64)
    return np.float32(x)


def _bits(a: np.ndarray, width: int) -> np.ndarray:
    """Integer values -> their unsigned `width`-byte bit patterns as uint64."""
    a = np.asarray(a)
    if a.dtype.kind in "iu" and a.dtype.itemsize == width:
        return a.view(np.dtype(f"u{width}")).astype(np.uint64)
    return (a.astype(np.int64) & ((1 << (8 * width)) - 1)).astype(np.uint64)


def _apply(op: Op, a, b, reverse: bool, width: int):
    x, y = (b, a) if reverse else (a, b)
    if op.kind == "bitvec":
        x, y = _bits(x, width), _bits(y, width)
        return op.fn(x, y) & np.uint64((1 << (8 * width)) - 1)
    with np.errstate(all="ignore"):
        return op.fn(np.float32(x) if np.ndim(x) == 0 else x, np.float32(y) if np.ndim(y) == 0 else y)


def _from_bits(bits: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return bits.astype(np.dtype(f"u{dtype.itemsize}")).view(dtype)


def _count(default: engine, chosen: engine, elements: int) -> None:
    which = default if chosen == engine.unknown else chosen
    stats = machine.current().stats
    {engine.vector: stats.dve, engine.scalar: stats.act, engine.gpsimd: stats.pool}[which].add(elements)


def _no_psum_on_gpsimd(eng: engine, *tensors: NkiTensor) -> None:
    if eng == engine.gpsimd and any(isinstance(t, NkiTensor) and t.buffer == PSUM for t in tensors):
        raise NkiSimError("GpSimd Engine cannot access PSUM")


# ------------------------------------------------------------------------------------------ DMA
def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """dst = src between HBM and SBUF (either way, or SBUF to SBUF). A src view built with
    `.ap(..., vector_offset=idx, indirect_dim=0)` gathers: partition p reads from row idx[p] of the base
    tensor; an index whose row falls outside the base allocation raises, or with oob_mode.skip leaves
    that partition of dst unchanged. Different dtypes convert through fp32 (not with hwdge).
    """
    dst, src = _tensor(dst, "dma_copy dst"), _tensor(src, "dma_copy src")
    if src.buffer == PSUM:
        raise NkiSimError("dma_copy cannot read PSUM (NKI 0.3.0): copy to SBUF with tensor_copy first")
    if dst.buffer == PSUM:
        raise NkiSimError("dma_copy cannot write PSUM: DMA moves data between HBM and SBUF")
    if dst.indirect is not None:
        raise NkiSimError("dma_copy: indirect (scatter) destinations are not part of the stand-in subset")
    if dst.dtype != src.dtype and dge_mode == _Dge.hwdge:
        raise NkiSimError(f"dma_copy: hwdge needs equal dtypes, got {src.dtype} -> {dst.dtype} (use .view())")
    if src.size != dst.size:
        raise NkiSimError(f"dma_copy: {src.size} source elements vs {dst.size} destination elements")
    if src.indirect is None:
        values = np.array(src.np())
        _write(dst, values if values.dtype == dst.dtype else values.astype(np.float32))
        moved = src.size
    else:
        if dst.partitions != src.shape[0]:
            raise NkiSimError(f"dma_copy: a gather of {src.shape[0]} rows needs a dst with as many partitions, got {dst.shape}")
        values, inside = _gather(src, oob_mode)
        out = _rows(dst)
        conv = values if values.dtype == dst.dtype else _cast(values.astype(np.float32), dst.dtype)
        out[inside] = conv[inside]
        dst.np()[...] = out.reshape(dst.shape)
        moved = int(inside.sum()) * values.shape[1]
    stats = machine.current().stats
    stats.dma_transfers += 1
    if not src.on_chip:
        stats.hbm_read += moved * src.dtype.itemsize
    if not dst.on_chip:
        stats.hbm_write += moved * dst.dtype.itemsize
    if src.on_chip and dst.on_chip:
        stats.sbuf_dma += moved * dst.dtype.itemsize


def _gather(src: NkiTensor, mode: oob_mode) -> tuple[np.ndarray, np.ndarray]:
    idx = _rows(src.indirect.index).reshape(-1).astype(np.int64)
    rel = np.zeros(1, dtype=np.int64)
    for n, s in zip(src.shape[1:], src.strides[1:]):
        rel = (rel[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    starts = src.offset + idx * src.indirect.stride
    offsets = starts[:, None] + rel[None, :]
    typed = src.storage_elements()
    inside = (offsets.min(axis=1) >= 0) & (offsets.max(axis=1) < typed.size)
    if not inside.all() and mode == oob_mode.error:
        bad = int(np.flatnonzero(~inside)[0])
        raise NkiSimError(f"dma_copy: index {int(idx[bad])} of partition {bad} reads outside the source tensor "
                          f"(oob_mode.error); pass oob_mode=oob_mode.skip to drop such rows")
    values = np.zeros(offsets.shape, dtype=src.dtype)
    values[inside] = typed[offsets[inside]]
    return values, inside


# --------------------------------------------------------------------------------- data movement
def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """dst = src on chip; bit-exact for equal dtypes, else through fp32 (Vector, Scalar or GpSimd)."""
    dst, src = _on_chip(dst, "tensor_copy dst"), _on_chip(src, "tensor_copy src")
    _same_layout(dst, src, "tensor_copy")
    _no_psum_on_gpsimd(engine, dst, src)
    if engine == _Engine.scalar and machine.current().target.name == "trn1":
        raise NkiSimError("tensor_copy on the Scalar Engine is not supported on NeuronCore-v2")
    values = _rows(src)
    _write(dst, values if values.dtype == dst.dtype else values.astype(np.float32))
    _count(_Engine.vector, engine, dst.free_size)


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill dst with a constant whose Python type matches the dtype (int for integer dtypes, NKI 0.3.0)."""
    dst = _on_chip(dst, "memset dst")
    _no_psum_on_gpsimd(engine, dst)
    integer = dst.dtype in INT_DTYPES
    if isinstance(value, bool) or (integer and not isinstance(value, int)) or (not integer and not isinstance(value, float)):
        raise NkiSimError(f"memset: value {value!r} does not match dtype {dst.dtype} (NKI 0.3.0 strict type matching)")
    _write(dst, np.full((dst.partitions, dst.free_size), value))
    _count(_Engine.vector, engine, dst.free_size)


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """dst = src where predicate != 0 (== 0 with reverse_pred); src a tile of dst's dtype or a number."""
    dst, predicate = _on_chip(dst, "tensor_copy_predicated dst"), _on_chip(predicate, "predicate")
    _same_layout(dst, predicate, "tensor_copy_predicated")
    if predicate.dtype.name not in ("uint8", "uint16", "uint32"):
        raise NkiSimError(f"tensor_copy_predicated: predicate must be uint8/16/32, got {predicate.dtype}")
    if isinstance(src, NkiTensor):
        _on_chip(src, "tensor_copy_predicated src")
        _same_layout(dst, src, "tensor_copy_predicated")
        if src.dtype != dst.dtype:
            raise NkiSimError(f"tensor_copy_predicated: src dtype {src.dtype} != dst dtype {dst.dtype}")
        if src.buffer == PSUM and predicate.buffer == PSUM:
            raise NkiSimError("tensor_copy_predicated: src and predicate cannot both be in PSUM")
        values = _rows(src)
    else:
        values = np.full((dst.partitions, dst.free_size), src, dtype=np.float64)
    take = _rows(predicate) != 0
    if reverse_pred:
        take = ~take
    out = _rows(dst)
    out[take] = _cast(values, dst.dtype)[take]
    _write(dst, out)
    _count(engine.vector, engine.unknown, dst.free_size)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[p, i...] = offset + p*channel_multiplier + sum_k step_k*i_k, in int32 arithmetic (GpSimd)."""
    dst = _on_chip(dst, "iota dst")
    if dst.buffer != SBUF:
        raise NkiSimError("iota: dst must be in SBUF")
    pattern = [tuple(p) for p in pattern]
    if not 1 <= len(pattern) <= 4 or math.prod(n for _, n in pattern) != dst.free_size:
        raise NkiSimError(f"iota: pattern {pattern} does not cover the {dst.free_size} elements per partition")
    values = np.zeros(1, dtype=np.int64)
    for step, n in pattern:
        values = (values[:, None] + step * np.arange(n, dtype=np.int64)[None, :]).reshape(-1)
    p = np.arange(dst.partitions, dtype=np.int64)[:, None]
    _write(dst, (offset + p * channel_multiplier + values[None, :]).astype(np.int32))
    _count(engine.gpsimd, engine.unknown, dst.free_size)


# -------------------------------------------------------------------------------------- Tensor Engine
def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    """dst[M, N] (+)= stationary[K, M].T @ moving[K, N]: K <= 128 partitions in SBUF, M <= 128, N <= 512
    and an fp32 PSUM dst inside one 2 KiB bank (trn3: N <= 4096 over any banks). accumulate: False
    overwrites, True adds to a location a previous matmul wrote, None overwrites where no matmul has
    written since the last non-matmul write and adds elsewhere.
    """
    dst, st, mv = _tensor(dst, "nc_matmul dst"), _tensor(stationary, "stationary"), _tensor(moving, "moving")
    if is_transpose or tile_position or tile_size or perf_mode != matmul_perf_mode.none:
        raise NkiSimError("nc_matmul: transpose/tiling/perf modes are not part of the stand-in subset")
    if st.buffer != SBUF or mv.buffer != SBUF:
        raise NkiSimError(f"nc_matmul: stationary and moving must be in SBUF, got {st!r}, {mv!r}")
    if dst.buffer != PSUM:
        raise NkiSimError(f"nc_matmul: dst must be in PSUM, got {dst!r}")
    k, m, n = st.partitions, st.free_size, mv.free_size
    if mv.partitions != k or k > machine.PMAX:
        raise NkiSimError(f"nc_matmul: contraction (partition) sizes {k} and {mv.partitions} must match and be <= 128")
    if m > machine.STATIONARY_FMAX:
        raise NkiSimError(f"nc_matmul: stationary free size {m} > {machine.STATIONARY_FMAX}")
    target = machine.current().target
    if n > target.moving_fmax:
        raise NkiSimError(f"nc_matmul: moving free size {n} > {target.moving_fmax} on {target.name}")
    if dst.partitions != m or dst.free_size != n:
        raise NkiSimError(f"nc_matmul: dst shape {dst.shape} != ({m}, {n})")
    if dst.dtype != np.float32:
        raise NkiSimError(f"nc_matmul: dst must be float32 on {target.name}, got {dst.dtype}")
    names = (st.dtype.name, mv.dtype.name)
    if any(x not in _MATMUL_DTYPES for x in names):
        raise NkiSimError(f"nc_matmul: operand dtypes {names} not in {_MATMUL_DTYPES}")
    if ("float32" in names) and names != ("float32", "float32"):
        raise NkiSimError(f"nc_matmul: float32 pairs only with float32, got {names}")
    lo, hi = dst.partition_byte_span()
    # NeuronCore-v4 results may span all 8 banks (nc_matmul docstring); earlier ones stay in one
    if target.moving_fmax * 4 <= machine.PSUM_BANK_BYTES and lo // machine.PSUM_BANK_BYTES != hi // machine.PSUM_BANK_BYTES:
        raise NkiSimError(f"nc_matmul: dst bytes {lo}..{hi} of each partition cross a {machine.PSUM_BANK_BYTES}-byte PSUM bank")
    result = (_rows(st).astype(np.float64).T @ _rows(mv).astype(np.float64)).astype(np.float32)
    written = (dst.flags() != 0).reshape(m, n)
    if accumulate is None:
        add_mask = written
    elif accumulate:
        if not written.all():
            raise NkiSimError("nc_matmul: accumulate=True onto PSUM not written by a matmul is undefined behaviour")
        add_mask = written
    else:
        add_mask = np.zeros_like(written)
    with np.errstate(all="ignore"):
        out = np.where(add_mask, _f32(dst) + result, result)
    arr = dst.np()
    arr[...] = out.astype(np.float32).reshape(arr.shape)
    dst.flags()[...] = 1
    stats = machine.current().stats
    stats.pe_instructions += 1
    stats.pe_columns += n * (4 if "float32" in names else 1)
    stats.pe_flops += 2 * k * m * n


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """dst[F, P] = data[P, F] bit-exact. Tensor Engine: SBUF -> PSUM, up to [128, 128]; Vector Engine:
    on chip either way, up to [32, 32]. dst keeps data's dtype."""
    dst, data = _on_chip(dst, "nc_transpose dst"), _on_chip(data, "nc_transpose data")
    which = engine
    if which == _Engine.unknown:
        which = _Engine.tensor if data.buffer == SBUF and dst.buffer == PSUM else _Engine.vector
    p, f = data.partitions, data.free_size
    limit = 128 if which == _Engine.tensor else 32
    if p > limit or f > limit:
        raise NkiSimError(f"nc_transpose: {which.name} engine handles up to [{limit}, {limit}], got [{p}, {f}]")
    if which == _Engine.tensor and (data.buffer != SBUF or dst.buffer != PSUM):
        raise NkiSimError("nc_transpose: the Tensor Engine reads SBUF and writes PSUM")
    if dst.dtype != data.dtype:
        raise NkiSimError(f"nc_transpose: dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    if dst.partitions != f or dst.free_size != p:
        raise NkiSimError(f"nc_transpose: dst shape {dst.shape} != ({f}, {p})")
    _write(dst, _rows(data).T)
    stats = machine.current().stats
    if which == _Engine.tensor:
        stats.pe_instructions += 1
        stats.pe_columns += p * (4 if data.dtype == np.float32 else 1)
    else:
        stats.dve.add(p)


# ---------------------------------------------------------------------------------- Vector / Scalar
def _elementwise(what: str, dst, data):
    dst, data = _on_chip(dst, f"{what} dst"), _on_chip(data, f"{what} data")
    _same_layout(dst, data, what)
    return dst, data


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    """dst = (data op0 operand0) op1 operand1; operands are numbers or (P, 1) tiles. Arithmetic operators
    run in fp32; bitvec operators on integer bit patterns (Vector Engine only)."""
    dst, data = _elementwise("tensor_scalar", dst, data)
    if op1 is not None and op1.kind != op0.kind or op0.kind not in ("arith", "bitvec"):
        raise NkiSimError(f"tensor_scalar: op0 {op0.name} and op1 {op1 and op1.name} must both be arithmetic or bitvec")
    if (op1 is None) != (operand1 is None):
        raise NkiSimError("tensor_scalar: op1 and operand1 go together")
    _no_psum_on_gpsimd(engine, dst, data, operand0, operand1)
    p = data.partitions
    if op0.kind == "bitvec":
        if engine not in (_Engine.unknown, _Engine.vector):
            raise NkiSimError("tensor_scalar: bitvec operators run on the Vector Engine only")
        if data.dtype not in INT_DTYPES or dst.dtype not in INT_DTYPES:
            raise NkiSimError(f"tensor_scalar: bitvec operators need integer data and dst, got {data.dtype} -> {dst.dtype}")
        width = dst.dtype.itemsize
        out = _apply(op0, _rows(data), _scalar_or_vector(operand0, p, "operand0", True), reverse0, width)
        if op1 is not None:
            out = _apply(op1, out, _scalar_or_vector(operand1, p, "operand1", True), reverse1, width)
        _write(dst, _from_bits(out, dst.dtype))
    else:
        if engine == _Engine.scalar and (op0, op1) not in ((multiply, add), (multiply, None), (add, None)):
            raise NkiSimError("tensor_scalar on the Scalar Engine supports multiply(+add) or add only")
        for x, what in ((operand0, "operand0"), (operand1, "operand1")):
            if isinstance(x, NkiTensor) and x.dtype != np.float32:
                raise NkiSimError(f"tensor_scalar: {what} tile must be float32, got {x.dtype}")
        out = _apply(op0, _f32(data), _scalar_or_vector(operand0, p, "operand0"), reverse0, 4)
        if op1 is not None:
            out = _apply(op1, np.asarray(out, np.float32), _scalar_or_vector(operand1, p, "operand1"), reverse1, 4)
        _write(dst, out)
    _count(_Engine.vector, engine, dst.free_size)


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """dst = data1 op data2 elementwise. fp32 math, except all-int32/uint32 operands off PSUM, which the
    GpSimd Engine computes in exact integer arithmetic; bitvec operators on bit patterns."""
    dst, data1 = _elementwise("tensor_tensor", dst, data1)
    data2 = _on_chip(data2, "tensor_tensor data2")
    _same_layout(dst, data2, "tensor_tensor")
    if data1.buffer == PSUM and data2.buffer == PSUM:
        raise NkiSimError("tensor_tensor: data1 and data2 cannot both be in PSUM")
    ints = all(t.dtype.name in ("int32", "uint32") for t in (dst, data1, data2))
    on_psum = PSUM in (dst.buffer, data1.buffer, data2.buffer)
    default = _Engine.gpsimd if ints and not on_psum else _Engine.vector
    _no_psum_on_gpsimd(engine, dst, data1, data2)
    if op.kind == "bitvec":
        if not all(t.dtype in INT_DTYPES for t in (dst, data1, data2)):
            raise NkiSimError("tensor_tensor: bitvec operators need integer tiles")
        width = dst.dtype.itemsize
        _write(dst, _from_bits(_apply(op, _rows(data1), _rows(data2), False, width), dst.dtype))
    elif op.kind != "arith":
        raise NkiSimError(f"tensor_tensor: {op.name} is not a binary ALU operator")
    elif ints and (engine == _Engine.gpsimd or engine == _Engine.unknown and not on_psum):
        a, b = _rows(data1).astype(np.int64), _rows(data2).astype(np.int64)
        _write(dst, op.fn(a, b).astype(np.int64))
    else:
        _write(dst, _apply(op, _f32(data1), _f32(data2), False, 4))
    _count(default, engine, dst.free_size)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """dst = (data op0 operand0) op1 operand1 on the Vector Engine in fp32; operand0 a number or (P, 1)
    tile, operand1 a tile shaped like data; data and operand1 not both in PSUM."""
    dst, data = _elementwise("scalar_tensor_tensor", dst, data)
    operand1 = _on_chip(operand1, "scalar_tensor_tensor operand1")
    _same_layout(data, operand1, "scalar_tensor_tensor")
    if op0.kind != "arith" or op1.kind != "arith":
        raise NkiSimError("scalar_tensor_tensor: both operators must be arithmetic")
    if data.buffer == PSUM and operand1.buffer == PSUM:
        raise NkiSimError("scalar_tensor_tensor: data and operand1 cannot both be in PSUM")
    tmp = _apply(op0, _f32(data), _scalar_or_vector(operand0, data.partitions, "operand0"), reverse0, 4)
    _write(dst, _apply(op1, np.asarray(tmp, np.float32), _f32(operand1), reverse1, 4))
    _count(engine.vector, engine.unknown, dst.free_size)


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """dst = reduce(op) of data over its last free axes (axis 0 cannot be reduced), fp32 math."""
    dst, data = _on_chip(dst, "tensor_reduce dst"), _on_chip(data, "tensor_reduce data")
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if not axes or 0 in axes or sorted(axes) != list(range(data.ndim - len(axes), data.ndim)):
        raise NkiSimError(f"tensor_reduce: axis {axis} must be the last free axes of a {data.ndim}-d tile")
    if op.kind != "arith" or op.name not in ("add", "maximum", "minimum", "multiply"):
        raise NkiSimError(f"tensor_reduce: {op.name} is not a supported reduction")
    kept = math.prod(data.shape[1:data.ndim - len(axes)])
    if dst.partitions != data.partitions or dst.free_size != kept:
        raise NkiSimError(f"tensor_reduce: dst shape {dst.shape} does not match the reduced shape of {data.shape}")
    values = _f32(data).reshape(data.partitions, kept, -1)
    with np.errstate(all="ignore"):
        red = {"add": np.sum, "maximum": np.max, "minimum": np.min, "multiply": np.prod}[op.name](values, axis=-1)
    _write(dst, -red if negate else red)
    _count(engine.vector, engine.unknown, data.free_size)


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               name=None):
    """dst = op(data * scale + bias) on the Scalar Engine in fp32 (two roundings: the product, then the
    sum). scale: number or (P, 1) fp32 tile; bias: (P, 1) tile, or a number from NeuronCore-v3 on.
    reduce_cmd reset/reset_reduce zero the 128 reduce registers; reduce/reset_reduce add the fp32 row
    sums of the activated values (before the dst cast); reduce_res receives the registers."""
    dst, data = _elementwise("activation", dst, data)
    if op.kind != "act":
        raise NkiSimError(f"activation: {op.name} is not an activation function")
    p = data.partitions
    if isinstance(scale, NkiTensor) and scale.dtype != np.float32:
        raise NkiSimError(f"activation: scale tile must be float32, got {scale.dtype}")
    run = machine.current()
    if bias is not None and not isinstance(bias, NkiTensor) and not run.target.scalar_bias:
        raise NkiSimError(f"activation: a scalar bias needs NeuronCore-v3 or newer (target {run.target.name})")
    with np.errstate(all="ignore"):
        x = (_f32(data) * _scalar_or_vector(scale, p, "scale")).astype(np.float32)
        if bias is not None:
            x = (x + _scalar_or_vector(bias, p, "bias")).astype(np.float32)
        out = np.asarray(op.fn(x), dtype=np.float32)
    if reduce_op is not None and reduce_op is not add:
        raise NkiSimError("activation: reduce_op must be nl.add")
    if reduce_cmd in (_Reduce.reset, _Reduce.reset_reduce):
        run.reduce_regs[:p] = 0
    if reduce_cmd in (_Reduce.reduce, _Reduce.reset_reduce):
        if reduce_op is None:
            raise NkiSimError("activation: reduce_cmd reduce needs reduce_op=nl.add")
        run.reduce_regs[:p] += out.sum(axis=1, dtype=np.float32)
    _write(dst, out)
    if reduce_res is not None:
        reduce_res = _on_chip(reduce_res, "reduce_res")
        if reduce_res.partitions != p or reduce_res.free_size != 1:
            raise NkiSimError(f"activation: reduce_res must have shape ({p}, 1), got {reduce_res.shape}")
        _write(reduce_res, run.reduce_regs[:p].reshape(p, 1))
    run.stats.act.add(dst.free_size)


def reciprocal(dst, data, name=None):
    """dst = 1 / data in fp32 on the Vector Engine."""
    dst, data = _elementwise("reciprocal", dst, data)
    with np.errstate(all="ignore"):
        _write(dst, np.float32(1) / _f32(data))
    _count(engine.vector, engine.unknown, dst.free_size)
