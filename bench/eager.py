"""Eager golden timings: prefill latency per prompt and decode seconds per token, medians.

    python -m dsneuron.bench.eager --config tiny --checkpoint DIR [--lengths 11 172 715] [--decode 8]

Prints the thread count with every figure; absolute times are noisy on shared machines, so the
compiled-vs-eager ratios of `python -m dsneuron.bench.bundle` are the figures to quote.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Sequence

import torch

from dsneuron.compiler.config import load_config
from dsneuron.graphs.golden import Golden
from dsneuron.graphs.steps import decode, prefill


def median_seconds(fn, repeats: int) -> float:
    """Median wall time in seconds of `repeats` calls of fn()."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def eager_timings(golden: Golden, prompts: Sequence[Sequence[int]], decode_ids: Sequence[int], repeats: int) -> dict:
    """The golden model's step times, the routed MoE of the reference, one prompt at a time.

    prompts: token id lists; each is prefilled `repeats` times -> {"prefill_s": {len: median seconds}}.
    decode_ids: after prefilling the last prompt, these ids are decoded one by one ->
    "decode_s": median seconds per token. Raises ValueError when a sequence exceeds the capacity.
    """
    m = golden.model
    out: dict = {"prefill_s": {}, "threads": torch.get_num_threads()}
    for ids in prompts:
        t = torch.tensor([list(ids)])
        eng = golden.engram_ids(t)
        out["prefill_s"][len(ids)] = median_seconds(lambda: prefill(m, t, torch.tensor([len(ids)]), eng, routed=True), repeats)
    seq = torch.tensor([list(prompts[-1]) + list(decode_ids)])
    if seq.size(1) > golden.max_seq_len:
        raise ValueError(f"{seq.size(1)} tokens exceed the golden's capacity {golden.max_seq_len}")
    eng = golden.engram_ids(seq)
    L = len(prompts[-1])
    _, state = prefill(m, seq[:, :L], torch.tensor([L]), eng[:, :L], routed=True)
    per_token = []
    for p in range(L, seq.size(1)):
        t0 = time.perf_counter()
        _, state = decode(m, seq[:, p:p + 1], torch.tensor([p]), eng[:, p:p + 1], state, routed=True)
        per_token.append(time.perf_counter() - t0)
    out["decode_s"] = statistics.median(per_token)
    return out


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
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128000, (L,), generator=g).tolist() for L in args.lengths]
    t = eager_timings(golden, prompts, torch.randint(0, 128000, (args.decode,), generator=g).tolist(), args.repeats)
    for L, s in t["prefill_s"].items():
        print(f"eager prefill {L:5d} tokens: {s * 1e3:9.1f} ms  ({t['threads']} threads)")
    print(f"eager decode: {t['decode_s'] * 1e3:9.1f} ms/token = {1 / t['decode_s']:6.2f} tokens/s  ({t['threads']} threads)")


if __name__ == "__main__":
    main()
