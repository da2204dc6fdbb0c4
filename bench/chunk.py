"""Chunked prefill against a one-shot prefill of the same prompt, side by side in one run.

    python -m dsneuron.bench.chunk --bundle DIR [--length 256] [--chunk 64] [--repeats 5]
    python -m dsneuron.bench.chunk --config tiny --prefill 256 --capacity 512 --work DIR [...]

With --config, first compiles the config's model with one prefill bucket of --prefill tokens (a
token range on the cpu target) and one decode capacity --capacity (> --prefill, so the bundle gets
a chunk bucket there: compiler/buckets.py `with_chunks`) into --work (its compile cache kept there).
Then, on one random prompt of --length tokens (<= the prefill bucket, so that both fit): the
one-shot prefill (runtime_min/core/runner.py `Runner.prefill_job`) and the chunked prefill with chunks of
--chunk tokens (`Runner.prefill_job(ids, chunk)`: a prefill of the first chunk, then chunk buckets at the
smallest chunk capacity holding the prompt), alternated, each warmed once, --repeats times. Prints
the medians, tokens/s, the ratio chunked / one-shot tokens/s, and how the two logits agree (cosine;
the chunks have the numerics of decode steps, so they match the one-shot prefill within the golden
floor, not bit for bit). Wall times on a shared machine are noisy: the ratio from one run is the
figure to quote.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path


def compile_bench_bundle(config: str, prefill: int, capacity: int, work: Path) -> Path:
    """Compile `config` with batch 1, prefill_seq_lens [prefill], decode_context_lens [capacity]
    into work/bundle (compile cache work/cache); returns the bundle path."""
    from dsneuron.compiler.compile import build_steps_for_config, compile_bundle
    from dsneuron.compiler.config import load_config

    model_cfg, compile_cfg, _ = load_config(config)
    compile_cfg = dataclasses.replace(compile_cfg, batch_sizes=(1,), prefill_seq_lens=(prefill,),
                                      decode_context_lens=(capacity,), max_seq_len=max(capacity, compile_cfg.max_seq_len),
                                      chunked_prefill=True)
    parts = build_steps_for_config(model_cfg, compile_cfg, work / "cache")
    return compile_bundle(model_cfg, compile_cfg, work / "bundle", parts, cache_dir=work / "cache", force=True)


def measure(bundle: Path, length: int, chunk: int, repeats: int) -> dict:
    """The figures of the module docstring for a prompt of `length` tokens."""
    import torch

    from dsneuron.runtime_min.core.runner import Runner

    from dsneuron.compiler.compare import logit_metrics

    r = Runner.load(bundle)
    ids = torch.randint(3, min(r.vocab_size, 128000), (length,), generator=torch.Generator().manual_seed(0)).tolist()
    runs = {"one-shot": lambda: r.prefill_job(ids).run().logits[0],
            "chunked": lambda: r.prefill_job(ids, chunk).run().logits[0]}
    logits = {name: fn() for name, fn in runs.items()}  # warm: executables loaded
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    agree = logit_metrics(logits["chunked"], logits["one-shot"])
    return {"bundle": str(bundle), "length": length, "chunk": chunk, "repeats": repeats,
            "threads": torch.get_num_threads(), "median_s": med, "times_s": times,
            "tokens_per_s": {n: length / t for n, t in med.items()},
            "ratio": med["one-shot"] / med["chunked"], "cos": agree["cos"], "argmax": agree["argmax"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=None, help="a bundle with a chunk bucket (else --config compiles one)")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--prefill", type=int, default=256, help="with --config: the prefill bucket's tokens")
    ap.add_argument("--capacity", type=int, default=512, help="with --config: the decode capacity (> --prefill)")
    ap.add_argument("--work", type=Path, default=Path(".bench-chunk"))
    ap.add_argument("--length", type=int, default=256, help="prompt tokens (<= the prefill bucket)")
    ap.add_argument("--chunk", type=int, default=64, help="chunk tokens (a length the buckets take)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    bundle = a.bundle
    if bundle is None:
        t0 = time.perf_counter()
        bundle = compile_bench_bundle(a.config, a.prefill, a.capacity, a.work)
        print(f"compiled {bundle} in {time.perf_counter() - t0:.0f} s")
    r = measure(bundle, a.length, a.chunk, a.repeats)
    one, ch = r["median_s"]["one-shot"], r["median_s"]["chunked"]
    print(f"prompt {r['length']} tokens, chunks of {r['chunk']}, median of {r['repeats']} ({r['threads']} threads): "
          f"one-shot {one:.3f} s ({r['tokens_per_s']['one-shot']:.0f} tokens/s), chunked {ch:.3f} s "
          f"({r['tokens_per_s']['chunked']:.0f} tokens/s): chunked = {r['ratio']:.0%} of one-shot; "
          f"logits cos {r['cos']:.6f}, argmax {'same' if r['argmax'] else 'differs'}")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
