"""Decode with tensor/expert parallelism against one process, side by side in one run.

    python -m dsneuron.compiler.bench_parallel --config tiny --tp 2 --ep 2 [--decode 8] [--json OUT]

Runs the shipped short prompt plus `--decode` teacher-forced tokens through `run_sharded` twice, in
the cpu target's numerics (GEMM order "kernel", grouped-GEMM MoE) on the eager shards: once as one
process (TP=1, every core) and once as tp processes over gloo (cores / tp threads each). Prints
rank 0's seconds per decode token for both, the sharded run's seconds inside the collectives
(runtime_min/collectives.py collective_seconds: transfers plus the chain's wait for the ranks
before it), whether every step's logits are bit-identical, and whether the sharded decode is within
TP=1 plus its collective cost (issue 17's goal). The checkpoint is compile's: `compile.checkpoint`
or the config's seeded random one (compiler/model_steps.py checkpoint_for).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dsneuron import UserError


def run(config: str, tp: int, ep: int, n_decode: int) -> dict:
    """Both runs (module docstring); returns the figures as plain data. Raises UserError for a
    config or plan that cannot run."""
    from dsneuron.compiler.config import load_config
    from dsneuron.compiler.default_prompts import default_prompts
    from dsneuron.compiler.model_steps import checkpoint_for
    from dsneuron.compiler.parallel import run_sharded
    from dsneuron.compiler.plan import Parallel
    from dsneuron.graphs.tokenizer import load_tokenizer

    cfg, ccfg, _ = load_config(config)
    checkpoint = checkpoint_for(cfg, ccfg, None)
    tok = load_tokenizer()
    text = dict(default_prompts())["short"]
    prompt = [cfg.bos_token_id] + tok.encode(text, add_special_tokens=False).ids
    ids = prompt + tok.encode(" The ship sails on through the night, and nobody on the quay",
                              add_special_tokens=False).ids[:n_decode]
    max_len = max(len(ids), 64)
    one = run_sharded(cfg, checkpoint, max_len, Parallel(1, 1), ids, len(prompt), cpu_kernels=True, timed=True)
    par = run_sharded(cfg, checkpoint, max_len, Parallel(tp, ep), ids, len(prompt), cpu_kernels=True, timed=True)
    equal = [bool(torch.equal(a, b)) for a, b in zip(one.logits, par.logits)]
    greedy = [int(a.argmax()) == int(b.argmax()) for a, b in zip(one.logits, par.logits)]
    return {"config": config, "tp": tp, "ep": ep, "prompt_tokens": len(prompt), "decode_tokens": len(ids) - len(prompt),
            "tp1_decode_s": one.decode_s, "tp_decode_s": par.decode_s, "tp_collective_s": par.collective_s,
            "held_bytes": {"tp1": one.held, "tp": par.held}, "steps_bit_identical": sum(equal), "steps": len(equal),
            "greedy_agree": sum(greedy),
            "within_collective_cost": par.decode_s <= one.decode_s + par.collective_s}


def report(r: dict, console: Console) -> None:
    t = Table(title=f"{r['config']}: decode, TP={r['tp']} EP={r['ep']} vs one process "
                    f"({r['prompt_tokens']}-token prompt, {r['decode_tokens']} tokens)")
    for c in ("figure", "TP=1", f"TP={r['tp']}"):
        t.add_column(c)
    t.add_row("seconds / decode token", f"{r['tp1_decode_s'] * 1e3:.1f} ms", f"{r['tp_decode_s'] * 1e3:.1f} ms")
    t.add_row("of which in collectives", "-", f"{r['tp_collective_s'] * 1e3:.1f} ms")
    t.add_row("weights held by rank 0", f"{r['held_bytes']['tp1'][0] / 2**20:.0f} MiB",
              f"{r['held_bytes']['tp'][0] / 2**20:.0f} MiB")
    console.print(t)
    console.print(f"logits bit-identical on {r['steps_bit_identical']} of {r['steps']} steps, greedy token on "
                  f"{r['greedy_agree']}; TP={r['tp']} decode within TP=1 + its collective time: "
                  f"{'yes' if r['within_collective_cost'] else 'NO'}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--decode", type=int, default=8, choices=range(1, 15), metavar="1..14",
                    help="teacher-forced decode tokens after the short prompt")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args(argv)
    console = Console()
    try:
        r = run(a.config, a.tp, a.ep, a.decode)
    except (UserError, ValueError) as e:
        console.print(f"error: {e}")
        raise SystemExit(2) from None
    report(r, console)
    if a.json:
        a.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
