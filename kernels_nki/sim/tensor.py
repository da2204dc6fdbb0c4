"""NkiTensor of the stand-in: a typed, strided view of one byte buffer in HBM, SBUF or PSUM.

Views follow nki.language.NkiTensor (aws-neuron-sdk@81ce03a:nki/api/nki/language/__init__.py): integer
indexing keeps the partition dimension of an on-chip tensor, `reshape` needs a compatible layout,
`view(dtype)` reinterprets the last dimension, and `ap(pattern, offset, vector_offset, indirect_dim)`
overrides the access pattern, with per-partition indirection measured in units of the base tensor's
row size (nki/migration/index.rst, "Vector dynamic access").
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from dsneuron.kernels_nki.sim.machine import PMAX, NkiSimError, current

SBUF, PSUM, PRIVATE_HBM, SHARED_HBM = "sbuf", "psum", "private_hbm", "shared_hbm"
ON_CHIP = (SBUF, PSUM)

#: Sentinel fill of new allocations (nki/guides/nki_simulator.rst): NaN for floats, 4 for integers.
INT_FILL = 4

FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3,
                                           ml_dtypes.float8_e5m2))
INT_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32))


def is_float(dtype: np.dtype) -> bool:
    return np.dtype(dtype) in FLOAT_DTYPES


class _Storage:
    """One allocation: bytes plus, for PSUM, a per-byte flag 'last written by a matmul'."""

    def __init__(self, buffer: str, nbytes: int, partitions: int = 1, partition_bytes: int = 0):
        self.buffer = buffer
        self.partitions = partitions
        self.data = np.empty(nbytes, dtype=np.uint8)
        self.mm_flags = np.zeros(nbytes, dtype=np.uint8) if buffer == PSUM else None
        if buffer in ON_CHIP:
            run = current()
            banks = run.reserve(buffer, partition_bytes)
            weakref.finalize(self, run.release, buffer, partition_bytes, banks)


@dataclass(frozen=True)
class Indirect:
    """Per-partition indirection of an HBM view: partition p starts at `idx[p] * stride` elements."""

    index: NkiTensor
    stride: int


class NkiTensor:
    """A view: `shape`, element `strides` and `offset` (in elements of `dtype`) over a _Storage."""

    def __init__(self, storage: _Storage, dtype, shape, strides, offset: int, indirect: Indirect | None = None):
        self._storage = storage
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(int(s) for s in strides)
        self.offset = int(offset)
        self.indirect = indirect

    # ------------------------------------------------------------------ properties
    @property
    def buffer(self) -> str:
        return self._storage.buffer

    def storage_elements(self) -> np.ndarray:
        """The whole storage under this view as a flat array of `dtype` (an indirect DMA's bounds)."""
        return self._storage.data.view(self.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def on_chip(self) -> bool:
        return self.buffer in ON_CHIP

    @property
    def partitions(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def free_size(self) -> int:
        """Elements per partition (all dims after the first)."""
        return math.prod(self.shape[1:])

    def __repr__(self) -> str:
        return f"NkiTensor({self.buffer}, {self.dtype.name}, {self.shape})"

    # ------------------------------------------------------------------ numpy access
    def np(self) -> np.ndarray:
        """Writable NumPy view of this (direct) view's elements."""
        if self.indirect is not None:
            raise NkiSimError(f"{self!r}: an indirect view can only be a dma_copy operand")
        item = self.dtype.itemsize
        if self.size == 0:
            return np.empty(self.shape, dtype=self.dtype)
        lo = self.offset + sum(min(0, s * (n - 1)) for s, n in zip(self.strides, self.shape))
        hi = self.offset + sum(max(0, s * (n - 1)) for s, n in zip(self.strides, self.shape))
        if lo < 0 or (hi + 1) * item > self._storage.data.size:
            raise NkiSimError(f"{self!r}: view outside its allocation (elements {lo}..{hi})")
        return np.ndarray(self.shape, dtype=self.dtype, buffer=self._storage.data, offset=self.offset * item,
                          strides=tuple(s * item for s in self.strides))

    def flags(self) -> np.ndarray:
        """PSUM only: the matmul-written flags of this view's elements (one unsigned int per element)."""
        item = self.dtype.itemsize
        return np.ndarray(self.shape, dtype=np.dtype(f"u{item}"), buffer=self._storage.mm_flags,
                          offset=self.offset * item, strides=tuple(s * item for s in self.strides))

    def partition_byte_span(self) -> tuple[int, int]:
        """[first, last] byte offset touched within a partition row (on-chip row-major storage)."""
        row = self._storage.data.size // self._storage.partitions
        item = self.dtype.itemsize
        start = (self.offset * item) % row
        lo = start + sum(min(0, s * (n - 1)) * item for s, n in zip(self.strides[1:], self.shape[1:]))
        hi = start + sum(max(0, s * (n - 1)) * item for s, n in zip(self.strides[1:], self.shape[1:])) + item - 1
        return lo, hi

    # ------------------------------------------------------------------ views
    def _derive(self, shape, strides, offset, dtype=None, indirect=None) -> NkiTensor:
        return NkiTensor(self._storage, self.dtype if dtype is None else dtype, shape, strides, offset, indirect)

    def __getitem__(self, key) -> NkiTensor:
        if self.indirect is not None:
            raise NkiSimError(f"{self!r}: an indirect view cannot be sliced")
        key = key if isinstance(key, tuple) else (key,)
        if Ellipsis in key:
            i = key.index(Ellipsis)
            key = key[:i] + (slice(None),) * (self.ndim - len(key) + 1) + key[i + 1:]
        if len(key) > self.ndim:
            raise NkiSimError(f"{self!r}: {len(key)} indices for {self.ndim} dims")
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, offset = [], [], self.offset
        for dim, (k, n, s) in enumerate(zip(key, self.shape, self.strides)):
            if isinstance(k, slice):
                start, stop, step = k.indices(n)
                count = len(range(start, stop, step))
                if step < 1 or count == 0 or k.stop is not None and k.stop > n:
                    raise NkiSimError(f"{self!r}: slice {k} of dim {dim} (size {n}) is empty or out of range")
                shape.append(count)
                strides.append(s * step)
                offset += start * s
            else:
                idx = int(k)
                if not -n <= idx < n:
                    raise NkiSimError(f"{self!r}: index {idx} out of range for dim {dim} (size {n})")
                offset += (idx % n) * s
                if dim == 0 and self.on_chip:  # the partition dim survives integer indexing
                    shape.append(1)
                    strides.append(s)
        return self._derive(shape, strides, offset)

    def is_contiguous(self) -> bool:
        dims = [(n, s) for n, s in zip(self.shape, self.strides)]
        if self.on_chip:
            dims = dims[1:]
        expect = 1
        for n, s in reversed(dims):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True

    def reshape(self, shape) -> NkiTensor:
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) != self.size:
            raise NkiSimError(f"{self!r}: cannot reshape {self.size} elements to {shape}")
        if self.on_chip:
            if shape[0] != self.shape[0]:
                raise NkiSimError(f"{self!r}: reshape must keep the partition dim, got {shape}")
            if not self.is_contiguous():
                raise NkiSimError(f"{self!r}: reshape of a non-contiguous view")
            free = [1] * len(shape)
            for i in range(len(shape) - 2, 0, -1):
                free[i] = free[i + 1] * shape[i + 1]
            return self._derive(shape, (self.strides[0], *free[1:]), self.offset)
        if not self.is_contiguous():
            raise NkiSimError(f"{self!r}: reshape of a non-contiguous view")
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        return self._derive(shape, strides, self.offset)

    def view(self, dtype) -> NkiTensor:
        dtype = np.dtype(dtype)
        old, new = self.dtype.itemsize, dtype.itemsize
        if self.strides[-1] != 1:
            raise NkiSimError(f"{self!r}: view(dtype) needs a contiguous last dimension")
        if (self.shape[-1] * old) % new or (self.offset * old) % new or any((s * old) % new for s in self.strides[:-1]):
            raise NkiSimError(f"{self!r}: cannot reinterpret as {dtype.name}")
        shape = (*self.shape[:-1], self.shape[-1] * old // new)
        strides = (*(s * old // new for s in self.strides[:-1]), 1)
        return self._derive(shape, strides, self.offset * old // new, dtype)

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None) -> NkiTensor:
        """Explicit access pattern [[stride, count], ...] (elements); see the module docstring."""
        if scalar_offset is not None:
            raise NkiSimError("ap(scalar_offset=...) is not part of the stand-in subset")
        pattern = [tuple(p) for p in pattern]
        if any(len(p) != 2 or p[1] < 1 for p in pattern):
            raise NkiSimError(f"ap: pattern must be [[stride, count>=1], ...], got {pattern}")
        base = self.offset + (0 if offset is None else int(offset))
        view = self._derive([c for _, c in pattern], [s for s, _ in pattern], base, dtype)
        if vector_offset is None:
            return view
        if self.on_chip:
            raise NkiSimError(f"{self!r}: vector_offset indirection needs an HBM tensor")
        if indirect_dim != 0:
            raise NkiSimError("ap: only indirect_dim=0 is supported with vector_offset (nki/migration 'Vector dynamic access')")
        if not vector_offset.on_chip or vector_offset.buffer != SBUF or vector_offset.free_size != 1:
            raise NkiSimError(f"ap: vector_offset must be an SBUF tensor of shape (P, 1), got {vector_offset!r}")
        if vector_offset.partitions != pattern[0][1]:
            raise NkiSimError(f"ap: vector_offset has {vector_offset.partitions} partitions, pattern {pattern[0][1]}")
        return NkiTensor(self._storage, view.dtype, view.shape, view.strides, view.offset,
                         Indirect(vector_offset, math.prod(self.shape[1:])))


def allocate(shape, dtype, buffer: str, fill: str = "sentinel") -> NkiTensor:
    """A new tensor (row-major). On-chip: shape[0] is the partition dim, <= 128, and the bytes count
    against the run's SBUF / PSUM budget. fill: 'sentinel' (NaN / 4) or 'zero'."""
    if not isinstance(shape, (tuple, list)) or not shape or any(int(s) != s or s < 1 for s in shape):
        raise NkiSimError(f"ndarray: shape must be a tuple of positive ints, got {shape!r}")
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    if dtype not in FLOAT_DTYPES + INT_DTYPES:
        raise NkiSimError(f"ndarray: dtype {dtype} is not an NKI dtype of the stand-in")
    partition_bytes = math.prod(shape[1:]) * dtype.itemsize
    if buffer in ON_CHIP and shape[0] > PMAX:
        raise NkiSimError(f"ndarray: partition dim {shape[0]} > pmax {PMAX} for {buffer} tensor {shape}")
    storage = _Storage(buffer, math.prod(shape) * dtype.itemsize, shape[0] if buffer in ON_CHIP else 1,
                       partition_bytes)
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    t = NkiTensor(storage, dtype, shape, strides, 0)
    arr = t.np()
    if fill == "zero":
        arr[...] = 0
    elif is_float(dtype):
        arr[...] = np.nan
    else:
        arr[...] = INT_FILL
    return t


def wrap_hbm(array: np.ndarray, buffer: str = SHARED_HBM) -> NkiTensor:
    """An HBM tensor over a copy of a NumPy array (a kernel input)."""
    array = np.ascontiguousarray(array)
    if array.dtype not in FLOAT_DTYPES + INT_DTYPES:
        raise NkiSimError(f"kernel input dtype {array.dtype} is not an NKI dtype of the stand-in")
    storage = _Storage(buffer, array.nbytes)
    storage.data[...] = array.reshape(-1).view(np.uint8)
    strides = [1] * array.ndim
    for i in range(array.ndim - 2, -1, -1):
        strides[i] = strides[i + 1] * array.shape[i + 1]
    return NkiTensor(storage, array.dtype, array.shape, strides, 0)
