"""The `dsneuron` command line (typer). Every command is a thin wrapper over a Python API.

Exit codes and messages: user errors (`dsneuron.UserError`) print one line naming the problem and
exit with code 2; Ctrl-C prints "interrupted" and exits with 130; SIGTERM raises `Terminated`
inside the running command, so it unwinds through the same cleanup as an exception (a compile or
make-checkpoint leaves no temporary folder), then prints "terminated" and exits with 143 (128 + 15).

Output: on a terminal rich wraps at the terminal width; when stdout/stderr is a pipe or a file (and
$COLUMNS is unset) the consoles are PIPE_WIDTH columns wide and do not soft-wrap, so tables and
long messages are not broken mid-line at rich's default of 80 columns.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from dsneuron import UserError
from dsneuron.disk import check_output_file
from dsneuron.runtime_min.sharded import RankFailed

#: the metavar of an on/off flag: none, where typer's help would print "<bool>" after a flag that takes no value
FLAG = ""

#: console width when the output is not a terminal (see the module docstring)
PIPE_WIDTH = 512


class Terminated(SystemExit):
    """Raised by the SIGTERM handler inside a running command; a SystemExit, so `except Exception`
    blocks do not swallow it while `finally` and `except BaseException` cleanups run."""


def make_console(stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr): rich's defaults on a terminal or with $COLUMNS set,
    else PIPE_WIDTH columns without soft wrapping (module docstring)."""
    stream = sys.stderr if stderr else sys.stdout
    piped = not stream.isatty() and not os.environ.get("COLUMNS")
    return Console(stderr=stderr, width=PIPE_WIDTH if piped else None, soft_wrap=piped)


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Ahead-of-time compiler and minimal runtime for DeepSeek-V4.x models (cpu and neuron targets).")
console = make_console()
err_console = make_console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from dsneuron import __version__

        console.print(f"dsneuron {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, metavar=FLAG,
                                          help="print the version and exit")) -> None:
    """Ahead-of-time compiler and minimal runtime for DeepSeek-V4.x models (cpu and neuron targets)."""


@app.command("make-checkpoint")
def make_checkpoint_cmd(
    config: str = typer.Option(..., "--config", help="config JSON path or packaged name (tiny, micro)"),
    out: Path = typer.Option(..., "--out", help="output folder (must not exist unless --force)"),
    seed: int = typer.Option(0, "--seed", help="random seed; the same seed gives byte-identical files"),
    force: bool = typer.Option(False, "--force", metavar=FLAG, help="replace an existing output folder"),
) -> None:
    """Write a deterministic random checkpoint in the HF layout of V4.1-Flash."""
    from dsneuron.compiler.config import load_config
    from dsneuron.graphs.checkpoint_make import make_checkpoint

    model, _, _ = load_config(config)
    make_checkpoint(model, out, seed=seed, force=force, console=console)


@app.command("inspect-checkpoint")
def inspect_checkpoint_cmd(
    path: Path = typer.Argument(..., help="checkpoint folder"),
    stats: bool = typer.Option(False, "--stats", metavar=FLAG, help="also run the model and report numeric health"),
) -> None:
    """Validate a checkpoint and print its tensor families, dtypes, shapes and bytes."""
    from dsneuron.graphs.checkpoint_report import inspect_checkpoint

    inspect_checkpoint(path, stats=stats, console=console)


def _draft_checkpoint_option() -> Any:
    """The --draft-checkpoint option of the commands that speculate (run, serve)."""
    return typer.Option(None, "--draft-checkpoint", help="the checkpoint folder whose mtp.* (DSpark) weights draft, "
                                                         "instead of the bundle's own (eager, not compiled)")


def _verify_key_option() -> Any:
    """The --verify-key option of the commands that open a bundle (run, inspect, compare)."""
    from dsneuron.runtime_min.bundle.signing import VERIFY_KEY_ENV

    return typer.Option(None, "--verify-key", envvar=VERIFY_KEY_ENV,
                        help="PEM public key: refuse the bundle unless it is signed by its private key and unchanged "
                             f"since (env {VERIFY_KEY_ENV})")


def _int_list(text: str | None, flag: str) -> list[int] | None:
    """"1,2,4" -> [1, 2, 4]; None stays None; UserError naming the flag otherwise."""
    if text is None:
        return None
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values:
        raise UserError(f"{flag}: expected comma-separated integers such as 128,512, got {text!r}")
    return values


