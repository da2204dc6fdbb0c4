"""Benchmark: the fixed-order cpu GEMM kernels (`cpu_gemm`) against MKL, at the tiny model's shapes.

    python -m dsneuron.bench.cpu_gemm [--runs 5] [--threads N] [--ms 20] [--only fp8,fp4,...]

Side by side in one run, per weight (N x K) and row count M: `gemm` on the prepared weight, torch's
fp32 F.linear (MKL) on the weight dequantised ahead of time, and dequantise-then-F.linear from the
checkpoint format each call. Reported: median ms over --runs samples (each sample repeats the call
until it lasts --ms), GFLOP/s (2MNK / time), effective weight GB/s (checkpoint-format bytes / time)
and the ratios MKL / ours. The machine's limits come first: streaming read bandwidth (a 1 GiB
tensor sum) and peak fp32 FMA rate (cpu/fma_peak.cpp, 12 independent chains per thread), so that
prefill figures read as a fraction of the FMA peak and decode figures as a fraction of the bandwidth.
Weights up to a few MB stay in the 32 MB L3 across calls, so their decode GB/s can exceed DRAM's.
"""

from __future__ import annotations

import argparse

import torch

from dsneuron.graphs.quant import dequant_fp4_weight, dequant_fp8_weight, quantize_fp4_weight, quantize_fp8_weight
from dsneuron.kernels_nki import cpu_gemm
from dsneuron.kernels_nki.host_limits import peak_gflops, stream_gbs, timed

#: (format, N, K) of the tiny model (dim 1024): FP8 linears, FP4 experts, the bf16 head, the fp32 mHC.
SHAPES = [("fp8", 256, 1024), ("fp8", 4096, 256), ("fp8", 512, 1024), ("fp8", 1024, 1024),
          ("fp4", 512, 1024), ("fp4", 1024, 512), ("bf16", 129280, 1024), ("fp32", 24, 4096)]
ROWS = (1, 4, 11, 172, 715)


def checkpoint(fmt: str, n: int, k: int):
    """Random checkpoint-format weight, its byte count, and a function dequantising it to fp32."""
    w = torch.randn(n, k) * 0.05
    if fmt == "fp8":
        q, s = quantize_fp8_weight(w)
        return (q, s), q.numel() + s.numel(), lambda: dequant_fp8_weight(q, s)
    if fmt == "fp4":
        q, s = quantize_fp4_weight(w)
        return (q, s), q.numel() + s.numel(), lambda: dequant_fp4_weight(q, s)
    w = w.to(torch.bfloat16 if fmt == "bf16" else torch.float32)
    return (w, None), w.numel() * w.element_size(), w.float


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ms", type=float, default=20.0, help="minimum length of one timing sample")
    ap.add_argument("--only", default=",".join(cpu_gemm.FORMATS), help="comma-separated formats to run")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bw, peak = stream_gbs(args.runs), peak_gflops(args.runs)
    print(f"variant {cpu_gemm.VARIANT}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"streaming read {bw:.1f} GB/s; peak fp32 FMA {peak:.1f} GFLOP/s\n")
    print(f"{'weight':>17} {'M':>4} | {'ours ms':>8} {'GFLOP/s':>7} {'%peak':>5} {'GB/s':>6} {'%bw':>5} | "
          f"{'mkl ms':>8} {'mkl/ours':>8} | {'deq+mkl':>8} {'/ours':>6}")
    for fmt, n, k in SHAPES:
        if fmt not in args.only.split(","):
            continue
        (wt, sc), nbytes, deq = checkpoint(fmt, n, k)
        prep, w32 = cpu_gemm.prepare_weight(fmt, wt, sc), deq()
        for m in ROWS:
            a = torch.randn(m, k).bfloat16().float()
            ours = timed(lambda: cpu_gemm.gemm(a, prep, fmt, n), args.runs, args.ms)
            mkl = timed(lambda: torch.nn.functional.linear(a, w32), args.runs, args.ms)
            dq = timed(lambda: torch.nn.functional.linear(a, deq()), args.runs, args.ms)
            gflops, gbs = 2 * m * n * k / ours / 1e6, nbytes / ours / 1e6
            print(f"{fmt:>5} {n:>6}x{k:<4} {m:>4} | {ours:8.3f} {gflops:7.1f} {100 * gflops / peak:4.0f}% "
                  f"{gbs:6.1f} {100 * gbs / bw:4.0f}% | {mkl:8.3f} {mkl / ours:8.2f} | {dq:8.3f} {dq / ours:6.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
