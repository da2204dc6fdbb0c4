"""The serving benchmark: `dsneuron serve` under concurrent OpenAI clients, from one run.

    python -m dsneuron.bench.serve [--bundle B | --config tiny] [--work DIR] [--streams 8]
        [--requests 64] [--clients 16] [--max-tokens 64] [--json OUT]

Without --bundle it compiles --config with batch buckets 1, 2, 4 and 8 (one 128-token prefill
bucket, one 512-token context capacity: continuous batching prefills at batch 1 and decodes at
the smallest batch bucket holding the rows). Then, against one `dsneuron serve` child process on
127.0.0.1, every client the official `openai` package, greedy:
1. one stream: --max-tokens tokens; time to first token (TTFT), inter-token latency (ITL) and
   decode tokens/s (tokens after the first over the time from the first to the last), beside
   `dsneuron run --stats` of the same prompt in a child process (the same decode loop without
   HTTP: what the server costs);
2. --streams concurrent streams of the same length: aggregate decode tokens/s (all tokens after
   each stream's first, over the time from the earliest first token to the latest last one) and
   its ratio to the one stream's;
3. load: --requests requests from --clients concurrent clients, prompts of 2..~120 tokens and
   8..--max-tokens new tokens (a fixed mix), half streamed: requests/s, output tokens/s, TTFT,
   ITL and end-to-end latency p50/p99, errors; then every request again alone (one at a time) and
   the count of texts equal to their alone text;
4. SIGTERM under the same load, one second in (server --grace-period 10): the exit code, the
   seconds to exit, requests completed / ended by the grace period / hanging (a client still
   waiting when the server is gone).
5. the decode step alone at each decode batch bucket (in this process, before the server starts;
   median of 5 steps at position 16, fresh state): ms per step and rows/s, the ceiling of what
   continuous batching can reach at that many rows.
The figures are from one run on this host, side by side; absolute times on a shared 2-core host
are noisy, the ratios are what to quote.

    python -m dsneuron.bench.serve --prefix-chat [--bundle B | --config tiny] [--history 1000]

measures the prefix cache instead (`prefix_chat`): --config as packaged (tiny: one 1024-token
context with its chunk bucket; compiled into --work/prefix-bundle) served twice,
`--prefix-cache-gib 0` and the default, each with the same 2-turn chat through the `openai`
client's chat API, streamed and greedy: turn 1 a user message whose prompt makes the chat's
history --history tokens with its reply, turn 2 that history plus a short question. It prints
both servers' TTFT of each turn side by side, their ratio, the prefix cache's hit tokens
(/metrics) and whether the texts are identical.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

#: the bucket plan the benchmark compiles (module docstring)
SERVE_COMPILE = {"batch_sizes": [1, 2, 4, 8], "prefill_seq_lens": [128], "decode_context_lens": [512]}
WORDS = ("the model serves text over HTTP to many clients at once while each request keeps its own row and "
         "its own position in the batch buckets of the bundle").split()
GRACE_S = 10.0


def compile_with(config: str, out: Path, compile_overrides: dict[str, Any], console: Console,
                 cache_dir: Path | None = None) -> Path:
    """--config with its "compile" section updated by `compile_overrides`, compiled by the CLI into
    `out` (reused when there); returns `out`. Raises RuntimeError with the compiler's output on
    failure."""
    from dsneuron.compiler.config import resolve_config_path

    if (out / "manifest.json").is_file():
        return out
    raw = json.loads(resolve_config_path(config).read_text())
    raw["compile"] = {**raw["compile"], **compile_overrides}
    cfg = out.parent / f"{out.name}-config.json"
    cfg.write_text(json.dumps(raw, indent=1))
    console.print(f"compiling {config} with {compile_overrides} into {out} ...")
    cmd = [sys.executable, "-c", "from dsneuron.compiler.cli import main; main()", "compile", "--config", str(cfg),
           "--out", str(out), *(["--cache-dir", str(cache_dir)] if cache_dir else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"compile failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return out


def compile_serve_bundle(config: str, work: Path, console: Console) -> Path:
    """--config with SERVE_COMPILE's buckets in work/bundle (`compile_with`)."""
    return compile_with(config, work / "bundle", SERVE_COMPILE, console)