@app.command("compile")
def compile_cmd(
    config: Optional[str] = typer.Option(None, "--config", help="config JSON path or packaged name (tiny, micro)"),
    checkpoint: Optional[Path] = typer.Option(
        None, "--checkpoint", help="checkpoint folder: the model config comes from its inference/config.json (or HF "
                                   "config.json), the bucket plan from the flags below"),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="with --checkpoint: context capacity "
                                                                          "[default: 4096]"),
    batch_sizes: Optional[str] = typer.Option(None, "--batch-sizes", help="with --checkpoint: e.g. 1,4 [default: 1]"),
    prefill_lens: Optional[str] = typer.Option(None, "--prefill-lens", help="with --checkpoint: prefill bucket lengths, "
                                                                            "e.g. 128,1024 [default: generated]"),
    decode_lens: Optional[str] = typer.Option(None, "--decode-lens", help="with --checkpoint: decode context lengths "
                                                                          "[default: max-seq-len]"),
    out: Path = typer.Option(Path("artifacts"), "--out", help="bundle folder (must not hold a bundle unless --force)"),
    target: str = typer.Option("cpu", "--target", help="cpu (AOTInductor on this host) or neuron (NEFFs: needs the "
                                                       "Neuron SDK; StableHLO modules with --stablehlo-only)"),
    force: bool = typer.Option(False, "--force", metavar=FLAG, help="replace an existing bundle folder, every file in it (kept intact until the new one is complete)"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="compile cache (default $DSNEURON_CACHE_DIR or ~/.cache/dsneuron)"),
    probes: bool = typer.Option(False, "--probes", metavar=FLAG, help="also output every stage tensor, for the stage-by-stage `dsneuron compare`"),
    sign_key: Optional[Path] = typer.Option(None, "--sign-key", help="PEM elliptic-curve private key: sign the bundle "
                                                                    "(OpenSSF model-signing) before it is moved into place"),
    stablehlo_only: bool = typer.Option(False, "--stablehlo-only", metavar=FLAG, help="with --target neuron: stop at "
                                        "each bucket's StableHLO module (torch-mlir, no Neuron SDK): the input of "
                                        "neuronx-cc; `run` and `compare` execute it on XLA:CPU as a check"),
    indexer: Optional[str] = typer.Option(None, "--indexer", help="indexer scores: official (the reference's bf16 "
                                          "expression) or kernel (the FP4 MQA-logits op, the NKI kernel on neuron) "
                                          "[default: the config's, official]"),
    numerics: Optional[str] = typer.Option(None, "--numerics", help="exact (every GEMM in one fixed fp32 order: "
                                           "bit-identical to the golden on every host) or fast (bf16 dot products, "
                                           "deterministic on one host; cpu target) [default: the config's, exact]"),
    speculative: Optional[str] = typer.Option(None, "--speculative", help="none, or dspark: store the model's DSpark "
                                              "drafter (mtp.*) in the bundle and compile its verify and draft "
                                              "buckets, for `run`/`serve --speculative-tokens K` [default: the "
                                              "config's, none]"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel ranks (the world size): 2 or more writes a sharded bundle, "
                                           "one rank bundle per process of `dsneuron run` (cpu target only)"),
    ep: Optional[int] = typer.Option(None, "--ep", help="with --tp: expert-parallel groups of the MoE [default: tp, "
                                                        "each rank its own experts]"),
) -> None:
    """Compile every bucket of a config (or of a checkpoint folder) into a self-contained bundle."""
    from dsneuron.compiler import compile as pipeline
    from dsneuron.compiler.buckets import plan_buckets
    from dsneuron.compiler.bundle_writer import check_output
    from dsneuron.compiler.config import (check_indexer, check_numerics, check_speculative, check_speculative_plan,
                                          checkpoint_config, load_config)
    from dsneuron.runtime_min.bundle.bundle import check_target

    if numerics is not None:
        check_numerics(numerics, "--numerics")  # fail fast, before reading anything
    if speculative is not None:
        check_speculative(speculative, "--speculative")
    par = _parallel_flags(tp, ep, target, probes, stablehlo_only)
    if stablehlo_only:  # fail fast, before reading anything
        from dsneuron.compiler.compile import check_stablehlo_only

        check_stablehlo_only(target)
    else:
        check_target(target)
    if sign_key is not None:
        from dsneuron.runtime_min.bundle.signing import check_private_key

        check_private_key(sign_key)
    plan_flags = {"--max-seq-len": max_seq_len, "--batch-sizes": batch_sizes, "--prefill-lens": prefill_lens,
                  "--decode-lens": decode_lens}
    if (config is None) == (checkpoint is None):
        raise UserError("give exactly one of --config (a JSON config or a packaged name) and --checkpoint (a "
                        "checkpoint folder)")
    if config is not None:
        given = [flag for flag, v in plan_flags.items() if v is not None]
        if given:
            raise UserError(f"{given[0]} goes with --checkpoint; with --config the bucket plan is the config "
                            "file's \"compile\" section")
        model_cfg, compile_cfg, _ = load_config(config)
    else:
        model_cfg, compile_cfg = checkpoint_config(
            checkpoint, max_seq_len, _int_list(batch_sizes, "--batch-sizes"), _int_list(prefill_lens, "--prefill-lens"),
            _int_list(decode_lens, "--decode-lens"))
    if indexer is not None:
        compile_cfg = dataclasses.replace(compile_cfg, indexer=check_indexer(indexer, "--indexer"))
    if numerics is not None:
        compile_cfg = dataclasses.replace(compile_cfg, numerics=numerics)
    if compile_cfg.numerics != "exact" and target != "cpu":
        raise UserError(f"numerics {compile_cfg.numerics}: the fast kernels are the cpu target's (the neuron target "
                        "has one numerics)")
    if speculative is not None:
        compile_cfg = dataclasses.replace(compile_cfg, speculative=speculative)
    check_speculative_plan(compile_cfg, model_cfg, "neuron-stablehlo" if stablehlo_only else target, tp)
    # before the checkpoint is made or loaded, which can take minutes: compile_bundle repeats both
    plan_buckets(compile_cfg, model_cfg)
    check_output(out, force)
    if par is not None:
        from dsneuron.compiler.sharded_bundle import compile_sharded_bundle

        compile_sharded_bundle(model_cfg, compile_cfg, out, par, cache_dir=cache_dir, force=force, console=console,
                               sign_key=sign_key)
        return
    parts = pipeline.build_steps_for_config(model_cfg, compile_cfg, cache_dir, probes=probes, target=target)
    pipeline.compile_bundle(model_cfg, compile_cfg, out, parts, target=target, force=force, cache_dir=cache_dir,
                            console=console, sign_key=sign_key, stablehlo_only=stablehlo_only)


