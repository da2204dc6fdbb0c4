"""Weights that are not held in memory: stand-ins for tracing, byte sources for streaming writes.

A compile traces its graphs on weights it never computes with, and writes the bundle's weights
file once; neither needs the whole model resident (compiler/model_steps.py):

- `placeholder(shape, dtype)`: a tensor of zeros over an anonymous private memory map that is
  never written, so none of its pages becomes resident (reading one maps the kernel's shared zero
  page); it has its own storage, as the compiler binds weights to graph inputs by storage.
- a *weight source* gives the bytes a weights file stores for one tensor, in chunks, and holds
  them only while they are written: `Computed` (a tensor made on demand, e.g. a dequantisation),
  `graphs.checkpoint.FileRegion` (bytes as they lie in a checkpoint shard, read with pread).
  Protocol: attributes `shape` (tuple of ints) and `dtype` (torch dtype) of the stored tensor,
  and `chunks(size) -> Iterator[buffer]` yielding its bytes (row-major, little-endian) in pieces
  of at most `size` bytes.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

#: bytes per piece of a streamed write: large enough for full-speed IO, small next to a layer
CHUNK_BYTES = 16 * 2**20


def placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of `shape` and `dtype` reading as zeros, backed by memory that stays
    unallocated unless written (module docstring). Not for computing with: its values are zeros,
    not the weight it stands in for."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def tensor_chunks(t: torch.Tensor, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """The bytes of contiguous CPU tensor `t` as memoryviews of at most `size` bytes (no copy)."""
    if t.numel() == 0:
        return
    flat = t.detach().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(flat)
    for at in range(0, len(view), size):
        yield view[at: at + size]


@dataclass(frozen=True)
class Computed:
    """A weight source whose tensor `make()` builds when it is written, and drops after.

    name: for messages; shape, dtype: what make() must return (checked, ValueError otherwise)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    def chunks(self, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
        t = self.make()
        if tuple(t.shape) != tuple(self.shape) or t.dtype != self.dtype:
            raise ValueError(f"{self.name}: made {t.dtype} {tuple(t.shape)}, expected {self.dtype} {tuple(self.shape)}")
        yield from tensor_chunks(t.contiguous(), size)
