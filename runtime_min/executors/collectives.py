"""The collectives of a sharded run as ops a compiled stage can call (compiler/parallel.py Comm).

    torch.ops.dsneuron.chain_recv(zero, tag) -> fp32 like zero: rank 0's start (zero itself), or
        the sum rank r-1 passed on
    torch.ops.dsneuron.chain_pass(acc, tag)  -> fp32 like acc: sends acc to rank r+1, then every
        rank receives the last rank's sum (broadcast)
    torch.ops.dsneuron.gather_ranks(x, world) -> [world, *x.shape]: the ranks' x in rank order

over torch.distributed's default process group (gloo on the cpu target); with no group, or a world
of one, they are the identity (gather_ranks: x.unsqueeze(0)). A chain is chain_recv, the rank's own
adds (a GEMM continued from the received sum, `gemm_panels_acc`), then chain_pass: the adds of one
process, rank by rank. `tag` tells two chains of one graph apart, so that no pass merges their
calls; all ranks run the same executables, so they meet the collectives in the same order.

Registered with `torch.library.Library` (not `custom_op`), so the cpu lowering keeps them as calls
(compiler/lower.py) and AOTInductor's proxy executor calls these Python kernels at run time, as
it does for any op a loaded module registers (runtime_min/executors/executor_cpu.py imports this module).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

_spent = 0.0  # seconds this process has spent inside the collectives' torch.distributed calls


def collective_seconds() -> float:
    """Wall seconds this process has spent in the collectives' torch.distributed calls so far: the
    transfers plus the wait for the ranks before it in a chain (what sharding costs a step, beside
    the compute it divides). bench/parallel.py and Session's decode stats read it."""
    return _spent


@contextlib.contextmanager
def _timed():
    global _spent
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _spent += time.perf_counter() - t0


def _world() -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _check_fp32(fn: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32:
        raise ValueError(f"{fn}: expected a float32 tensor, got {t.dtype}")


def _chain_recv(zero: torch.Tensor, tag: int) -> torch.Tensor:
    _check_fp32("chain_recv", zero)
    rank, _ = _world()
    if rank == 0:
        return zero.clone()
    acc = torch.empty_like(zero, memory_format=torch.contiguous_format)
    with _timed():
        dist.recv(acc, rank - 1)
    return acc


def _chain_pass(acc: torch.Tensor, tag: int) -> torch.Tensor:
    _check_fp32("chain_pass", acc)
    rank, world = _world()
    out = acc.contiguous().clone()
    if world == 1:
        return out
    with _timed():
        if rank < world - 1:
            dist.send(out, rank + 1)
        dist.broadcast(out, world - 1)
    return out


def _gather_ranks(x: torch.Tensor, world: int) -> torch.Tensor:
    _, have = _world()
    if have != world:
        raise RuntimeError(f"gather_ranks: the executable was made for {world} ranks, this process group has {have}")
    if world == 1:
        return x.unsqueeze(0).clone()
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    with _timed():
        dist.all_gather(parts, x.contiguous())
    return torch.stack(parts)


_LIB = torch.library.Library("dsneuron", "FRAGMENT")  # kept: the registration lives as long as it
_LIB.define("chain_recv(Tensor zero, int tag) -> Tensor")
_LIB.define("chain_pass(Tensor acc, int tag) -> Tensor")
_LIB.define("gather_ranks(Tensor x, int world) -> Tensor")
_LIB.impl("chain_recv", _chain_recv, "CPU")
_LIB.impl("chain_pass", _chain_pass, "CPU")
_LIB.impl("gather_ranks", _gather_ranks, "CPU")


@torch.library.register_fake("dsneuron::chain_recv")
def _chain_recv_fake(zero, tag):
    _check_fp32("chain_recv", zero)
    return torch.empty_like(zero, memory_format=torch.contiguous_format)


@torch.library.register_fake("dsneuron::chain_pass")
def _chain_pass_fake(acc, tag):
    _check_fp32("chain_pass", acc)
    return torch.empty_like(acc, memory_format=torch.contiguous_format)


@torch.library.register_fake("dsneuron::gather_ranks")
def _gather_ranks_fake(x, world):
    return x.new_empty((world, *x.shape))