def _parallel_flags(tp: int, ep: int | None, target: str, probes: bool, stablehlo_only: bool):
    """The Parallel plan of compile's --tp/--ep, None for one process; UserError for flags that do not
    go together (the model's limits are checked once it is known: parallel.py check_shardable)."""
    from dsneuron.compiler.placement import Parallel

    if tp < 1:
        raise UserError(f"--tp must be a positive integer (the ranks of a sharded bundle), got {tp}")
    if tp == 1:
        if ep not in (None, 1):
            raise UserError(f"--ep {ep} needs --tp 2 or more: expert-parallel groups live inside the tp ranks")
        return None
    if target != "cpu" or stablehlo_only:
        raise UserError(f"--tp {tp}{' with --stablehlo-only' if stablehlo_only else ''}: sharded bundles are made for the cpu "
                        "target only (the neuron target's NxD parallel layers are not written yet)")
    if probes:
        raise UserError(f"--tp {tp} with --probes: a sharded bundle has no probe outputs; `dsneuron compare` a "
                        "one-process bundle")
    ep = tp if ep is None else ep
    if ep < 1:
        raise UserError(f"--ep must be a positive integer dividing --tp {tp}, got {ep}")
    return Parallel(tp, ep)


#: `run`'s flags, by the name runtime_min/core/checks.py gives each generation parameter
RUN_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
             "seed": "--seed"}


@app.command("run")
def run_cmd(
    bundle: Path = typer.Argument(..., help="bundle folder written by `dsneuron compile`"),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="prompt text (or --prompts-file)"),
    prompts_file: Optional[Path] = typer.Option(
        None, "--prompts-file", help="prompts, one a line (a line starting with { is read as JSON {\"prompt\": ...}), any number: batched over the "
                                     "bundle's batch buckets (continuous batching), each as it would run alone; prints "
                                     "one JSON line {\"prompt\", \"completion\"} per prompt, in input order"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="tokens to generate at most (stops earlier at EOS)"),
    temperature: float = typer.Option(0.0, "--temperature",
                                      help="0 = greedy; any other finite value > 0 samples from softmax((logits - max) / T) "
                                           "in float64, so a tiny T tends to greedy and a huge one to uniform"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling mass in (0, 1]"),
    seed: Optional[int] = typer.Option(None, "--seed", help="seed of the sampler, 0..2**64-1 (default: fresh entropy)"),
    stats: bool = typer.Option(False, "--stats", metavar=FLAG, help="print prefill time, time to first token and decode tokens/s "
                                                      "to stderr"),
    speculative_tokens: int = typer.Option(0, "--speculative-tokens",
                                           help="draft this many tokens a step with DSpark and verify them in one "
                                                "call of the verify bucket (0 = off; at most the model's "
                                                "dspark_block_size; one --prompt, not --prompts-file; a bundle "
                                                "compiled with --speculative dspark, or --draft-checkpoint)"),
    draft_checkpoint: Optional[Path] = _draft_checkpoint_option(),
    verify_key: Optional[Path] = _verify_key_option(),
) -> None:
    """Verify a bundle, generate from a prompt and stream the text to stdout."""
    from dsneuron.runtime_min.bundle.bundle import is_stablehlo
    from dsneuron.runtime_min.core.checks import check_generation
    from dsneuron.runtime_min.session import Session
    from dsneuron.runtime_min.sharded import launch, read_sharded

    if (prompt is None) == (prompts_file is None):
        raise UserError("give exactly one of --prompt TEXT and --prompts-file FILE")
    # the checks that need no bundle come before its load (seconds for a large one)
    check_generation(max_new_tokens, temperature, top_p, seed, names=RUN_FLAGS)
    _check_speculation_flags(speculative_tokens, draft_checkpoint)
    if speculative_tokens and prompt is None:
        raise UserError("--speculative-tokens runs one --prompt (not --prompts-file)")
    if speculative_tokens and read_sharded(bundle) is not None:
        raise UserError("--speculative-tokens: a sharded bundle (--tp) does not speculate; run a one-process bundle")
    if speculative_tokens:
        _run_speculative(bundle, verify_key, prompt, max_new_tokens, temperature, top_p, seed, stats,
                         speculative_tokens, draft_checkpoint)
        return
    prompts = read_prompts_file(prompts_file) if prompts_file is not None else None
    job = {"prompt": prompt, "prompts": prompts, "max_new_tokens": max_new_tokens, "temperature": temperature,
           "top_p": top_p, "seed": seed, "stats": stats}
    sharded = read_sharded(bundle)
    if sharded is None:
        world = os.environ.get("WORLD_SIZE", "1")
        if world != "1":
            raise UserError(f"{bundle} is a one-process bundle, launched with WORLD_SIZE={world} (torchrun): run it "
                            "without torchrun, or compile a sharded bundle with --tp")
        session = Session.load(bundle, verify_key)
        if is_stablehlo(session.manifest):
            _print("stderr", "running the bundle's StableHLO modules on XLA:CPU: a check of the neuron path, not Trainium")
        generate(session, _print, **job)
        return
    if seed is None and temperature > 0:  # every rank draws with rank 0's seed (runtime_min/sharded.py)
        job["seed"] = secrets.randbits(64)
    launch(bundle, sharded, generate, job, _print, verify_key)


