"""The main-job benchmark: the compiled bundle next to the eager golden model, from one run.

    python -m dsneuron.bench.bundle [--config tiny] [--work DIR] [--repeats 3] [--decode 16] [--json OUT]
        [--prompts short,medium,long] [--no-doubled] [--no-eager] [--batch-sizes 1,2,4,8] [--numerics exact,fast]

Measures, on this host and in this order, each in a child process (so one measurement's memory and
caches do not count in another's):
1. compile: cold (an empty dsneuron compile cache and a fresh, empty TORCHINDUCTOR_CACHE_DIR: a
   shared Inductor cache in the temp folder would make a "cold" compile warm), warm (the same
   again into another folder: every bucket a cache hit), and cold for the config with every layer
   doubled (`doubled_layers`: the same layer kinds, twice the layers), each from loading the
   checkpoint to the written bundle; the deterministic checkpoints are made first and not counted;
2. the bundle: load time, prefill latency of the shipped prompts (11, 172, 715 tokens; median of
   --repeats), decode seconds per token (median over --decode teacher-forced steps after the
   715-token prompt), peak RSS, and the host's streaming read bandwidth (a 1 GiB sum);
3. the eager golden model: the same prefills and decode steps, peak RSS;
4. sizes: bundle, its weights file, the checkpoint; and the decode roofline: the checkpoint-format
   bytes one decode token must read (`decode_bytes`: the head, every layer's dense weights, the
   routed experts a token uses and the shared one, the engram rows it looks up, one embedding row)
   over the measured bandwidth, next to the measured time per token;
5. per stage kind (the staged executables, graphs/stages.py), one more run of the longest prompt
   and its decode steps timed stage by stage: the prefill's time per kind, and per decode token
   each kind's time beside the bytes its executables read (`stage_read_bytes`) and their roofline;
6. the longest prefill's effective GFLOP/s (compiler/plan.py `count_flops`) beside the host's bf16
   GEMM rate, torch.mm at the prefill's linear shapes (`gemm_shapes`, `mm_seconds`), and the fp32
   FMA peak (bench/cpu_gemm.py), measured in the same child;
7. the decode step alone at each of --batch-sizes (a second bundle with those batch buckets,
   compiled from the warm cache, not timed; bench/serve.py `decode_step_times`).
With --numerics naming several cpu kernel numerics (graphs.config.NUMERICS_MODES; by default both,
exact first), items 1-3 and 6-7 run for the first as above, and each other one gets its own cold compile, bundle measurement (2, 5,
6: each child measures torch.mm and the FMA peak beside its own prefill) and batch buckets (7); a
last table puts the modes side by side: compile, prefill GFLOP/s against torch.mm bf16 on the same
shapes and the FMA peak, decode tok/s against the weight-read roofline, rows/s per batch bucket. On a
host whose fast kernels run on AMX, the fast bundles are measured once more with
DSNEURON_FAST_NO_AMX=1 (their VDPBF16PS layer: the kernels are the runtime's, so the same bundles)
as the column "fast, no AMX"; on one whose VDPBF16PS layer expands FP8 by VBMI byte tables, with
DSNEURON_FAST_NO_VBMI=1 (the arithmetic expansion) as "fast, no VBMI".
Ratios are eager / compiled for times (higher is better) and bundle / checkpoint for sizes. Both
run children use torch's default thread count, printed with the figures. Absolute times on a
shared machine are noisy; the ratios, measured side by side in one run, are the figures to quote.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


#: the fast kernels' layers that an environment switch turns off (kernels_nki/cpu_gemm_fast.py
#: host_variant): variant -> (the column of the bundles measured without it, the switch)
FAST_SWITCHES = {"amx": ("fast, no AMX", {"DSNEURON_FAST_NO_AMX": "1"}),
                 "avx512vbmi": ("fast, no VBMI", {"DSNEURON_FAST_NO_VBMI": "1"})}


def fast_switch() -> tuple[str, dict[str, str]] | None:
    """(column, environment) that measures the fast bundles without this host's fast layer (AMX
    tiles, or the VBMI table expansion), None where the fast kernels have no such layer here."""
    from dsneuron.kernels_nki import cpu_gemm_fast

    return FAST_SWITCHES.get(cpu_gemm_fast.VARIANT)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: Linux carries that over execve, so
    a child would report the compiling parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (the benchmark needs Linux)")


def doubled_layers(model: dict[str, Any]) -> dict[str, Any]:
    """The model config (JSON form) with every backbone layer repeated twice: layer L becomes layers
    2L (with L's roles: kv, index, candidate source, engram, DSpark target) and 2L+1 (a consumer of
    2L's cache and selections). The layer kinds stay those of the original (graphs/stages.py)."""
    n = model["n_layers"]
    ratios = model["compress_ratios"]
    out = dict(model)
    out["n_layers"] = 2 * n
    out["compress_ratios"] = [r for r in ratios[:n] for _ in range(2)] + list(ratios[n:])
    for key in ("kv_source_layers", "index_source_layers", "engram_layer_ids", "dspark_target_layer_ids"):
        out[key] = [2 * i for i in model[key]]
    if model["candidate_source_layer"] >= 0:
        out["candidate_source_layer"] = 2 * model["candidate_source_layer"]
    return out


def decode_bytes(checkpoint: Path, model: dict[str, Any]) -> int:
    """Checkpoint-format bytes one decode token reads (module docstring, item 4), from the
    safetensors headers of `checkpoint`: DSpark (mtp.*) stages are not run; of the embedding one row;
    of an engram table the rows of its (max_ngram - 1) * n_heads hash columns; of the routed experts
    the share n_activated / n_routed; everything else whole."""
    from safetensors import safe_open

    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    itemsize = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1}
    cols = (model["engram_max_ngram_size"] - 1) * model["engram_n_heads"]
    share = model["n_activated_experts"] / model["n_routed_experts"]
    total = 0.0
    for shard in sorted(set(index.values())):
        with safe_open(str(checkpoint / shard), framework="pt") as f:
            for name in f.keys():
                if name.startswith("mtp."):
                    continue
                sl = f.get_slice(name)
                shape = sl.get_shape()
                size = itemsize[sl.get_dtype()]
                for d in shape:
                    size *= d
                if name == "embed.weight" or ".engram.embed." in name:
                    size = size // shape[0] * (1 if name == "embed.weight" else cols)
                elif ".ffn.experts." in name:
                    size *= share
                total += size
    return int(total)