class Served:
    """A `dsneuron serve` child on 127.0.0.1 with a free port; `url` its /v1 base URL."""

    def __init__(self, bundle: Path, *flags: str):
        cmd = [sys.executable, "-c", "from dsneuron.compiler.cli import main; main()", "serve", str(bundle), "--port", "0",
               "--max-queue", "1024", "--grace-period", str(GRACE_S), *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url, ready, self.log = "", threading.Event(), []

        def drain():
            for line in self.proc.stderr:
                self.log.append(line)
                if not self.url and " at http://" in line:
                    self.url = line.split(" at ")[1].split()[0]
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(600) or not self.url:
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-30:]))
        self.model = self.client().models.list().data[0].id

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url, api_key="none", timeout=600, max_retries=0)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(GRACE_S + 60)


def stream_one(client, model: str, prompt: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    """One greedy completion; its text, finish reason and perf_counter times of each text chunk
    (streamed) or of the response (whole)."""
    t0 = time.perf_counter()
    if not stream:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        t = time.perf_counter()
        return {"start": t0, "times": [t], "text": r.choices[0].text, "reason": r.choices[0].finish_reason,
                "tokens": r.usage.completion_tokens, "end": t}
    times, text, reason, tokens = [], [], None, 0
    for c in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}):
        if c.usage is not None:
            tokens = c.usage.completion_tokens
        if c.choices:
            if c.choices[0].text:
                times.append(time.perf_counter())
                text.append(c.choices[0].text)
            reason = c.choices[0].finish_reason or reason
    return {"start": t0, "times": times, "text": "".join(text), "reason": reason, "tokens": tokens,
            "end": time.perf_counter()}


def decode_step_times(bundle: Path, repeats: int = 5) -> dict[int, float]:
    """Item 5 of the module docstring: {batch: median seconds of one decode step}."""
    import torch

    from dsneuron.runtime_min.core.runner import Runner

    runner = Runner.load(bundle)
    out = {}
    for batch in runner.decode_batches:
        tokens = torch.full((batch,), runner.pad_token_id + 2, dtype=torch.int64)
        pos = torch.full((batch,), 16, dtype=torch.int64)
        # the first loads the executables; Step.seconds is the executable call alone
        times = [runner.decode(tokens, pos, runner.fresh_state(batch)).seconds for _ in range(repeats + 1)]
        out[batch] = statistics.median(times[1:])
    return out