def _run_speculative(bundle: Path, verify_key: Optional[Path], prompt: str, max_new_tokens: int, temperature: float,
                     top_p: float, seed: Optional[int], stats: bool, k: int, draft_checkpoint: Optional[Path]) -> None:
    """`run --speculative-tokens K`: one prompt, DSpark drafting K tokens a step (`_drafter`: the
    bundle's draft buckets, or eager), the bundle verifying (runtime_min/core/speculative.py). The
    drafter's weights: the bundle's own (`compile --speculative dspark`), or `draft_checkpoint`'s
    mtp.* when given."""
    import time

    from dsneuron.graphs.dspark import DSparkDrafter
    from dsneuron.runtime_min.session import Session

    session = Session.load(bundle, verify_key)
    drafter = _drafter(bundle, session, k, draft_checkpoint)
    t0 = time.perf_counter()
    text, spec = session.generate_speculative(prompt, max_new_tokens, drafter, k, temperature, top_p, seed)
    seconds = time.perf_counter() - t0
    _print("stdout", text + "\n")
    if stats:
        how = "eager" if isinstance(drafter, DSparkDrafter) else "its draft bucket"
        per = ", ".join(f"{a}/{n}" for a, n in zip(spec.per_position, spec.proposed))
        _print("stderr", f"speculative k={k}: {len(spec.accepted)} verify steps, mean acceptance length "
                         f"{spec.mean_acceptance:.2f} tokens a step (draft j kept/offered: {per}); verify "
                         f"{spec.verify_seconds:.3f} s, replay {spec.replay_seconds:.3f} s ({spec.replays} steps), drafter "
                         f"{spec.draft_seconds:.3f} s ({how}); {spec.tokens} tokens in {seconds:.3f} s, prefill "
                         f"included ({spec.tokens / seconds:.2f} tokens/s)")


def _check_speculation_flags(speculative_tokens: int, draft_checkpoint: Optional[Path]) -> None:
    """run's and serve's --speculative-tokens / --draft-checkpoint, before any bundle is read."""
    if speculative_tokens < 0:
        raise UserError(f"--speculative-tokens must be >= 0 (0 = off), got {speculative_tokens}")
    if draft_checkpoint is not None and not speculative_tokens:
        raise UserError("--draft-checkpoint is used only with --speculative-tokens K (K >= 1 drafts a verify)")


def _drafter(bundle: Path, session, k: int, draft_checkpoint: Optional[Path]):
    """The DSpark drafter for `run`/`serve --speculative-tokens k` on a loaded session: from
    `draft_checkpoint`'s mtp.* when given (graphs/dspark.py, eager), else a neuron bundle's draft
    buckets (runtime_min/core/drafter.py), else from the bundle's stored mtp.* tensors, eager
    (`compile --speculative dspark`; on the cpu target faster than its draft bucket); the eager
    one in GEMM order "fused" (fp32 GEMMs: its drafts never reach the output, and the golden's
    exact order costs several times more). UserError for a model without DSpark stages, k outside 1..block, a bundle
    that carries no drafter; BundleError for a stored drafter that does not load."""
    from dsneuron.graphs.config import ModelConfig
    from dsneuron.graphs.dspark import bundle_drafter, load_drafter
    from dsneuron.runtime_min.bundle.schema import BundleError
    from dsneuron.runtime_min.core.speculative import RunnerTarget

    cfg = ModelConfig.from_dict(session.manifest.model_config)
    if not cfg.n_mtp_layers:
        raise UserError(f"{bundle}: the model has no DSpark stages (n_mtp_layers = 0)")
    if not 1 <= k <= cfg.dspark_block_size:
        raise UserError(f"--speculative-tokens must be in 1..{cfg.dspark_block_size} (dspark_block_size), got {k}")
    if draft_checkpoint is None and session.runner.bundle.speculative != "dspark":
        raise UserError(f"--speculative-tokens: {bundle} carries no drafter; compile it with --speculative dspark, or "
                        "give --draft-checkpoint CKPT")
    RunnerTarget(session.runner)  # a bundle that cannot verify is refused before the drafter loads
    if draft_checkpoint is not None:
        return load_drafter(draft_checkpoint, cfg, session.max_capacity, order="fused")
    # the cpu target's draft bucket dequantises its FP8/FP4 projections every call, where the eager
    # drafter holds fp32 copies (and its head runs through the cpu kernel on the bundle's own head
    # layout): measured 0.61 s against 0.09 s a draft on tiny, so cpu drafts eagerly
    if session.manifest.target != "cpu" and any(b.kind == "draft" for b in session.manifest.buckets):
        from dsneuron.runtime_min.core.drafter import CompiledDrafter

        return CompiledDrafter(session.runner)
    try:
        return bundle_drafter(session.runner.bundle, cfg, session.max_capacity, order="fused",
                              weights=session.runner.weights)
    except ValueError as e:
        raise BundleError(f"{bundle}: its DSpark drafter does not load: {e}") from None


