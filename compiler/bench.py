"""The main-job benchmark: the compiled bundle next to the eager golden model, from one run.

    python -m dsneuron.compiler.bench [--config tiny] [--work DIR] [--repeats 3] [--decode 16] [--json OUT]

Measures, on this host and in this order:
1. cold compile: `compile_bundle` into an empty compile cache (the deterministic checkpoint is made
   first and not counted); warm compile: the same again into another folder, every bucket a hit;
2. the bundle (a child process, so compile memory does not count): load time, prefill latency of
   the shipped prompts (11, 172, 715 tokens; median of --repeats), decode seconds per token (median
   over --decode teacher-forced steps after the 715-token prompt), peak RSS;
3. the eager golden model (another child process): the same prefills and decode steps, peak RSS;
4. sizes: bundle, its weights file, the checkpoint.
Ratios are eager / compiled for times (higher is better) and bundle / checkpoint for size. Both
children use torch's default thread count, printed with the figures. Absolute times on a shared
machine are noisy; the ratios, measured side by side in one run, are the figures to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: Linux carries that over execve, so
    a child would report the compiling parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (the benchmark needs Linux)")


def _measure_bundle(args: dict) -> dict:
    import torch

    from dsneuron.runtime_min.session import Session

    t0 = time.perf_counter()
    session = Session.load(args["bundle"])
    load_s = time.perf_counter() - t0
    prefill = {}
    for ids in args["prompts"]:
        prefill[len(ids)] = statistics.median(session.teacher_forced(ids, len(ids))[0].seconds for _ in range(args["repeats"]))
    steps = session.teacher_forced(args["prompts"][-1] + args["decode_ids"], len(args["prompts"][-1]))
    return {"load_s": load_s, "prefill_s": prefill, "decode_s": statistics.median(s.seconds for s in steps[1:]),
            "threads": torch.get_num_threads(), "peak_rss": _peak_rss_bytes()}


def _measure_eager(args: dict) -> dict:
    from dsneuron.compiler.config import load_config
    from dsneuron.graphs.bench import eager_timings
    from dsneuron.graphs.golden import Golden

    cfg, ccfg, _ = load_config(args["config"])
    golden = Golden(cfg, Path(args["checkpoint"]), ccfg.max_seq_len)
    out = eager_timings(golden, args["prompts"], args["decode_ids"], args["repeats"])
    out["peak_rss"] = _peak_rss_bytes()
    return out


def _child(kind: str, args: dict) -> dict:
    """Run one measurement in a fresh interpreter; returns its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        req, res = Path(tmp) / "args.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(args))
        subprocess.run([sys.executable, "-m", "dsneuron.compiler.bench", "--child", kind, str(req), str(res)], check=True)
        out = json.loads(res.read_text())
    out["prefill_s"] = {int(k): v for k, v in out["prefill_s"].items()}
    return out


def run(config: str, work: Path, repeats: int, n_decode: int, console: Console, names: tuple[str, ...] = ("short", "medium", "long")) -> dict:
    """The whole benchmark (module docstring); returns every figure as plain data."""
    from dsneuron.compiler.compile import build_steps_for_config, compile_bundle
    from dsneuron.compiler.config import load_config
    from dsneuron.compiler.default_prompts import default_prompts
    from dsneuron.compiler.model_steps import checkpoint_for
    from dsneuron.graphs.tokenizer import load_tokenizer

    model_cfg, compile_cfg, _ = load_config(config)
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    if (cache / "entries").exists():
        shutil.rmtree(cache / "entries")  # a cold compile starts without entries; the checkpoint stays
    if (cache / "aliases").exists():
        shutil.rmtree(cache / "aliases")
    parts = build_steps_for_config(model_cfg, compile_cfg, cache)
    checkpoint = checkpoint_for(model_cfg, compile_cfg, cache)

    t0 = time.perf_counter()
    compile_bundle(model_cfg, compile_cfg, work / "bundle", parts, force=True, cache_dir=cache, console=console)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    compile_bundle(model_cfg, compile_cfg, work / "bundle_warm", parts, force=True, cache_dir=cache, console=console)
    warm = time.perf_counter() - t0
    del parts

    tok = load_tokenizer()
    prompts = [[model_cfg.bos_token_id] + tok.encode(text, add_special_tokens=False).ids for name, text in default_prompts() if name in names]
    decode_ids = tok.encode(" The end of the story is near, and the ship sails on through the night."
                            " Nobody on the quay", add_special_tokens=False).ids[:n_decode]
    args = {"config": config, "checkpoint": str(checkpoint), "bundle": str(work / "bundle"), "prompts": prompts,
            "decode_ids": decode_ids, "repeats": repeats}
    console.print("measuring the bundle ...")
    compiled = _child("bundle", args)
    console.print("measuring the eager golden model ...")
    eager = _child("eager", args)
    return {"config": config, "compile_cold_s": cold, "compile_warm_s": warm, "compiled": compiled, "eager": eager,
            "bundle_bytes": _dir_bytes(work / "bundle"), "weights_bytes": (work / "bundle" / "weights.safetensors").stat().st_size,
            "checkpoint_bytes": _dir_bytes(checkpoint), "host_cores": os.cpu_count()}


def report(r: dict, console: Console) -> None:
    """Print the figures of `run` as one table."""
    c, e = r["compiled"], r["eager"]
    t = Table(title=f"dsneuron bench: {r['config']} ({c['threads']} threads compiled, {e['threads']} eager, {r['host_cores']} cores)")
    for col in ("figure", "compiled", "eager golden", "ratio"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    t.add_row("compile, cold", f"{r['compile_cold_s']:.1f} s", "", "")
    t.add_row("compile, warm", f"{r['compile_warm_s']:.1f} s", "", "")
    t.add_row("bundle load", f"{c['load_s']:.2f} s", "", "")
    for n, s in c["prefill_s"].items():
        t.add_row(f"prefill {n} tokens", f"{s * 1e3:.0f} ms", f"{e['prefill_s'][n] * 1e3:.0f} ms", f"{e['prefill_s'][n] / s:.2f}x")
    t.add_row("decode", f"{1 / c['decode_s']:.2f} tok/s", f"{1 / e['decode_s']:.2f} tok/s", f"{e['decode_s'] / c['decode_s']:.2f}x")
    gib = 2.0**30
    t.add_row("peak RSS", f"{c['peak_rss'] / gib:.2f} GiB", f"{e['peak_rss'] / gib:.2f} GiB",
              f"{c['peak_rss'] / r['weights_bytes']:.2f}x weights")
    t.add_row("bundle size", f"{r['bundle_bytes'] / gib:.2f} GiB", f"checkpoint {r['checkpoint_bytes'] / gib:.2f} GiB",
              f"{r['bundle_bytes'] / r['checkpoint_bytes']:.2f}x")
    console.print(t)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", help="packaged config name or JSON path")
    ap.add_argument("--work", type=Path, default=Path(".bench"), help="bundles and compile cache of the run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", type=int, default=16, help="decode steps after the longest prompt")
    ap.add_argument("--prompts", default="short,medium,long", help="which shipped prompts (comma-separated)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        kind, req, res = a.child
        args = json.loads(Path(req).read_text())
        Path(res).write_text(json.dumps(_measure_bundle(args) if kind == "bundle" else _measure_eager(args)))
        return
    console = Console(stderr=True)
    r = run(a.config, a.work, a.repeats, a.decode, console, tuple(a.prompts.split(",")))
    report(r, Console())
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