def run_decode_rate(bundle: Path, prompt: str, max_tokens: int) -> float:
    """Decode tokens/s that `dsneuron run --stats` prints for `prompt` (greedy)."""
    done = subprocess.run([sys.executable, "-c", "from dsneuron.compiler.cli import main; main()", "run", str(bundle),
                           "--prompt", prompt, "--max-new-tokens", str(max_tokens), "--stats"],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"dsneuron run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    match = re.search(r"= ([0-9.]+) tokens/s", done.stderr)
    if match is None:
        raise RuntimeError(f"no decode rate in the output of dsneuron run --stats:\n{done.stderr[-2000:]}")
    return float(match.group(1))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def _decode_rate(rs: list[dict]) -> float:
    """Tokens after each stream's first, over the earliest first token to the latest last one.
    Text chunks stand for tokens: a chunk is one token's text except where a multi-byte
    character spans tokens, so `tokens` from usage is the count."""
    first = min(r["times"][0] for r in rs)
    last = max(r["times"][-1] for r in rs)
    return sum(r["tokens"] - 1 for r in rs) / (last - first) if last > first else float("nan")


def _itl(rs: list[dict]) -> list[float]:
    return [b - a for r in rs for a, b in zip(r["times"], r["times"][1:])]


def mix(n: int, max_tokens: int) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs: prompts of 1..~100 words, 8..max_tokens new tokens."""
    out = []
    for i in range(n):
        words = 1 + (i * 37) % 100
        out.append((" ".join(WORDS[(i + k) % len(WORDS)] for k in range(words)), 8 + (i * 13) % max(1, max_tokens - 7)))
    return out


def run(bundle: Path, streams: int, requests: int, clients: int, max_tokens: int) -> dict[str, Any]:
    """The measurements of the module docstring; returns the figures."""
    res: dict[str, Any] = {"bundle": str(bundle), "decode_steps": decode_step_times(bundle)}
    served = Served(bundle)
    try:
        model, client = served.model, served.client()
        prompt = " ".join(WORDS[:12])
        stream_one(client, model, prompt, 4)  # loads the prefill and decode executables
        one = stream_one(client, model, prompt, max_tokens)
        res["single"] = {"ttft_s": one["times"][0] - one["start"], "itl_p50_s": _pct(_itl([one]), 50),
                         "decode_tps": _decode_rate([one]), "tokens": one["tokens"],
                         "run_decode_tps": run_decode_rate(bundle, prompt, max_tokens)}
        with ThreadPoolExecutor(streams) as pool:
            many = list(pool.map(lambda i: stream_one(served.client(), model, " ".join(WORDS[i:i + 12]), max_tokens),
                                 range(streams)))
        res["concurrent"] = {"streams": streams, "decode_tps": _decode_rate(many), "itl_p50_s": _pct(_itl(many), 50),
                             "tokens": sum(r["tokens"] for r in many)}
        res["concurrent"]["ratio"] = res["concurrent"]["decode_tps"] / res["single"]["decode_tps"]

        jobs = mix(requests, max_tokens)
        errors: list[str] = []

        def job(k: int):
            p, n = jobs[k]
            try:
                return stream_one(served.client(), model, p, n, stream=k % 2 == 0)
            except Exception as e:  # counted, not raised: the figures say how many failed
                errors.append(f"{type(e).__name__}: {e}")
                return None

        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            got = list(pool.map(job, range(requests)))
        wall = time.perf_counter() - t0
        ok = [r for r in got if r is not None]
        streamed = [r for k, r in enumerate(got) if r is not None and k % 2 == 0 and r["times"]]
        alone = [stream_one(client, model, p, n, stream=False)["text"] for p, n in jobs]
        res["load"] = {"requests": requests, "clients": clients, "completed": len(ok), "errors": len(errors),
                       "error_examples": errors[:3], "seconds": wall, "requests_per_s": len(ok) / wall,
                       "output_tps": sum(r["tokens"] for r in ok) / wall,
                       "ttft_p50_s": _pct([r["times"][0] - r["start"] for r in streamed], 50),
                       "ttft_p99_s": _pct([r["times"][0] - r["start"] for r in streamed], 99),
                       "itl_p50_s": _pct(_itl(streamed), 50), "itl_p99_s": _pct(_itl(streamed), 99),
                       "e2e_p50_s": _pct([r["end"] - r["start"] for r in ok], 50),
                       "e2e_p99_s": _pct([r["end"] - r["start"] for r in ok], 99),
                       "equal_to_alone": sum(1 for r, a in zip(got, alone) if r is not None and r["text"] == a)}
    finally:
        res["exit_code_after_run"] = served.stop()
    res["sigterm"] = sigterm_under_load(bundle, requests, clients, max_tokens)
    return res


def sigterm_under_load(bundle: Path, requests: int, clients: int, max_tokens: int) -> dict[str, Any]:
    """Item 4 of the module docstring."""
    served = Served(bundle)
    jobs = mix(requests, max_tokens)
    reasons: list[str | None] = []
    failures: list[str] = []

    def job(k: int):
        try:
            reasons.append(stream_one(served.client(), served.model, *jobs[k])["reason"])
        except Exception as e:  # refused after SIGTERM (503 / connection refused): not hanging
            failures.append(type(e).__name__)

    pool = ThreadPoolExecutor(clients)
    futures = [pool.submit(job, k) for k in range(requests)]
    time.sleep(1.0)
    t0 = time.perf_counter()
    served.proc.send_signal(signal.SIGTERM)
    try:
        code = served.proc.wait(GRACE_S + 60)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        code = None
    exit_s = time.perf_counter() - t0
    deadline = time.monotonic() + 30
    for f in futures:
        try:
            f.result(max(0.0, deadline - time.monotonic()))
        except Exception:
            pass
    pool.shutdown(wait=False, cancel_futures=True)
    return {"exit_code": code, "exit_s": exit_s, "grace_s": GRACE_S,
            "completed": sum(r in ("stop", "length") for r in reasons), "aborted": sum(r == "abort" for r in reasons),
            "refused": len(failures), "hanging": sum(not f.done() for f in futures)}


PREFIX_REPLY = 16  # tokens of turn 1's reply and of turn 2's


def prefix_chat(bundle: Path, history: int) -> dict[str, Any]:
    """The prefix-cache measurement of the module docstring; returns the figures: per server
    ("off", "on"), each turn's TTFT (s), text and prompt tokens, and the cache's hit tokens."""
    from tokenizers import Tokenizer

    from dsneuron.runtime_min.bundle.bundle import open_bundle

    tok = Tokenizer.from_file(str(open_bundle(bundle).tokenizer_file))  # the weights are the servers' to load
    words, text = WORDS * (history // len(WORDS) + 2), ""
    for n in range(1, len(words)):  # the longest user message whose prompt + reply fits `history`
        cand = " ".join(words[:n])
        if len(tok.encode(cand, add_special_tokens=False).ids) + 16 + PREFIX_REPLY > history:
            break
        text = cand
    res: dict[str, Any] = {"bundle": str(bundle), "history": history}
    for name, flags in (("off", ("--prefix-cache-gib", "0")), ("on", ())):
        served = Served(bundle, *flags)
        try:
            client = served.client()

            def turn(messages):
                t0, first, parts, usage = time.perf_counter(), None, [], None
                for c in client.chat.completions.create(model=served.model, messages=messages, max_tokens=PREFIX_REPLY,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}):
                    usage = c.usage or usage
                    if c.choices and c.choices[0].delta.content:
                        first = first or time.perf_counter()
                        parts.append(c.choices[0].delta.content)
                return {"ttft_s": (first or time.perf_counter()) - t0, "text": "".join(parts),
                        "prompt_tokens": usage.prompt_tokens if usage else 0}

            def chat(first: str) -> tuple[dict, dict]:
                one = turn([{"role": "user", "content": first}])
                return one, turn([{"role": "user", "content": first}, {"role": "assistant", "content": one["text"]},
                                  {"role": "user", "content": "And in one word?"}])

            chat("Hello there, warm up")  # loads the executables (its second turn the chunk bucket's)
            one, two = chat(text)
            with urllib.request.urlopen(served.url.removesuffix("/v1") + "/metrics", timeout=60) as resp:
                metrics = resp.read().decode()
            hit = [float(ln.split()[1]) for ln in metrics.splitlines()
                   if ln.startswith("dsneuron_prefix_cache_hit_tokens_total")]
            res[name] = {"turn1": one, "turn2": two, "hit_tokens": hit[0] if hit else 0.0}
        finally:
            served.stop()
    res["ratio"] = res["off"]["turn2"]["ttft_s"] / res["on"]["turn2"]["ttft_s"]
    res["identical"] = all(res["off"][t]["text"] == res["on"][t]["text"] for t in ("turn1", "turn2"))
    return res


def report_prefix(r: dict[str, Any], console: Console) -> None:
    off, on = r["off"], r["on"]
    table = Table(title=f"2-turn chat, {r['history']}-token history, on {r['bundle']}")
    for col in ("", "cache off", "cache on (--prefix-cache-gib default)"):
        table.add_column(col, justify="right" if col else "left")
    for t in ("turn1", "turn2"):
        table.add_row(f"{t[:4]} {t[4:]}: prompt tokens", str(off[t]["prompt_tokens"]), str(on[t]["prompt_tokens"]))
        table.add_row(f"{t[:4]} {t[4:]}: TTFT", f"{off[t]['ttft_s'] * 1e3:.0f} ms", f"{on[t]['ttft_s'] * 1e3:.0f} ms")
    table.add_row("prompt tokens not prefilled (/metrics hit tokens)", f"{off['hit_tokens']:.0f}", f"{on['hit_tokens']:.0f}")
    table.add_row("turn 2 TTFT, off / on", "", f"{r['ratio']:.1f}x")
    table.add_row("texts identical (both turns)", "", "yes" if r["identical"] else "NO")
    console.print(table)


def report(r: dict[str, Any], console: Console) -> None:
    s, c, ld, t = r["single"], r["concurrent"], r["load"], r["sigterm"]
    table = Table(title=f"dsneuron serve on {r['bundle']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("one stream: TTFT", f"{s['ttft_s'] * 1e3:.1f} ms"),
        ("one stream: ITL p50", f"{s['itl_p50_s'] * 1e3:.2f} ms"),
        ("one stream: decode tokens/s", f"{s['decode_tps']:.1f}"),
        ("dsneuron run --stats (no server): decode tokens/s", f"{s['run_decode_tps']:.1f}"),
        ("one stream served / run", f"{s['decode_tps'] / s['run_decode_tps']:.2f}x"),
        (f"{c['streams']} streams: aggregate decode tokens/s", f"{c['decode_tps']:.1f}"),
        (f"{c['streams']} streams / one stream", f"{c['ratio']:.2f}x"),
        (f"{c['streams']} streams: ITL p50", f"{c['itl_p50_s'] * 1e3:.2f} ms"),
        (f"load: {ld['requests']} requests from {ld['clients']} clients", f"{ld['seconds']:.1f} s"),
        ("load: completed / errors", f"{ld['completed']} / {ld['errors']}"),
        ("load: requests/s", f"{ld['requests_per_s']:.2f}"),
        ("load: output tokens/s", f"{ld['output_tps']:.1f}"),
        ("load: TTFT p50 / p99", f"{ld['ttft_p50_s'] * 1e3:.0f} / {ld['ttft_p99_s'] * 1e3:.0f} ms"),
        ("load: ITL p50 / p99", f"{ld['itl_p50_s'] * 1e3:.1f} / {ld['itl_p99_s'] * 1e3:.1f} ms"),
        ("load: end-to-end p50 / p99", f"{ld['e2e_p50_s']:.2f} / {ld['e2e_p99_s']:.2f} s"),
        ("load: text equal to the request alone", f"{ld['equal_to_alone']} of {ld['requests']}"),
        ("SIGTERM under load: exit code, seconds", f"{t['exit_code']}, {t['exit_s']:.1f} s (grace {t['grace_s']:.0f} s)"),
        ("SIGTERM: completed / aborted / refused / hanging",
         f"{t['completed']} / {t['aborted']} / {t['refused']} / {t['hanging']}"),
    ]
    one = r["decode_steps"][min(r["decode_steps"])]
    rows += [(f"decode step alone at batch {b}", f"{t * 1e3:.1f} ms = {b / t:.1f} rows/s ({one * b / t:.2f}x batch 1)")
             for b, t in r["decode_steps"].items()]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    if ld["error_examples"]:
        console.print("errors, first few: " + "; ".join(ld["error_examples"]), markup=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, help="a compiled bundle (default: compile --config into --work)")
    ap.add_argument("--config", default="tiny", help="config to compile when no --bundle is given [tiny]")
    ap.add_argument("--work", type=Path, default=Path("bench-serve"), help="folder for the compiled bundle [bench-serve]")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--prefix-chat", action="store_true", help="measure the prefix cache on a 2-turn chat instead")
    ap.add_argument("--history", type=int, default=1000, help="with --prefix-chat: tokens of turn 2's history [1000]")
    a = ap.parse_args(argv)
    console = Console()
    if a.prefix_chat and a.history < 64:
        ap.error("--history must be at least 64 tokens")
    for name in ("streams", "requests", "clients", "max_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be a positive integer")
    if a.max_tokens < 8:
        ap.error("--max-tokens must be at least 8 (the mix asks 8..max-tokens new tokens)")
    try:
        a.work.mkdir(parents=True, exist_ok=True)
        if a.prefix_chat:  # the config's own buckets (tiny: its 1024-token context and chunk bucket)
            bundle = a.bundle or compile_with(a.config, a.work / "prefix-bundle", {}, console)
            r = prefix_chat(bundle, a.history)
        else:
            bundle = a.bundle or compile_serve_bundle(a.config, a.work, console)
            r = run(bundle, a.streams, a.requests, a.clients, a.max_tokens)
    except RuntimeError as e:
        Console(stderr=True).print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(1)
    (report_prefix if a.prefix_chat else report)(r, console)
    if a.json:
        a.json.write_text(json.dumps(r, indent=1, default=float))

if __name__ == "__main__":
    main()
