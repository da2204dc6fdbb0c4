"""Eager golden timings: prefill at several prompt lengths and decode tokens/s, one run, medians.

    python -m dsneuron.graphs.bench --config tiny --checkpoint DIR [--lengths 11 172 715] [--decode 8]

Prints the thread count with every figure; absolute times are noisy on shared machines, so the
compiled-vs-eager ratios of `dsneuron.compiler.bench` are the figures to quote.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dsneuron.compiler.config import load_config
from dsneuron.graphs.golden import Golden
from dsneuron.graphs.steps import decode, prefill


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[11, 172, 715])
    ap.add_argument("--decode", type=int, default=8, help="decode steps timed after the longest prefill")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    cfg, ccfg, _ = load_config(args.config)
    golden = Golden(cfg, args.checkpoint, ccfg.max_seq_len)
    m = golden.model
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for L in args.lengths:
            ids = torch.randint(0, 128000, (1, L), generator=g)
            eng = golden.engram_ids(ids)
            t = _median_time(lambda: prefill(m, ids, torch.tensor([L]), eng, routed=True), args.repeats)
            print(f"eager prefill {L:5d} tokens: {t * 1e3:9.1f} ms  ({threads} threads)")
        L = args.lengths[-1]
        ids = torch.randint(0, 128000, (1, L + args.decode), generator=g)
        eng = golden.engram_ids(ids)
        _, state = prefill(m, ids[:, :L], torch.tensor([L]), eng[:, :L], routed=True)
        per_token = []
        for p in range(L, L + args.decode):
            t0 = time.perf_counter()
            _, state = decode(m, ids[:, p:p + 1], torch.tensor([p]), eng[:, p:p + 1], state, routed=True)
            per_token.append(time.perf_counter() - t0)
        t = statistics.median(per_token)
        print(f"eager decode at {L}: {t * 1e3:9.1f} ms/token = {1 / t:6.2f} tokens/s  ({threads} threads)")


if __name__ == "__main__":
    main()