def _measure_compile(args: dict) -> dict:
    from dsneuron.compiler.compile import build_steps_for_config, compile_bundle
    from dsneuron.compiler.config import load_config

    model_cfg, compile_cfg, _ = load_config(args["config"])
    compile_cfg = dataclasses.replace(compile_cfg, numerics=args.get("numerics", compile_cfg.numerics))
    t0 = time.perf_counter()
    parts = build_steps_for_config(model_cfg, compile_cfg, Path(args["cache"]))
    compile_bundle(model_cfg, compile_cfg, Path(args["out"]), parts, force=True, cache_dir=Path(args["cache"]),
                   console=Console(stderr=True))
    return {"seconds": time.perf_counter() - t0}


def stage_read_bytes(bucket: Any, weights: dict[str, Any], model: dict[str, Any]) -> dict[str, int]:
    """Weight bytes each stage of a decode `bucket` reads for one row, by stage name: its tensors as
    the executables take them (kernels_nki/prepare.py `Prepare`: checkpoint bytes, the scales
    widened to fp32), of the stacked routed experts the share n_activated / n_routed, of the
    embedding one row, of an engram table the rows of its hash columns."""
    share = model["n_activated_experts"] / model["n_routed_experts"]
    cols = (model["engram_max_ngram_size"] - 1) * model["engram_n_heads"]
    out = {}
    for st in bucket.stages:
        total = 0
        for name in st.weights:
            t = weights[name]
            n = t.numel() * t.element_size()
            if name == "embed.weight":
                n //= t.shape[0]
            elif ".engram.embed." in name:
                n = n // t.shape[0] * cols
            elif ".experts_" in name:
                n = int(n * share)
            total += n
        out[st.name] = total
    return out


