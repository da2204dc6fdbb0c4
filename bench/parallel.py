"""Decode with tensor/expert parallelism against one process, side by side in one run.

    python -m dsneuron.bench.parallel --config tiny --tp 2 --ep 2 [--decode 8] [--json OUT]
    python -m dsneuron.bench.parallel --bundles ONE SHARDED [--decode 8] [--repeats 3] [--json OUT]

With --bundles: the compiled path. ONE is a one-process bundle, SHARDED a sharded bundle of the same
model and plan (`dsneuron compile --tp N`); each generates `--decode` greedy tokens after the
shipped short prompt `--repeats` times (the first call loads the executables), one after the other
in this run, and the best repeat's decode seconds per token are compared, with rank 0's seconds
inside the collectives and whether both made the same tokens.

Without --bundles: runs the shipped short prompt plus `--decode` teacher-forced tokens through `run_sharded` twice, in
the cpu target's numerics (GEMM order "kernel", grouped-GEMM MoE) on the eager shards: once as one
process (TP=1, every core) and once as tp processes over gloo (cores / tp threads each). Prints
rank 0's seconds per decode token for both, the sharded run's seconds inside the collectives
(runtime_min/executors/collectives.py collective_seconds: transfers plus the chain's wait for the ranks
before it), whether every step's logits are bit-identical, and whether the sharded decode is within
TP=1 plus its collective cost (issue 17's goal). The checkpoint is compile's: `compile.checkpoint`
or the config's seeded random one (compiler/model_steps.py checkpoint_for). The timings are only
worth comparing on an otherwise idle host: the ranks share its cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dsneuron import UserError
from dsneuron.disk import check_output_file


def run(config: str, tp: int, ep: int, n_decode: int) -> dict:
    """Both runs (module docstring); returns the figures as plain data. Raises UserError for a
    config or plan that cannot run."""
    from dsneuron.compiler.config import load_config
    from dsneuron.compiler.default_prompts import default_prompts
    from dsneuron.compiler.model_steps import checkpoint_for
    from dsneuron.compiler.parallel import run_sharded
    from dsneuron.compiler.placement import Parallel
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


def generate_timed(session, out, prompt: str, n_decode: int, repeats: int) -> None:
    """A runtime_min/sharded.py job (and the one-process run): greedy generation of `prompt`
    `repeats` times; out("stdout", JSON) gets the tokens and the best repeat's decode steps, decode
    seconds and collective seconds (runtime_min/core/scheduler.py GenerationStats)."""
    best = None
    for _ in range(repeats):
        ids = session.generate_ids([prompt], n_decode)[0]
        st = session.last_stats
        if best is None or st.decode_s < best.decode_s:
            best = st
    out("stdout", json.dumps({"ids": ids, "steps": best.decode_steps, "decode_s": best.decode_s,
                              "collective_s": best.collective_s}))


def run_bundles(one: Path, sharded: Path, n_decode: int, repeats: int) -> dict:
    """Both bundles' decode (module docstring); returns the figures as plain data. Raises
    BundleError (a UserError) for a bundle that is not of the kind its argument names."""
    from dsneuron.compiler.default_prompts import default_prompts
    from dsneuron.runtime_min.bundle.bundle import read_manifest
    from dsneuron.runtime_min.bundle.schema import BundleError, rank_dir
    from dsneuron.runtime_min.session import Session
    from dsneuron.runtime_min.sharded import launch, read_sharded

    plan = read_sharded(sharded)
    if plan is None:
        raise BundleError(f"--bundles ONE SHARDED: {sharded} is no sharded bundle (no parallel.json)")
    if read_manifest(one).model_config != read_manifest(sharded / rank_dir(0, plan.world)).model_config:
        raise BundleError(f"--bundles: {one} and {sharded} are bundles of different models (model_config)")
    prompt = dict(default_prompts())["short"]
    said: list[str] = []
    keep = lambda stream, text: said.append(text)  # noqa: E731
    generate_timed(Session.load(one), keep, prompt, n_decode, repeats)
    launch(sharded, plan, generate_timed, {"prompt": prompt, "n_decode": n_decode, "repeats": repeats}, keep)
    a, b = (json.loads(t) for t in said)
    one_s = a["decode_s"] / max(a["steps"], 1)
    tp_s, coll_s = b["decode_s"] / max(b["steps"], 1), b["collective_s"] / max(b["steps"], 1)
    return {"bundles": [str(one), str(sharded)], "tp": plan.tp, "ep": plan.ep, "decode_tokens": a["steps"],
            "tp1_decode_s": one_s, "tp_decode_s": tp_s, "tp_collective_s": coll_s, "same_tokens": a["ids"] == b["ids"],
            "within_collective_cost": tp_s <= one_s + coll_s}


def _decode_table(title: str, r: dict) -> Table:
    """The TP=1 / TP=tp table both reports start from: seconds per decode token and collectives."""
    t = Table(title=title)
    for c in ("figure", "TP=1", f"TP={r['tp']}"):
        t.add_column(c)
    t.add_row("seconds / decode token", f"{r['tp1_decode_s'] * 1e3:.1f} ms", f"{r['tp_decode_s'] * 1e3:.1f} ms")
    t.add_row("of which in collectives", "-", f"{r['tp_collective_s'] * 1e3:.1f} ms")
    return t


def report_bundles(r: dict, console: Console) -> None:
    console.print(_decode_table(f"compiled decode: sharded bundle (TP={r['tp']} EP={r['ep']}) vs one-process bundle "
                                f"({r['decode_tokens']} decode steps, best repeat)", r))
    console.print(f"same tokens: {'yes' if r['same_tokens'] else 'NO'}; TP={r['tp']} decode within TP=1 + its "
                  f"collective time: {'yes' if r['within_collective_cost'] else 'NO'}")


def report(r: dict, console: Console) -> None:
    t = _decode_table(f"{r['config']}: decode, TP={r['tp']} EP={r['ep']} vs one process "
                      f"({r['prompt_tokens']}-token prompt, {r['decode_tokens']} tokens)", r)
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
    ap.add_argument("--bundles", type=Path, nargs=2, metavar=("ONE", "SHARDED"),
                    help="compare these compiled bundles instead of the eager shards")
    ap.add_argument("--repeats", type=int, default=3, choices=range(1, 11), metavar="1..10",
                    help="with --bundles: generations per bundle, the best one counts")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args(argv)
    console = Console()
    try:
        if a.json:  # before minutes of runs
            check_output_file(a.json, "--json")
        r = run_bundles(*a.bundles, a.decode, a.repeats) if a.bundles else run(a.config, a.tp, a.ep, a.decode)
    except (UserError, ValueError) as e:
        Console(stderr=True).print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        raise SystemExit(2) from None
    (report_bundles if a.bundles else report)(r, console)
    if a.json:
        a.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
