"""The stand-in's machine model: per-target limits, on-chip memory accounting, and work counters.

Limits follow the Neuron docs (aws-neuron/aws-neuron-sdk@81ce03a):
  - SBUF 128 partitions of 192 KiB (trn1/inf2), 224 KiB (trn2), 256 KiB (trn3):
    nki/guides/architecture/trainium_inferentia2_arch.rst, trainium2_arch.rst ("128 partitions of 224KiB"),
    trainium3_arch.rst;
  - PSUM 16 KiB per partition in 8 banks of 2 KiB, a matmul result within one bank:
    nki/migration/index.rst and the nc_matmul docstring in nki/api/nki/isa/__init__.py;
  - matmul stationary free <= 128, moving free <= 512 (NeuronCore-v2/v3) or 4096 fp32 results (v4):
    nc_matmul docstring.
The official simulator does not model SBUF/PSUM capacity (nki/guides/nki_simulator.rst, "Simulation
Limitations"); this stand-in does, by counting the bytes of live allocations: an allocation is freed
when its last view is dropped, so a tile allocated inside a loop body costs at most two copies at once.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import numpy as np

from dsneuron.kernels_nki.roofline import Work

PMAX = 128
STATIONARY_FMAX = 128
PSUM_BANK_BYTES = 2048
PSUM_BANKS = 8
#: Elements of a reduce register file: one fp32 register per ScalarE lane (activation docstring).
REDUCE_REGS = 128


class NkiSimError(Exception):
    """A kernel broke a documented hardware or API rule; the message names the rule and the values."""


@dataclass(frozen=True)
class Target:
    """Per-generation limits. `name` is the Neuron target (trn1 = NeuronCore-v2, trn2 = v3, trn3 = v4)."""

    name: str
    sbuf_partition_bytes: int
    moving_fmax: int
    #: activation `bias` may be a scalar from NeuronCore-v3 on (activation docstring)
    scalar_bias: bool


TARGETS = {
    "trn1": Target("trn1", 192 * 1024, 512, False),
    "trn2": Target("trn2", 224 * 1024, 512, True),
    "trn3": Target("trn3", 256 * 1024, 4096, True),
}
_ALIASES = {"inf2": "trn1", "gen2": "trn1", "gen3": "trn2", "gen4": "trn3"}


def target_from_env() -> Target:
    """The target named by NEURON_PLATFORM_TARGET_OVERRIDE (the official simulator's switch); trn2 when unset.

    Raises NkiSimError for a name the docs do not list.
    """
    name = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2").strip().lower()
    name = _ALIASES.get(name, name)
    if name not in TARGETS:
        raise NkiSimError(f"NEURON_PLATFORM_TARGET_OVERRIDE={name!r}: expected one of trn1|inf2|gen2, trn2|gen3, trn3|gen4")
    return TARGETS[name]


@dataclass
class Stats(Work):
    """Work of one kernel run, in the units of `dsneuron.kernels_nki.roofline` (whose `Work` it
    extends with what only a run shows).

    pe_columns: moving-tensor columns streamed through the PE array (x4 for fp32 operands, which take
    four passes); transposes count their input partitions as columns. pe_flops: 2*K*M*N of the matmuls
    only. act/dve/pool: ScalarE, VectorE, GpSimd instructions and per-partition output elements.
    hbm_read/hbm_write: DMA bytes from and to HBM; sbuf_dma: SBUF-to-SBUF DMA bytes.
    """

    sbuf_dma: int = 0
    peak_sbuf_partition_bytes: int = 0
    peak_psum_banks: int = 0


class Run:
    """State of one kernel execution: target, live on-chip bytes, reduce registers, counters."""

    def __init__(self, target: Target):
        self.target = target
        self.sbuf_bytes = 0
        self.psum_banks = 0
        self.reduce_regs = np.zeros(REDUCE_REGS, dtype=np.float32)
        self.stats = Stats()

    def reserve(self, buffer: str, partition_bytes: int) -> int:
        """Account a new on-chip allocation; returns the PSUM banks taken (0 for SBUF).

        Raises NkiSimError when the live total would exceed the target's SBUF bytes per partition
        or the 8 PSUM banks.
        """
        if buffer == "sbuf":
            if self.sbuf_bytes + partition_bytes > self.target.sbuf_partition_bytes:
                raise NkiSimError(
                    f"SBUF overflow on {self.target.name}: {self.sbuf_bytes} live + {partition_bytes} new bytes per "
                    f"partition > {self.target.sbuf_partition_bytes}"
                )
            self.sbuf_bytes += partition_bytes
            self.stats.peak_sbuf_partition_bytes = max(self.stats.peak_sbuf_partition_bytes, self.sbuf_bytes)
            return 0
        banks = -(-partition_bytes // PSUM_BANK_BYTES)
        if self.psum_banks + banks > PSUM_BANKS:
            raise NkiSimError(
                f"PSUM overflow: {self.psum_banks} banks live + {banks} new > {PSUM_BANKS} banks of "
                f"{PSUM_BANK_BYTES} bytes per partition"
            )
        self.psum_banks += banks
        self.stats.peak_psum_banks = max(self.stats.peak_psum_banks, self.psum_banks)
        return banks

    def release(self, buffer: str, partition_bytes: int, banks: int) -> None:
        if buffer == "sbuf":
            self.sbuf_bytes -= partition_bytes
        else:
            self.psum_banks -= banks


_ACTIVE: list[Run] = []


def current() -> Run:
    """The run of the kernel being executed. Raises NkiSimError outside a kernel call."""
    if not _ACTIVE:
        raise NkiSimError("nki.language / nki.isa calls are only valid inside a kernel launched through nki.jit")
    return _ACTIVE[-1]


@contextlib.contextmanager
def running(run: Run):
    _ACTIVE.append(run)
    try:
        yield run
    finally:
        _ACTIVE.pop()