def _print(stream: str, text: str) -> None:
    if stream == "stdout":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        err_console.print(text, highlight=False, soft_wrap=True)


def generate(session, out, prompt: str | None, prompts: list[str] | None, max_new_tokens: int, temperature: float,
             top_p: float, seed: int | None, stats: bool) -> None:
    """What `dsneuron run` does with a loaded runtime_min Session: stream the completion of `prompt`,
    or one JSON line per prompt of `prompts` (through the scheduler, in input order), to
    out("stdout", text); with stats, the timings to out("stderr", text). Run by every rank of a
    sharded bundle (runtime_min/sharded.py)."""
    if prompts is None:
        session.generate(prompt, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                         stream=lambda _row, piece: out("stdout", piece))
        out("stdout", "\n")
    else:
        texts = session.generate(prompts, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
        for p, text in zip(prompts, texts):
            out("stdout", json.dumps({"prompt": p, "completion": text}, ensure_ascii=False) + "\n")
    if stats:
        out("stderr", session.last_stats.summary())


def read_prompts_file(path: Path) -> list[str]:
    """The prompts of a --prompts-file: UTF-8 text, one prompt a line; a line that starts with "{"
    is JSON with a string "prompt". Blank lines are skipped. Raises UserError naming the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"--prompts-file {path}: does not exist") from None
    except IsADirectoryError:
        raise UserError(f"--prompts-file {path}: is a folder, not a file") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--prompts-file {path}: not UTF-8 text (byte {e.start})") from None
    prompts = []
    # only \n (and \r\n) end a line: str.splitlines would also split at U+2028 and other separators
    for i, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"--prompts-file {path}, line {i}: not valid JSON ({e.msg})") from None
            if not isinstance(obj.get("prompt"), str):
                raise UserError(f"--prompts-file {path}, line {i}: a JSON line needs a string \"prompt\"")
            prompts.append(obj["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise UserError(f"--prompts-file {path}: holds no prompt")
    return prompts


#: `serve --prefix-cache-gib` default: a tiny state row is 1.4 MiB at its 1024-token capacity, so 2 GiB
#: keeps ~1,500 snapshots (a few per conversation: hundreds of conversations), a small part of the
#: host memory a model that fits this runtime needs anyway (docs/serving.md "Prefix cache")
PREFIX_CACHE_GIB = 2.0
#: the largest --prefix-cache-gib taken (a typo such as 1e9 fails instead of meaning "no bound")
MAX_PREFIX_CACHE_GIB = 4096.0


@app.command("serve")
def serve_cmd(
    bundle: Path = typer.Argument(..., help="bundle folder written by `dsneuron compile`"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free one, printed at start)"),
    max_queue: int = typer.Option(128, "--max-queue", help="requests waiting for a row at most; more are answered "
                                                          "HTTP 429"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DSNEURON_API_KEY",
                                          help="require `Authorization: Bearer KEY` on the /v1 routes (env "
                                               "DSNEURON_API_KEY)"),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="the model name clients send [default: the bundle folder's name]"),
    grace_period: float = typer.Option(30.0, "--grace-period", help="seconds from SIGTERM to exit: in-flight requests "
                                                                     "finish or are ended 2 s before it is over"),
    max_header_count: int = typer.Option(100, "--max-header-count", help="request headers at most; more are answered "
                                                                         "HTTP 431"),
    max_header_bytes: int = typer.Option(16384, "--max-header-bytes", help="bytes of request headers (names and "
                                                                           "values) at most; more are answered HTTP 431"),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="seconds a request may take from arrival "
                                                                           "(body included) to its end; then HTTP 408"),
    sse_keepalive: float = typer.Option(15.0, "--sse-keepalive", help="seconds of silence after which a stream gets "
                                                                      "an SSE comment line"),
    prefix_cache_gib: float = typer.Option(
        PREFIX_CACHE_GIB, "--prefix-cache-gib", help="GiB of prefix-cache snapshots kept (least recently used evicted "
                                                     "first); 0 turns the cache off"),
    speculative_tokens: int = typer.Option(0, "--speculative-tokens",
                                           help="draft this many tokens a step with DSpark for every request and verify "
                                                "them in one call of the verify bucket (0 = off; at most the model's "
                                                "dspark_block_size; a bundle compiled with --speculative dspark, or "
                                                "--draft-checkpoint)"),
    draft_checkpoint: Optional[Path] = _draft_checkpoint_option(),
    verify_key: Optional[Path] = _verify_key_option(),
) -> None:
    """Serve a bundle over the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics) with continuous batching over its batch buckets; SIGTERM drains and exits 0."""
    from dsneuron.runtime_min.serving.server import Limits
    from dsneuron.runtime_min.sharded import read_sharded

    limits = Limits(max_header_count, max_header_bytes, request_timeout, sse_keepalive)
    limits.check()
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {port}")
    if max_queue < 1:
        raise UserError(f"--max-queue must be a positive integer, got {max_queue}")
    if not 0 <= grace_period < 86400:
        raise UserError(f"--grace-period must be in 0..86400 seconds, got {grace_period}")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key is empty; give a key, or leave the option out to serve without one")
    if not 0 <= prefix_cache_gib <= MAX_PREFIX_CACHE_GIB:  # NaN fails too
        raise UserError(f"--prefix-cache-gib must be in 0..{MAX_PREFIX_CACHE_GIB} GiB (0 turns the cache off), "
                        f"got {prefix_cache_gib}")
    name = served_model_name if served_model_name is not None else Path(bundle).absolute().name
    if not name:
        raise UserError("--served-model-name is empty")
    _check_speculation_flags(speculative_tokens, draft_checkpoint)
    job = {"host": host, "port": port, "max_queue": max_queue, "api_key": api_key, "model_name": name,
           "grace": grace_period, "limits": limits, "prefix_cache_bytes": int(prefix_cache_gib * 2**30)}
    sharded = read_sharded(bundle)
    if sharded is None:
        from dsneuron.runtime_min.serving.server import listen
        from dsneuron.runtime_min.session import Session

        sock = listen(host, port)  # before the load, which can take minutes: a taken port fails at once
        session = Session.load(bundle, verify_key)
        if speculative_tokens:
            from dsneuron.runtime_min.core.speculative import Speculation

            job["speculation"] = Speculation(_drafter(bundle, session, speculative_tokens, draft_checkpoint),
                                             speculative_tokens)
        serve_job(session, _print, sock=sock, **job)
        return
    if speculative_tokens:
        raise UserError("--speculative-tokens: a sharded bundle (--tp) does not speculate; serve a one-process bundle")
    from dsneuron.runtime_min.sharded import launch

    launch(bundle, sharded, serve_job, job, _print, verify_key, term_to_rank0=True)


def serve_job(session, out, **kwargs) -> None:
    """What `dsneuron serve` does with a loaded Session (every rank of a sharded bundle: rank 0
    serves, the others follow its steps; runtime_min/serving/server.py)."""
    from dsneuron.runtime_min.serving.server import serve

    serve(session, ready=lambda url: out("stderr", f"serving {kwargs['model_name']} at {url}/v1 (Ctrl-C or "
                                                   "SIGTERM to stop)"), **kwargs)


@app.command("compare")
def compare_cmd(
    bundle: Path = typer.Argument(..., help="bundle folder written by `dsneuron compile` (--probes for the stage table)"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="one prompt per line (default: the shipped short/medium/long, "
                                                                    "or short/small_medium/small_long when those do not fit)"),
    decode: int = typer.Option(8, "--decode", help="teacher-forced decode steps after each prompt"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="also write every figure as JSON here"),
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="checkpoint the bundle was built from (default: the manifest's)"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="where the deterministic checkpoint lives (as for compile)"),
    verify_key: Optional[Path] = _verify_key_option(),
) -> None:
    """The bundle against the eager golden model: end to end next to the floor, and stage by stage.
    Exits 1 when any prompt's end-to-end drift is worse than the floor (a wrong checkpoint shows here)."""
    import json

    from dsneuron.compiler.compare import compare_bundle, end_to_end_verdict, render
    from dsneuron.compiler.default_prompts import read_prompts

    if json_out is not None:
        check_output_file(json_out, "--json")
    chosen = read_prompts(prompts) if prompts is not None else None  # None: the shipped ones that fit
    reports = compare_bundle(bundle, chosen, decode, checkpoint, cache_dir, log=lambda s: err_console.print(s, highlight=False),
                             verify_key=verify_key)
    render(reports, console)
    if json_out is not None:
        json_out.write_text(json.dumps({"bundle": str(bundle), "prompts": [r.to_dict() for r in reports]}, indent=1))
    worse = [r.name for r in reports if not end_to_end_verdict(r)["ok"]]
    if worse:
        err_console.print(f"[bold red]worse than the floor:[/] {', '.join(worse)} (is --checkpoint the one the bundle was built from?)")
        raise typer.Exit(1)


