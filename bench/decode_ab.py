"""Two bundles' decode steps side by side in one process: old against new on the same host.

    python -m dsneuron.bench.decode_ab OLD NEW [--rounds 9] [--steps 24] [--position 300] [--old-env NAME=VALUE]
                                       [--prefill N [N ...]] [--verify K]

For every decode batch size both bundles compile, each round runs --steps decode steps of each
bundle (the two in alternating order, A B then B A), chaining the state from --position on
fresh state, and takes the median step time (runtime_min/core/runner.py `Step.seconds`: the
executable call alone). Prints, per batch size, the median over the rounds for each bundle and
the ratio NEW / OLD, and whether the two gave the same logits bit for bit on the same steps.
Wall times on a shared 2-core machine drift by 10-30% between rounds; alternating the two in
every round is what keeps the ratio steady, so the ratio from one run is the figure to quote.
--prefill N times, in the same alternating rounds, the prefill of one random N-token prompt (one
call a round), and --verify K a speculative verify of 1 + K tokens after a 12-token prompt
(`Runner.verify`, the drafter's target layers tapped; the bundles' model must have a DSpark
drafter); each row also says whether the two gave the same logits. A position, prompt length or
verify the bundles refuse exits 2 with their reason before anything is timed.
--old-env NAME=VALUE sets an environment variable while the OLD side runs and unsets it while NEW
runs: with the same bundle twice, an A/B of a kernel switch read at each call, such as
DSNEURON_EXACT_NO_FOLD=1 (kernels_nki/cpu/gemm.cpp: the exact GEMV without scale folding). A
variable read only when a kernel is built (DSNEURON_FAST_NO_AMX) changes nothing here.
Raises SystemExit naming the problem when the bundles share no decode batch size or --old-env is
not NAME=VALUE with a nonempty NAME; a bundle that cannot be loaded exits 2 with its reason.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def decode_round(runner, batch: int, steps: int, position: int) -> tuple[float, list]:
    """`steps` decode steps of `runner` at `batch` rows from `position` on fresh state ->
    (median seconds a step, the logits of every step)."""
    import torch

    tokens = torch.full((batch,), runner.pad_token_id + 2, dtype=torch.int64)
    pos = torch.full((batch,), position, dtype=torch.int64)
    state = runner.fresh_state(batch)
    seconds, logits = [], []
    for i in range(steps):
        step = runner.decode(tokens, pos + i, state)
        state = step.state
        seconds.append(step.seconds)
        logits.append(step.logits)
    return statistics.median(seconds), logits


def call_round(call) -> tuple[float, list]:
    """One timed call of `call` (a prefill or a verify) -> (seconds, [its logits]), as decode_round."""
    t0 = time.perf_counter()
    logits = call()
    return time.perf_counter() - t0, [logits]


def prefill_call(runner, n: int):
    """A call that prefills one random n-token prompt (seed 0) on `runner` -> its logits [1, V]."""
    import torch

    prompt = torch.randint(3, min(runner.vocab_size, 128000), (n,), generator=torch.Generator().manual_seed(0)).tolist()
    return lambda: runner.prefill([prompt]).logits


def verify_call(runner, k: int):
    """A call that verifies 1 + k random tokens after a 12-token prompt on `runner` -> its logits
    [1, 1 + k, V] (bench/spec.py's verify)."""
    import torch

    from dsneuron.runtime_min.core import speculative as sp

    target = sp.RunnerTarget(runner)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, min(runner.vocab_size, 128000), (12,), generator=g).tolist()
    state = runner.prefill([prompt]).state
    toks = torch.randint(3, min(runner.vocab_size, 128000), (1, 1 + k), generator=g)
    pos, count = torch.tensor([len(prompt)]), torch.tensor([1 + k])
    return lambda: runner.verify(toks, pos, count, state, target.target_layers).logits


@contextmanager
def environment(name: str | None, value: str | None):
    """os.environ[name] = value (so C getenv sees it), or name unset when value is None, while the
    block runs, then restored; nothing when name is None."""
    if name is None:
        yield
        return
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def main(argv: list[str] | None = None) -> None:
    import torch
    from rich.console import Console
    from rich.table import Table

    from dsneuron import UserError
    from dsneuron.runtime_min.core.runner import Runner

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--position", type=int, default=300)
    ap.add_argument("--old-env", default=None, help="NAME=VALUE set while the OLD side runs")
    ap.add_argument("--prefill", type=int, nargs="*", default=[], help="prompt lengths to time a prefill of")
    ap.add_argument("--verify", type=int, default=0, help="K: time a verify of 1 + K tokens (0: none)")
    args = ap.parse_args(argv)
    name = value = None
    if args.old_env is not None:
        name, eq, value = args.old_env.partition("=")
        if not eq or not name:
            raise SystemExit(f"--old-env must be NAME=VALUE with a nonempty NAME, got {args.old_env!r}")
    for flag, n, low in (("--rounds", args.rounds, 1), ("--steps", args.steps, 1), ("--position", args.position, 0),
                         ("--verify", args.verify, 0),
                         *(("--prefill", n, 1) for n in args.prefill)):
        if n < low:
            raise SystemExit(f"{flag} must be >= {low}, got {n}")
    envs = [(name, value), (name, None)]  # OLD with the variable, NEW without it
    try:
        runners = [Runner.load(args.old), Runner.load(args.new)]
        batches = sorted(set(runners[0].decode_batches) & set(runners[1].decode_batches))
        if not batches:
            raise SystemExit(f"the bundles share no decode batch size ({runners[0].decode_batches} and "
                             f"{runners[1].decode_batches})")
        # one row a decode batch, prefill and verify: per side a round -> (seconds, [logits])
        rows = [(str(b), [lambda r=r, b=b: decode_round(r, b, args.steps, args.position) for r in runners])
                for b in batches]
        rows += [(f"prefill {n}", [lambda c=prefill_call(r, n): call_round(c) for r in runners]) for n in args.prefill]
        if args.verify:
            pair = []
            for r, env in zip(runners, envs):  # the prompt's prefill with the side's environment too
                with environment(*env):
                    pair.append(lambda c=verify_call(r, args.verify): call_round(c))
            rows.append((f"verify 1 + {args.verify}", pair))
        for _, pair in rows:  # loads the executables; a prompt or verify the bundles refuse fails here
            for side, env in zip(pair, envs):
                with environment(*env):
                    side()
    except (UserError, ValueError) as e:  # an unusable bundle or a length it refuses: the reason, exit 2
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    table = Table(title=f"decode step, {args.rounds} rounds of {args.steps} steps from position {args.position}")
    for col in ("batch", "old ms", "new ms", "new / old", "same logits"):
        table.add_column(col)
    for label, pair in rows:
        times: list[list[float]] = [[], []]
        same = True
        for k in range(args.rounds):
            got = {}
            for i in ((0, 1) if k % 2 == 0 else (1, 0)):
                with environment(*envs[i]):
                    seconds, got[i] = pair[i]()
                times[i].append(seconds)
            same = same and all(torch.equal(a, b) for a, b in zip(got[0], got[1]))
        old, new = (statistics.median(t) * 1e3 for t in times)
        table.add_row(label, f"{old:.2f}", f"{new:.2f}", f"{new / old:.3f}", "yes" if same else "no")
    Console().print(table)


if __name__ == "__main__":
    main()
