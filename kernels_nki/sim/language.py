"""Stand-in for `nki.language`: the dtypes, buffers, operators and allocation calls the kernels use.

Names and signatures follow aws-neuron-sdk@81ce03a:nki/api/nki/language/__init__.py; operator
semantics follow the ALU and activation tables of nki/api/nki.api.shared.rst (arithmetic in fp32,
bitvec operators on integer bit patterns, logical right shift only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from dsneuron.kernels_nki.sim import machine
from dsneuron.kernels_nki.sim.tensor import PRIVATE_HBM, PSUM, SBUF, SHARED_HBM, NkiTensor, allocate

# ----------------------------------------------------------------------------------------- dtypes
float32 = np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)

# ---------------------------------------------------------------------------------------- buffers
sbuf, psum, private_hbm, shared_hbm = SBUF, PSUM, PRIVATE_HBM, SHARED_HBM
#: nl.hbm is an alias of private_hbm (nki.language docstring)
hbm = PRIVATE_HBM


# -------------------------------------------------------------------------------------- operators
@dataclass(frozen=True)
class Op:
    """An operator token. kind: 'arith' (fp32 binary), 'bitvec' (integer binary) or 'act' (ScalarE function)."""

    name: str
    kind: str
    fn: Callable

    def __call__(self, *args, **kwargs):
        raise machine.NkiSimError(f"nl.{self.name}(...) as a tile function is not part of the stand-in subset; "
                                  "pass it as an `op` to an nki.isa instruction")


def _cmp(f):
    return lambda a, b: f(a, b).astype(np.float32)


add = Op("add", "arith", np.add)
subtract = Op("subtract", "arith", np.subtract)
multiply = Op("multiply", "arith", np.multiply)
maximum = Op("maximum", "arith", np.maximum)
minimum = Op("minimum", "arith", np.minimum)
equal = Op("equal", "arith", _cmp(np.equal))
greater = Op("greater", "arith", _cmp(np.greater))
greater_equal = Op("greater_equal", "arith", _cmp(np.greater_equal))
less = Op("less", "arith", _cmp(np.less))
less_equal = Op("less_equal", "arith", _cmp(np.less_equal))

bitwise_and = Op("bitwise_and", "bitvec", np.bitwise_and)
bitwise_or = Op("bitwise_or", "bitvec", np.bitwise_or)
left_shift = Op("left_shift", "bitvec", np.left_shift)
right_shift = Op("right_shift", "bitvec", np.right_shift)  # logical: applied to the unsigned bit pattern

exp = Op("exp", "act", np.exp)
relu = Op("relu", "act", lambda x: np.maximum(x, np.float32(0)))
copy = Op("copy", "act", lambda x: x)


# ------------------------------------------------------------------------------------- allocation
def ndarray(shape, dtype, buffer=sbuf, name="", address=None):
    """New tensor on `buffer`, filled with the sentinel (NaN for floats, 4 for integers).

    Raises NkiSimError for a bad shape, a partition dim > 128, or an SBUF / PSUM overflow.
    """
    if address is not None:
        raise machine.NkiSimError("ndarray(address=...) is not part of the stand-in subset")
    return allocate(shape, dtype, buffer)


def load(src: NkiTensor, dtype=None) -> NkiTensor:
    """HBM -> new SBUF tile of src's shape (dim 0 becomes the partition dim), cast to `dtype` if given."""
    from dsneuron.kernels_nki.sim import isa

    if src.on_chip:
        raise machine.NkiSimError(f"nl.load: source must be in HBM, got {src!r}")
    dst = allocate(src.shape if src.ndim > 1 else (1, src.shape[0]), dtype or src.dtype, SBUF)
    isa.dma_copy(dst, src if src.ndim > 1 else src.reshape((1, src.shape[0])))
    return dst


def store(dst: NkiTensor, value: NkiTensor) -> None:
    """SBUF tile -> HBM tensor of the same element count."""
    from dsneuron.kernels_nki.sim import isa

    if dst.on_chip or value.buffer != SBUF:
        raise machine.NkiSimError(f"nl.store: needs an HBM dst and an SBUF value, got {dst!r} <- {value!r}")
    isa.dma_copy(dst, value)