@app.command("plan")
def plan_cmd(
    config: str = typer.Option(..., "--config", help="config JSON path or packaged name (tiny, micro, v4.1-flash)"),
    target: str = typer.Option("cpu", "--target", help="cpu (this host, one rank) or neuron (an --instance)"),
    instance: Optional[str] = typer.Option(None, "--instance", help="with --target neuron: trn2.48xlarge (default), "
                                                                   "trn2u.48xlarge, trn2.3xlarge, trn1.32xlarge, "
                                                                   "trn1n.32xlarge, trn1.2xlarge"),
    tp: Optional[int] = typer.Option(None, "--tp", help="tensor-parallel ranks = world size [default: every rank "
                                                         "of the instance; 1 on cpu]"),
    ep: Optional[int] = typer.Option(None, "--ep", help="expert-parallel groups inside the tp ranks "
                                                         "[default: gcd(tp, n_routed_experts)]"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="also write every figure as JSON here"),
    contexts: Optional[str] = typer.Option(None, "--contexts", help="also the long-context table at these decode "
                                                                    "capacities, e.g. 65536,262144,1048576"),
    chunk: Optional[int] = typer.Option(None, "--chunk", help="with --contexts: the chunked prefill's chunk length "
                                                              "[default: the largest prefill length]"),
    bandwidth_gbs: Optional[float] = typer.Option(None, "--bandwidth-gbs", help="with --target cpu: this host's read "
                                                  "bandwidth in GB/s for the roofline [default: measured, a 1 GiB sum]"),
) -> None:
    """Per bucket and rank: FLOPs, weight, state and activation bytes against the instance's HBM
    (exit 2 when it does not fit), the stage kinds to compile and the decode roofline; with
    --contexts, per capacity the state, the decode step's and a chunk's need and roofline."""
    from dsneuron.compiler.config import load_config
    from dsneuron.compiler.plan import check_fit, make_plan, render

    if json_out is not None:
        check_output_file(json_out, "--json")
    model_cfg, compile_cfg, path = load_config(config)
    caps = None
    if contexts is not None:
        try:
            caps = [int(x) for x in contexts.split(",")]
        except ValueError:
            caps = []
        if not caps or min(caps) <= 0:
            raise UserError(f"--contexts {contexts!r}: expected positive integers separated by commas")
    if chunk is not None and chunk <= 0:
        raise UserError(f"--chunk {chunk}: must be a positive integer")
    plan = make_plan(model_cfg, compile_cfg, target, instance, tp, ep, config_name=config,
                     log=lambda s: err_console.print(s, highlight=False), contexts=caps, chunk_len=chunk,
                     bandwidth_gbs=bandwidth_gbs)
    render(plan, console)
    if json_out is not None:
        json_out.write_text(json.dumps(plan.to_dict(), indent=1))
    check_fit(plan)


