"""A NumPy stand-in for the subset of the `nki` package (nki >= 0.3) that dsneuron's kernels use; tests only.

    with installed(("dsneuron.kernels_nki.sparse_attn_nki",)) as (mod,):
        out = mod.sparse_attn_kernel(q, kv, sink, idx, 0.125)     # NumPy in, NumPy out
        mod.sparse_attn_kernel.last_stats                          # work counters of that run

`installed()` puts this package in sys.modules as `nki` (with `nki.language` and `nki.isa`), the way
aws-neuron/nki-library's test/utils/simulation_setup.py installs its CPU simulator, imports the given
kernel modules fresh against it, and restores everything on exit. Kernels run eagerly as Python, like
the official simulator (aws-neuron-sdk:nki/guides/nki_simulator.rst): new buffers hold NaN (ints: 4),
bf16/fp8 values are rounded with ml_dtypes, and each instruction checks its documented limits. Unlike
the official simulator it also checks SBUF bytes per partition and PSUM banks (see `machine`).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator

import numpy as np

from dsneuron.kernels_nki.sim import isa, language, machine
from dsneuron.kernels_nki.sim.machine import NkiSimError, Stats
from dsneuron.kernels_nki.sim.tensor import SHARED_HBM, NkiTensor, wrap_hbm

__all__ = ["NkiSimError", "Kernel", "jit", "simulate", "installed", "language", "isa"]


class Kernel:
    """A kernel under the stand-in: called with NumPy arrays and constants, returns NumPy array(s).

    Array arguments become HBM tensors; ints, floats, bools, strings, None and tuples pass through as
    compile-time constants. A list argument raises TypeError (NKI 0.3.0: use tuples). The function must
    return tensors allocated in shared_hbm (NKI 0.3.0); anything else raises NkiSimError.
    `last_stats` holds the work counters of the latest call.
    """

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.last_stats: Stats | None = None

    def __getitem__(self, grid):
        raise NkiSimError("launch grids (kernel[grid]) are not part of the stand-in subset")

    def __call__(self, *args, **kwargs):
        run = machine.Run(machine.target_from_env())
        with machine.running(run):
            targs = [_argument(a) for a in args]
            tkwargs = {k: _argument(v) for k, v in kwargs.items()}
            result = self.fn(*targs, **tkwargs)
            outputs = _outputs(result)
        self.last_stats = run.stats
        return outputs


def _argument(a):
    if isinstance(a, list):
        raise TypeError("kernel arguments cannot be lists (NKI 0.3.0); pass a tuple")
    if isinstance(a, np.ndarray):
        return wrap_hbm(a)
    if isinstance(a, tuple):
        return tuple(_argument(x) for x in a)
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise TypeError(f"unsupported kernel argument of type {type(a).__name__}")


def _outputs(result):
    if isinstance(result, tuple):
        return tuple(_outputs(r) for r in result)
    if not isinstance(result, NkiTensor) or result.buffer != SHARED_HBM:
        raise NkiSimError(f"kernel outputs must be tensors allocated with buffer=nl.shared_hbm, got {result!r}")
    return np.array(result.np())


def jit(fn=None, **kwargs):
    """`@nki.jit`: wrap a kernel function. Options (platform_target, mode) are refused as in nki >= 0.3."""
    if kwargs:
        raise TypeError(f"nki.jit takes no options in nki >= 0.3, got {sorted(kwargs)}")
    if fn is None:
        return jit
    return fn if isinstance(fn, Kernel) else Kernel(fn)


def simulate(kernel):
    """`nki.simulate(kernel)`: the callable that runs it on CPU (here: the kernel itself)."""
    return jit(kernel)


_NKI_NAMES = ("nki", "nki.language", "nki.isa")


@contextlib.contextmanager
def installed(modules: tuple[str, ...] = ()) -> Iterator[tuple]:
    """Install this stand-in as `nki`, import `modules` fresh against it, yield them; restore on exit.

    The named modules are removed from sys.modules (and from their parent package) afterwards, so
    no module keeps a reference to the stand-in outside the `with` block.
    """
    with _swapped(dict(zip(_NKI_NAMES, (sys.modules[__name__], language, isa)))):
        with fresh_imports(modules) as loaded:
            yield loaded


@contextlib.contextmanager
def fresh_imports(modules: tuple[str, ...]) -> Iterator[tuple]:
    """Import `modules` anew (against whatever `nki` is importable now) and forget them on exit."""
    saved = {name: sys.modules.pop(name, None) for name in modules}
    try:
        yield tuple(importlib.import_module(name) for name in modules)
    finally:
        for name, old in saved.items():
            sys.modules.pop(name, None)
            parent, _, child = name.rpartition(".")
            if parent in sys.modules and hasattr(sys.modules[parent], child):
                delattr(sys.modules[parent], child)
            if old is not None:
                sys.modules[name] = old
                if parent in sys.modules:
                    setattr(sys.modules[parent], child, old)


@contextlib.contextmanager
def _swapped(entries: dict):
    saved = {name: sys.modules.get(name) for name in entries}
    sys.modules.update(entries)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