def by_stage_kind(bucket: Any, seconds: dict[str, float], per: int, nbytes: dict[str, int] | None = None) -> list[dict]:
    """Per-stage seconds (summed over `per` calls) of `bucket` grouped by stage kind (the stage's
    executable, graphs/stages.py): [{kind, stages, seconds per call, bytes per call}] in stage order."""
    rows: dict[str, dict] = {}
    for st in bucket.stages:
        kind = Path(st.file).stem
        r = rows.setdefault(kind, {"kind": kind, "stages": 0, "s": 0.0, "bytes": 0})
        r["stages"] += 1
        r["s"] += seconds.get(st.name, 0.0) / per
        r["bytes"] += (nbytes or {}).get(st.name, 0)
    return list(rows.values())


def gemm_shapes(model: dict[str, Any], tokens: int) -> dict[tuple[int, int, int], int]:
    """{(M, K, N): count} of the linear layers of a `tokens`-token prefill, from the checkpoint's
    tensor shapes (graphs/spec.py): M = tokens for the dense projections, tokens * k / E per routed
    expert, tokens / ratio for the indexer keys (wk, on the compressed rows), 1 for the head; the
    embedding and engram tables are lookups, not GEMMs. For the host's bf16 GEMM rate at the
    prefill's shapes (`mm_seconds`)."""
    from dsneuron.graphs.config import ModelConfig
    from dsneuron.graphs.engram import engram_layout
    from dsneuron.graphs.spec import checkpoint_spec

    cfg = ModelConfig.from_dict(model)
    rows = engram_layout(cfg).num_embeddings if cfg.engram_layer_ids else ()
    out: dict[tuple[int, int, int], int] = {}
    for name, spec in checkpoint_spec(cfg, rows).items():
        if len(spec.shape) != 2 or name.startswith("mtp.") or not name.endswith((".weight", "_fn")) \
                or name == "embed.weight" or ".engram.embed." in name or name.endswith(("q_weight", "k_weight")):
            continue
        n, k = spec.shape
        k *= 2 if spec.dtype == "I8" else 1  # FP4 packs two values a byte
        m = tokens
        if name == "head.weight":
            m = 1
        elif ".ffn.experts." in name:
            m = max(1, round(tokens * model["n_activated_experts"] / model["n_routed_experts"]))
        elif ".indexer.wk." in name:
            m = max(1, tokens // max(1, model["compress_ratios"][int(name.split(".")[1])]))
        out[(m, k, n)] = out.get((m, k, n), 0) + 1
    return out


def mm_seconds(shapes: dict[tuple[int, int, int], int], repeats: int) -> tuple[float, float]:
    """(seconds, FLOPs) of torch.mm in bf16 (the host BLAS, fp32 accumulation) over `shapes`
    ({(M, K, N): count}), each shape's median of `repeats` calls times its count."""
    import torch

    from dsneuron.bench.eager import median_seconds

    seconds = flops = 0.0
    for (m, k, n), count in shapes.items():
        a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
        torch.mm(a, b)
        seconds += count * median_seconds(lambda: torch.mm(a, b), repeats)
        flops += count * 2.0 * m * k * n
    return seconds, flops


def mm_share(rate: float, c: dict) -> str:
    """`rate` (GFLOP/s) as a share of torch.mm bf16 measured in the same run (`c`: a _measure_bundle
    result), or, where torch.mm bf16 runs below the fp32 FMA peak, a note instead: such a host has
    no bf16 dot product (an AVX2-only CPU: about 1 GFLOP/s measured on one), so the share would
    compare against a fallback, not against the host's bf16 rate."""
    mm = c["mm_bf16_gflops"]
    if mm < c["fma_peak_gflops"]:
        return f"no bf16 GEMM on this host (torch.mm bf16 {mm:.0f}, below the FMA peak)"
    return f"{rate / mm * 100:.0f}% of torch.mm bf16 ({mm:.0f})"


def _measure_bundle(args: dict) -> dict:
    import torch

    from dsneuron.kernels_nki.host_limits import peak_gflops, stream_gbs
    from dsneuron.runtime_min.session import Session

    t0 = time.perf_counter()
    session = Session.load(args["bundle"])
    load_s = time.perf_counter() - t0
    prefill = {}
    for ids in args["prompts"]:
        session.teacher_forced(ids, len(ids))  # loads the executables
        prefill[len(ids)] = statistics.median(session.teacher_forced(ids, len(ids))[0].seconds for _ in range(args["repeats"]))
    long = args["prompts"][-1]
    steps = session.teacher_forced(long + args["decode_ids"], len(long))
    rss = _peak_rss_bytes()  # before the bandwidth probe's 1 GiB
    # the per-stage tables: one more run of the longest prompt and its decode steps, timed by stage
    timers = session.runner.stage_timers()
    timed = session.teacher_forced(long + args["decode_ids"], len(long))
    buckets = {(b.kind, b.batch, b.length): b for b in session.manifest.buckets}
    stages = {}
    for (kind, batch, length), seconds in timers.items():
        if not seconds:
            continue
        bucket = buckets[(kind, batch, length)]
        per = len(timed) - 1 if kind == "decode" else 1
        nbytes = stage_read_bytes(bucket, session.runner.weights, args["model"]) if kind == "decode" else None
        stages[kind] = {"bucket": f"{kind} b{batch} s{length}", "rows": by_stage_kind(bucket, seconds, per, nbytes),
                        "step_s": statistics.median(s.seconds for s in timed[1:]) if kind == "decode" else timed[0].seconds}
    mm_s, mm_flops = mm_seconds(gemm_shapes(args["model"], len(long)), args["repeats"])
    return {"load_s": load_s, "prefill_s": prefill, "decode_s": statistics.median(s.seconds for s in steps[1:]),
            "threads": torch.get_num_threads(), "peak_rss": rss, "read_gbs": stream_gbs(5), "stages": stages,
            "mm_bf16_gflops": mm_flops / mm_s / 1e9, "fma_peak_gflops": peak_gflops(3)}


def _measure_batches(args: dict) -> dict:
    from dsneuron.bench.serve import decode_step_times

    return {"decode_step_s": decode_step_times(Path(args["bundle"]), args["repeats"])}


def _measure_eager(args: dict) -> dict:
    from dsneuron.compiler.config import load_config
    from dsneuron.bench.eager import eager_timings
    from dsneuron.graphs.golden import Golden

    cfg, ccfg, _ = load_config(args["config"])
    golden = Golden(cfg, Path(args["checkpoint"]), ccfg.max_seq_len)
    out = eager_timings(golden, args["prompts"], args["decode_ids"], args["repeats"])
    out["peak_rss"] = _peak_rss_bytes()
    return out


_CHILDREN = {"compile": _measure_compile, "bundle": _measure_bundle, "eager": _measure_eager,
             "batches": _measure_batches}


def _child(kind: str, args: dict, env: dict[str, str] | None = None) -> dict:
    """Run one measurement in a fresh interpreter (with `env` added); returns its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        req, res = Path(tmp) / "args.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(args))
        subprocess.run([sys.executable, "-m", "dsneuron.bench.bundle", "--child", kind, str(req), str(res)], check=True,
                       env={**os.environ, **(env or {})})
        out = json.loads(res.read_text())
    for key in ("prefill_s", "decode_step_s"):
        if key in out:
            out[key] = {int(k): v for k, v in out[key].items()}
    return out


def _cold_compile(config: str, work: Path, name: str, numerics: str | None = None) -> dict:
    """Compile `config` into work/<name> from an empty dsneuron cache (its checkpoints kept) and a
    fresh Inductor cache, in kernel numerics `numerics` (None: the config's); returns the child's
    figures plus the cache folders used."""
    cache = work / f"cache-{name}"
    for sub in ("entries", "aliases"):
        shutil.rmtree(cache / sub, ignore_errors=True)
    inductor = work / f"inductor-{name}-{uuid.uuid4().hex[:8]}"
    args = {"config": config, "cache": str(cache), "out": str(work / name), **({"numerics": numerics} if numerics else {})}
    return {**_child("compile", args, {"TORCHINDUCTOR_CACHE_DIR": str(inductor)}), "cache": str(cache),
            "inductor": str(inductor)}


def run(config: str, work: Path, repeats: int, n_decode: int, console: Console,
        names: tuple[str, ...] = ("short", "medium", "long"), doubled: bool = True,
        batch_sizes: tuple[int, ...] = (1, 2, 4, 8), eager: bool = True, numerics: tuple[str, ...] = ()) -> dict:
    """The whole benchmark (module docstring); returns every figure as plain data. doubled: also
    time the cold compile of `doubled_layers`; batch_sizes: the decode batch buckets of item 5
    (empty: skipped); eager: also time the eager golden model (item 3; at V4.1 widths it holds
    float64 weight copies and takes minutes a prompt); numerics: the kernel numerics to measure,
    the first as the main figures ((): the config's only). "modes" holds each one's compile,
    bundle and batch figures."""
    from dsneuron.bench.serve import compile_with
    from dsneuron.compiler.buckets import PlannedBucket
    from dsneuron.compiler.config import load_config
    from dsneuron.compiler.default_prompts import default_prompts
    from dsneuron.compiler.model_steps import checkpoint_for
    from dsneuron.compiler.placement import Parallel
    from dsneuron.compiler.plan import count_flops
    from dsneuron.graphs.tokenizer import load_tokenizer

    model_cfg, compile_cfg, raw = load_config(config)
    numerics = numerics or (compile_cfg.numerics,)
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = checkpoint_for(model_cfg, compile_cfg, work / "cache-bundle")
    if doubled:
        doubled_path = work / f"{model_cfg.n_layers * 2}-layer.json"
        doubled_path.write_text(json.dumps({"model": doubled_layers(model_cfg.to_dict()), "compile": compile_cfg.to_dict()}))
        cfg2, ccfg2, _ = load_config(str(doubled_path))
        checkpoint_for(cfg2, ccfg2, work / "cache-doubled")  # made before its compile is timed

    console.print(f"compiling cold ({numerics[0]} numerics) ...")
    cold = _cold_compile(config, work, "bundle", numerics[0])
    console.print("compiling warm ...")
    warm = _child("compile", {"config": config, "cache": cold["cache"], "out": str(work / "bundle-warm"),
                              "numerics": numerics[0]}, {"TORCHINDUCTOR_CACHE_DIR": cold["inductor"]})
    cold2 = None
    if doubled:
        console.print(f"compiling the {cfg2.n_layers}-layer config cold ...")
        cold2 = _cold_compile(str(doubled_path), work, "doubled")

    tok = load_tokenizer()
    prompts = [[model_cfg.bos_token_id] + tok.encode(text, add_special_tokens=False).ids for name, text in default_prompts() if name in names]
    decode_ids = tok.encode(" The end of the story is near, and the ship sails on through the night."
                            " Nobody on the quay", add_special_tokens=False).ids[:n_decode]
    args = {"config": config, "checkpoint": str(checkpoint), "bundle": str(work / "bundle"), "prompts": prompts,
            "decode_ids": decode_ids, "repeats": repeats, "model": model_cfg.to_dict()}
    def batch_steps(mode: str, cache: str, name: str) -> dict[int, float]:
        if not batch_sizes:
            return {}
        over = {"batch_sizes": list(batch_sizes), "prefill_seq_lens": [min(compile_cfg.prefill_seq_lens or [128])],
                "chunked_prefill": False, "numerics": mode}
        console.print(f"compiling decode batch buckets {list(batch_sizes)}, {mode} numerics (cache warm for batch 1) ...")
        bundle_b = compile_with(config, work / name, over, console, cache_dir=Path(cache))
        return _child("batches", {"bundle": str(bundle_b), "repeats": max(repeats, 5)})["decode_step_s"]

    console.print(f"measuring the bundle ({numerics[0]} numerics) ...")
    compiled = _child("bundle", args)
    eager_r = None
    if eager:
        console.print("measuring the eager golden model ...")
        eager_r = _child("eager", args)
    batches = batch_steps(numerics[0], cold["cache"], "bundle-batches")
    modes = {numerics[0]: {"compile_cold_s": cold["seconds"], "compiled": compiled, "decode_step_s": batches}}
    for mode in numerics[1:]:
        # the same checkpoint, made before any timing: its folder shared with the first cache's
        cache_m = work / f"cache-bundle-{mode}"
        cache_m.mkdir(exist_ok=True)
        if not (cache_m / "checkpoints").exists():
            (cache_m / "checkpoints").symlink_to(work / "cache-bundle" / "checkpoints")
        console.print(f"compiling cold ({mode} numerics) ...")
        cold_m = _cold_compile(config, work, f"bundle-{mode}", mode)
        console.print(f"measuring the bundle ({mode} numerics) ...")
        modes[mode] = {"compile_cold_s": cold_m["seconds"], "compiled": _child("bundle", {**args, "bundle": str(work / f"bundle-{mode}")}),
                       "decode_step_s": batch_steps(mode, cold_m["cache"], f"bundle-batches-{mode}")}
        switch = fast_switch() if mode == "fast" else None
        if switch:
            # the kernels are the runtime's: the same bundles, measured again without the layer
            column, env = switch
            console.print(f"measuring the fast bundles as {column!r} ({', '.join(f'{k}={v}' for k, v in env.items())}) ...")
            batches_b = work / "bundle-batches-fast"
            modes[column] = {
                "compile_cold_s": cold_m["seconds"],
                "compiled": _child("bundle", {**args, "bundle": str(work / "bundle-fast")}, env),
                "decode_step_s": _child("batches", {"bundle": str(batches_b), "repeats": max(repeats, 5)}, env)[
                    "decode_step_s"] if batch_sizes else {}}
    long = len(prompts[-1])
    flops = sum(count_flops(model_cfg, Parallel(1, 1), compile_cfg.max_seq_len,
                            PlannedBucket("prefill", 1, long, compile_cfg.max_seq_len))[0])
    return {"config": config, "layers": model_cfg.n_layers, "layers_doubled": cfg2.n_layers if doubled else None,
            "compile_cold_s": cold["seconds"], "compile_warm_s": warm["seconds"],
            "compile_doubled_cold_s": cold2["seconds"] if cold2 else None,
            "compiled": compiled, "eager": eager_r, "decode_bytes": decode_bytes(checkpoint, model_cfg.to_dict()),
            "prefill_flops": {long: flops}, "decode_step_s": batches,
            "bundle_bytes": _dir_bytes(work / "bundle"),
            "weights_bytes": sum(f.stat().st_size for f in (work / "bundle").glob("weights*.safetensors")),
            "checkpoint_bytes": _dir_bytes(checkpoint), "host_cores": os.cpu_count(), "modes": modes}


def report(r: dict, console: Console) -> None:
    """Print the figures of `run`: the summary table, then the per-stage tables and the decode
    batch table."""
    c, e = r["compiled"], r["eager"]
    t = Table(title=f"dsneuron bench: {r['config']} ({c['threads']} threads compiled, "
                    f"{e['threads'] if e else 'no'} eager, {r['host_cores']} cores)")
    for col in ("figure", "compiled", "eager golden", "ratio"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    t.add_row("compile, cold", f"{r['compile_cold_s']:.1f} s", "", "")
    t.add_row("compile, warm", f"{r['compile_warm_s']:.1f} s", "", "")
    if r["compile_doubled_cold_s"]:
        t.add_row(f"compile, cold, {r['layers_doubled']} layers", f"{r['compile_doubled_cold_s']:.1f} s", "",
                  f"{r['compile_doubled_cold_s'] / r['compile_cold_s']:.2f}x of {r['layers']} layers")
    t.add_row("bundle load", f"{c['load_s']:.2f} s", "", "")
    for n, s in c["prefill_s"].items():
        t.add_row(f"prefill {n} tokens", f"{s * 1e3:.0f} ms", f"{e['prefill_s'][n] * 1e3:.0f} ms" if e else "",
                  f"{e['prefill_s'][n] / s:.2f}x" if e else "")
    for n, flops in r["prefill_flops"].items():
        rate = flops / c["prefill_s"][n] / 1e9
        t.add_row(f"prefill {n}: {flops / 1e9:.0f} GFLOP", f"{rate:.0f} GFLOP/s",
                  f"torch.mm bf16 {c['mm_bf16_gflops']:.0f}, fp32 FMA peak {c['fma_peak_gflops']:.0f}",
                  f"{mm_share(rate, c)}, {rate / c['fma_peak_gflops'] * 100:.0f}% of FMA")
    t.add_row("decode", f"{1 / c['decode_s']:.2f} tok/s", f"{1 / e['decode_s']:.2f} tok/s" if e else "",
              f"{e['decode_s'] / c['decode_s']:.2f}x" if e else "")
    ideal = r["decode_bytes"] / (c["read_gbs"] * 1e9)
    t.add_row("decode roofline", f"{ideal * 1e3:.1f} ms/token", f"{r['decode_bytes'] / 1e6:.0f} MB at {c['read_gbs']:.1f} GB/s",
              f"{ideal / c['decode_s'] * 100:.0f}% reached")
    gib = 2.0**30
    t.add_row("peak RSS", f"{c['peak_rss'] / gib:.2f} GiB", f"{e['peak_rss'] / gib:.2f} GiB" if e else "",
              f"{c['peak_rss'] / r['checkpoint_bytes']:.2f}x checkpoint")
    t.add_row("bundle size", f"{r['bundle_bytes'] / gib:.2f} GiB", f"checkpoint {r['checkpoint_bytes'] / gib:.2f} GiB",
              f"{r['bundle_bytes'] / r['checkpoint_bytes']:.2f}x")
    console.print(t)
    report_stages(c, console)
    if r["decode_step_s"]:
        t = Table(title="decode step alone at each batch bucket")
        for col in ("batch", "ms per step", "rows/s", "vs batch 1"):
            t.add_column(col, justify="right")
        one = r["decode_step_s"][min(r["decode_step_s"])]
        for b, s in sorted(r["decode_step_s"].items()):
            t.add_row(str(b), f"{s * 1e3:.1f}", f"{b / s:.1f}", f"{one * b / s:.2f}x")
        console.print(t)


def report_stages(c: dict, console: Console, prefix: str = "") -> None:
    """The per-stage tables of one bundle measurement `c` (run's "compiled"), titles led by `prefix`."""
    for kind, st in c["stages"].items():
        decode = kind == "decode"
        t = Table(title=f"{prefix}{st['bucket']}: time by stage kind ({'per token' if decode else 'one call'}, "
                        f"step {st['step_s'] * 1e3:.1f} ms)")
        cols = ["stage kind", "stages", "ms", "share"] + (["MB read", f"roofline ms at {c['read_gbs']:.1f} GB/s", "reached"]
                                                           if decode else [])
        for col in cols:
            t.add_column(col, justify="left" if col == "stage kind" else "right")
        for row in st["rows"]:
            cells = [row["kind"], str(row["stages"]), f"{row['s'] * 1e3:.2f}", f"{row['s'] / st['step_s'] * 100:.0f}%"]
            if decode:
                roof = row["bytes"] / (c["read_gbs"] * 1e9)
                cells += [f"{row['bytes'] / 1e6:.1f}", f"{roof * 1e3:.2f}", f"{roof / row['s'] * 100:.0f}%" if row["s"] else ""]
            t.add_row(*cells)
        inside = sum(row["s"] for row in st["rows"])
        t.add_row("outside the stages", "", f"{(st['step_s'] - inside) * 1e3:.2f}", f"{(st['step_s'] - inside) / st['step_s'] * 100:.0f}%")
        console.print(t)


def report_modes(r: dict, console: Console) -> None:
    """The kernel numerics of `run` side by side (nothing when it measured one), then the per-stage
    tables of each mode after the first."""
    modes = r.get("modes") or {}
    if len(modes) < 2:
        return
    t = Table(title=f"numerics side by side: {r['config']}, {r['host_cores']} cores")
    t.add_column("figure")
    for mode in modes:
        t.add_column(mode, justify="right")
    t.add_row("compile, cold", *(f"{m['compile_cold_s']:.1f} s" for m in modes.values()))
    first = next(iter(modes.values()))["compiled"]
    for n in first["prefill_s"]:
        t.add_row(f"prefill {n} tokens", *(f"{m['compiled']['prefill_s'][n] * 1e3:.0f} ms" for m in modes.values()))
    for n, flops in r["prefill_flops"].items():
        cells = []
        for m in modes.values():
            c = m["compiled"]
            rate = flops / c["prefill_s"][n] / 1e9
            cells.append(f"{rate:.0f} GFLOP/s = {mm_share(rate, c)}, "
                         f"{rate / c['fma_peak_gflops'] * 100:.0f}% of FMA peak ({c['fma_peak_gflops']:.0f})")
        t.add_row(f"prefill {n}: {flops / 1e9:.0f} GFLOP", *cells)
    cells = []
    for m in modes.values():
        c = m["compiled"]
        ideal = r["decode_bytes"] / (c["read_gbs"] * 1e9)
        cells.append(f"{1 / c['decode_s']:.2f} tok/s = {ideal / c['decode_s'] * 100:.0f}% of the "
                     f"{r['decode_bytes'] / 1e6:.0f} MB roofline at {c['read_gbs']:.1f} GB/s")
    t.add_row("decode", *cells)
    for b in sorted(next(iter(modes.values()))["decode_step_s"]):
        cells = []
        for m in modes.values():
            steps = m["decode_step_s"]
            if b not in steps:
                cells.append("")
                continue
            one = steps[min(steps)]
            cells.append(f"{b / steps[b]:.1f} rows/s, {one * b / steps[b]:.2f}x batch 1")
        t.add_row(f"decode step, batch {b}", *cells)
    console.print(t)
    for mode, m in list(modes.items())[1:]:
        report_stages(m["compiled"], console, f"{mode} numerics: ")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", help="packaged config name or JSON path")
    ap.add_argument("--work", type=Path, default=Path(".bench"), help="bundles, caches and checkpoints of the run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", type=int, default=16, help="decode steps after the longest prompt")
    ap.add_argument("--prompts", default="short,medium,long", help="which shipped prompts (comma-separated)")
    ap.add_argument("--no-doubled", action="store_true", help="skip the doubled-layer cold compile")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager golden model's timings")
    ap.add_argument("--batch-sizes", default="1,2,4,8", help="decode batch buckets timed (comma-separated; '' skips)")
    ap.add_argument("--numerics", default="exact,fast", help="kernel numerics measured side by side, the first "
                    "as the main figures; one mode (e.g. exact) measures only it [default: exact,fast]")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        kind, req, res = a.child
        Path(res).write_text(json.dumps(_CHILDREN[kind](json.loads(Path(req).read_text()))))
        return
    console = Console(stderr=True)
    batch_sizes = tuple(int(b) for b in a.batch_sizes.split(",") if b)
    from dsneuron.graphs.config import NUMERICS_MODES

    numerics = tuple(m for m in a.numerics.split(",") if m)
    bad = [m for m in numerics if m not in NUMERICS_MODES]
    if bad or len(set(numerics)) != len(numerics):
        ap.error(f"--numerics: a comma-separated list of distinct modes out of {', '.join(NUMERICS_MODES)}, got "
                 f"{a.numerics!r}")
    r = run(a.config, a.work, a.repeats, a.decode, console, tuple(a.prompts.split(",")), not a.no_doubled, batch_sizes,
            not a.no_eager, numerics)
    report(r, Console())
    report_modes(r, Console())
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