@app.command("sign")
def sign_cmd(
    bundle: Path = typer.Argument(..., help="bundle folder"),
    key: Path = typer.Option(..., "--key", help="PEM elliptic-curve private key (P-256/384/521)"),
) -> None:
    """Sign an existing bundle (OpenSSF model-signing, key-based): writes its signature.sig."""
    from dsneuron.runtime_min.bundle.bundle import open_bundle
    from dsneuron.runtime_min.bundle.signing import check_private_key, sign_bundle

    check_private_key(key)
    b = open_bundle(bundle, inspect=True)  # only a bundle that verifies as it is gets signed
    path = sign_bundle(b.root, key)
    console.print(f"signed {b.root}: {path.name}")


@app.command("inspect")
def inspect_cmd(
    bundle: Path = typer.Argument(..., help="bundle folder"),
    verify_key: Optional[Path] = _verify_key_option(),
) -> None:
    """Print a bundle's target, versions, signature, buckets and file sizes, then verify it (exit 2 on a problem)."""
    from rich.table import Table

    from dsneuron.runtime_min.bundle.bundle import open_bundle, read_manifest
    from dsneuron.runtime_min.bundle.signing import SIGNATURE, signer_hint

    root = Path(bundle).absolute()
    m = read_manifest(root)
    tc = m.toolchain
    console.print(f"[bold]{root}[/]  schema {m.schema_version}, target [bold]{m.target}[/], {m.created_by}")
    console.print(f"toolchain: python {tc.get('python')}, torch {tc.get('torch')}, {tc.get('machine')}, "
                  f"cpu isa {' '.join(tc.get('cpu_isa') or []) or '-'}")
    console.print(f"compiler: {m.compiler.get('backend')} flags {m.compiler.get('flags')}; custom ops {m.compiler.get('custom_ops')}")
    if m.target != "cpu":
        console.print("numerics: the neuron target's (each FP8/FP4 GEMM one fp32 GEMM over the whole K: within the "
                      "floors of the golden, not its bits; docs/neuron.md)")
    else:
        console.print(f"numerics: {m.numerics}" + (" (bit-identical to the golden on every host)" if m.numerics == "exact"
                                                   else " (bf16 dot products: deterministic on one host; compare within "
                                                        "the fast floors)"))
    if m.compile_config.get("speculative", "none") != "none":
        from safetensors import safe_open

        n_mtp = 0
        for rel in m.weights_files:
            if (root / rel).is_file():
                with safe_open(str(root / rel), framework="pt") as f:
                    n_mtp += sum(n.startswith("mtp.") for n in f.keys())
        console.print(f"speculative: {m.compile_config['speculative']} (the drafter's {n_mtp} mtp.* tensors in the weights "
                      f"file, not counted below, block size {m.model_config.get('dspark_block_size')}; `run` and "
                      "`serve --speculative-tokens K` draft with them eagerly)")
    shard = m.compiler.get("shard")
    if shard:
        console.print(f"shard: rank {shard['rank']} of a sharded bundle of tp={shard['tp']}, ep={shard['ep']} "
                      f"(`dsneuron run {root.parent}` runs every rank)")
    sizes = {rel: meta["size"] for rel, meta in m.files.items()}

    def files_of(b) -> list[str]:  # a staged bucket's executables are its stages' files
        return sorted({st.file for st in b.stages}) if b.stages else [b.file]

    table = Table("kind", "batch", "seq_len", "capacity", "MiB", title="buckets")
    table.add_column("file", no_wrap=True)
    for b in m.buckets:
        seq = f"{b.min_seq_len}..{b.seq_len} step {b.seq_len_step}" if b.min_seq_len else str(b.seq_len)
        mib = sum(sizes.get(f, 0) for f in files_of(b)) / 2**20
        table.add_row(b.kind, str(b.batch), seq, str(b.capacity), f"{mib:.2f}", b.file)
    console.print(table)
    staged = [b for b in m.buckets if b.stages]
    if staged:
        kinds = Table("bucket", "executable", "runs as", "MiB", title="stages (one executable per stage kind)")
        for b in staged:
            uses: dict[str, list[str]] = {}
            for st in b.stages:
                uses.setdefault(st.file, []).append(st.name)
            for f, names in uses.items():
                kinds.add_row(f"{b.kind} b{b.batch}", f, ", ".join(names), f"{sizes.get(f, 0) / 2**20:.2f}")
        console.print(kinds)
    exe = sum(sizes.get(f, 0) for b in m.buckets for f in files_of(b))
    n_weights = len({n for b in m.buckets for n in (*b.weights, *(w for st in b.stages for w in st.weights))})
    prepared = f" ({len(m.prepare)} prepared at load into the cpu kernels' layout)" if m.prepare else ""
    console.print(f"weights {n_weights} tensors{prepared}, {sum(sizes.get(f, 0) for f in m.weights_files) / 2**20:.1f} MiB"
                  f"{f' in {len(m.weight_files)} shards' if m.weight_files else ''}; "
                  f"executables {exe / 2**20:.1f} MiB; total {sum(sizes.values()) / 2**20:.1f} MiB; "
                  f"state tensors {len(m.state)}; engram hashing {'yes' if m.host_preprocessing.get('engram') else 'no'}")
    hint = signer_hint(root)
    console.print(f"signature: {'none (unsigned)' if hint is None else f'{SIGNATURE}, by the key with sha256 {hint}'}")
    shlo = m.compiler.get("stablehlo")
    if shlo is not None:  # --stablehlo-only: the input of neuronx-cc; run / compare execute it on XLA:CPU
        versions = tc.get("stablehlo") or {}
        console.print(f"StableHLO modules (portable artifacts at version {versions.get('artifact')}, torch-mlir "
                      f"{tc.get('torch_mlir')}), NKI kernels as composites; each takes the bucket's weights then its "
                      "inputs:")
        ops = Table("module", "args", "ops", "dot_general", "gather", "scatter", "sort", "composite", "f64", "i64",
                    "largest const", title="StableHLO modules")
        for rel, r in sorted(shlo.items()):
            f = r["facts"]
            ops.add_row(Path(rel).name, str(f["arguments"]), str(f["instructions"]),
                        *(str(f["ops"][k]) for k in ("dot_general", "gather", "scatter", "sort", "composite")),
                        str(f["f64_ops"]), str(f["i64_ops"]), str(f["largest_constant"]))
        console.print(ops)
    open_bundle(root, verify_key, inspect=True)
    console.print(("verified: schema and every checksum OK" if shlo is not None else
                   "verified: schema, target, toolchain and every checksum OK")
                  + (f"; signature by {verify_key} OK" if verify_key is not None else ""))


