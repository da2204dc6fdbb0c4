"""The host's measured limits, which the planner's roofline (compiler/plan.py) and the benchmarks
(bench/) read: streaming read bandwidth (a 1 GiB fp32 tensor sum) and the peak fp32 FMA rate.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from dsneuron.kernels_nki import cpu_gemm


def timed(fn, runs: int, min_ms: float) -> float:
    """Median ms of one call over `runs` samples; a sample repeats fn until it lasts min_ms."""
    fn()
    t0 = time.perf_counter()
    fn()
    reps = max(1, int(min_ms / 1e3 / max(time.perf_counter() - t0, 1e-9)))
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(samples)


def stream_gbs(runs: int) -> float:
    """Read bandwidth in GB/s of a 1 GiB fp32 tensor sum."""
    x = torch.ones(1 << 28)
    return x.numel() * 4 / timed(x.sum, runs, 0) / 1e6


def peak_gflops(runs: int) -> float:
    """Peak fp32 FMA rate in GFLOP/s of all threads: cpu/fma_peak.cpp, 12 independent chains per thread."""
    from torch.utils import cpp_extension

    src = Path(cpu_gemm.__file__).parent / "cpu" / "fma_peak.cpp"
    cpp_extension.load(name=f"dsneuron_bench_fma_{cpu_gemm.VARIANT}", sources=[str(src)], is_python_module=False,
                       extra_cflags=[*cpu_gemm.CFLAGS, *cpu_gemm.ISA_FLAGS[cpu_gemm.VARIANT]])
    iters = 1 << 24
    ms = timed(lambda: torch.ops.dsneuron_bench.fma_peak(iters), runs, 0)
    return torch.get_num_threads() * iters * 12 * 8 * 2 / ms / 1e6