def _on_sigterm(signum: int, frame) -> None:
    raise Terminated(128 + signum)


def main() -> None:
    """Console-script entry point: run the typer app with SIGTERM turned into `Terminated`, mapping
    UserError to exit code 2, Ctrl-C to 130 and SIGTERM to 143 (module docstring)."""
    in_main_thread = threading.current_thread() is threading.main_thread()  # signal.signal works only there
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main_thread else None
    try:
        rc = app(standalone_mode=False)
        # with standalone_mode=False typer returns (not raises) the exit code; it turns a
        # KeyboardInterrupt inside a command into 130
        if rc == 130:
            _interrupted()
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except UserError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except RankFailed as e:  # a rank of a sharded run crashed: its error, not a traceback of the parent
        from rich.markup import escape

        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except Terminated as e:
        err_console.print("[bold red]terminated[/]")
        sys.exit(e.code)
    except KeyboardInterrupt:
        _interrupted()
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:
        # usage errors of the click bundled with typer (missing option, bad value, unknown command)
        # carry their own message and exit code; typer vendors click, so duck-type rather than import
        if type(e).__name__ == "Abort":
            _interrupted()
        show, code = getattr(e, "show", None), getattr(e, "exit_code", None)
        if callable(show) and isinstance(code, int):
            show()
            sys.exit(2 if code else 0)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupted() -> None:
    err_console.print("[bold red]interrupted[/]")
    sys.exit(130)


if __name__ == "__main__":
    main()
