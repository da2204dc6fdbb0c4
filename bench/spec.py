"""Speculative decoding's costs on a compiled cpu bundle, side by side in one run.

    python -m dsneuron.bench.spec --bundle DIR [--checkpoint CKPT] [--k 5] [--tokens 64] [--repeats 5]

On one random prompt (runtime_min/core/speculative.py, runtime_min/core/runner.py `Runner.verify`):

- decode: one decode step (the decode bucket), the median of --repeats;
- verify: one verify of 1 + k tokens (the verify bucket, or without one the chunk bucket, padded
  to its next token count, read at every position: the verify's head at every position, or the
  widest decode bucket's head stage, and the target layers' streams) and the call alone, its head
  skipped (= a replay of the kept tokens after a rejection);
- drafter: one DSpark draft of a block from the checkpoint's mtp.* weights (--checkpoint) or the
  bundle's own (`compile --speculative dspark`), EAGER in the golden's exact numerics
  (graphs/dspark.py; not compiled: an upper bound of the drafter's cost), and again in GEMM order
  "fused" (fp32 GEMMs, the main and Markov heads through the cpu kernels on the bundle's head
  layout: what `run` and `serve` draft with on the cpu target),
  and the bundle's draft bucket where it has one (runtime_min/core/drafter.py: what they draft with then);
- projected: tokens/s at mean acceptance lengths 2.5 and 3.0 (the published figures, measured
  with V4.1's trained drafter; random weights accept ~nothing) against plain decoding, per step
  verify + replay (a step that keeps every draft skips it; at these lengths almost none does) +
  drafter, with each drafter measured and with it at 0;
- oracle: a TEST-ONLY drafter proposing the model's own greedy tokens (known from a plain run)
  drives the whole loop for --tokens tokens: measured tokens/s against plain greedy decoding of
  the same tokens (acceptance k + 1 a step: the mechanics' ceiling, not a real drafter's speed).

Wall times on a shared machine are noisy: the ratios of one run are the figures to quote. Bad
arguments, a bundle that cannot be loaded or a checkpoint without the drafter: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _median(fn, repeats: int) -> float:
    """bench/eager.py median_seconds after one warm call."""
    from dsneuron.bench.eager import median_seconds

    fn()
    return median_seconds(fn, repeats)


class _Oracle:
    """TEST-ONLY drafter: the continuation `seq` after the fed token (runtime_min/core/speculative.py Drafter)."""

    def __init__(self, seq: list[int], block: int):
        self.seq, self.block = seq, block

    def start(self, batch):
        return None

    def seed(self, cache, main_hidden, start, count):
        return None

    def propose(self, cache, token, pos, k, temperature, generator):
        import torch

        p = int(pos[0])
        return torch.tensor([[self.seq[min(p + 2 + j, len(self.seq) - 1)] for j in range(k)]]), None


def measure(bundle: Path, checkpoint: Path | None, k: int, tokens: int, repeats: int) -> dict:
    import torch

    from dsneuron import UserError
    from dsneuron.graphs.config import ModelConfig
    from dsneuron.graphs.dspark import bundle_drafter, load_drafter
    from dsneuron.runtime_min.core import speculative as sp
    from dsneuron.runtime_min.core.checks import check_context
    from dsneuron.runtime_min.core.runner import Runner

    r = Runner.load(bundle)
    cfg_dict = r.manifest.model_config
    block = int(cfg_dict["dspark_block_size"])
    if not 1 <= k <= block:
        raise UserError(f"--k must be in 1..{block} (the model's dspark_block_size), got {k}")
    check_context(12, tokens, r.max_capacity, "--tokens")  # the 12-token prompt
    target = sp.RunnerTarget(r)
    prompt = torch.randint(3, min(r.vocab_size, 128000), (12,), generator=torch.Generator().manual_seed(0)).tolist()
    pre = r.prefill([prompt])
    p = len(prompt)
    state = pre.state
    tok = torch.tensor([int(pre.logits[0].argmax())])
    out: dict = {"bundle": str(bundle), "k": k, "threads": torch.get_num_threads()}
    out["decode_s"] = _median(lambda: r.decode(tok, torch.tensor([p]), state), repeats)
    toks = torch.randint(3, 128000, (1, 1 + k), generator=torch.Generator().manual_seed(1))
    pos, count = torch.tensor([p]), torch.tensor([1 + k])
    out["verify_s"] = _median(lambda: r.verify(toks, pos, count, state, target.target_layers), repeats)
    out["chunk_call_s"] = _median(lambda: r.verify(toks, pos, count, state, target.target_layers, taps=False), repeats)
    chunk = r.bucket("chunk", 1, max(r.lengths("chunk", 1)))
    out["verify_padded_tokens"] = chunk.padded_len(1 + k)
    out["verify_over_decode"] = out["verify_s"] / out["decode_s"]
    cfg = ModelConfig.from_dict(cfg_dict)

    def draft_seconds(order: str) -> float | None:  # one drafter at a time: the golden's holds float64 copies
        drafter = (load_drafter(checkpoint, cfg, r.max_capacity, order) if checkpoint is not None
                   else bundle_drafter(r.bundle, cfg, r.max_capacity, order,
                                       weights=r.weights if order == "fused" else None))
        if drafter is None:
            return None
        v = r.verify_prefill([prompt], target.target_layers)
        cache = drafter.seed(drafter.start(1), v.main_hidden, torch.tensor([0]), v.count)
        return _median(lambda: drafter.propose(cache, tok, torch.tensor([p - 1]), k, 0.0, None), repeats)

    for order, key in (("ascending", "drafter_eager_s"), ("fused", "drafter_fused_s")):
        seconds = draft_seconds(order)
        if seconds is not None:
            out[key] = seconds
    if any(b.kind == "draft" for b in r.manifest.buckets):  # the drafter's own bucket (runtime_min/core/drafter.py)
        from dsneuron.runtime_min.core.drafter import CompiledDrafter

        compiled = CompiledDrafter(r)
        v = r.verify_prefill([prompt], target.target_layers)
        cache = compiled.seed(compiled.start(1), v.main_hidden, torch.tensor([0]), v.count)
        out["drafter_bucket_s"] = _median(lambda: compiled.propose(cache, tok, torch.tensor([p - 1]), k, 0.0, None),
                                          repeats)
    step = out["verify_s"] + out["chunk_call_s"]
    out["projected_speedup"] = {  # with the drafter's cost where it was measured (a checkpoint or the bundle's)
        str(a): {"drafter_free": a * out["decode_s"] / step,
                 **{name: a * out["decode_s"] / (step + out[key])
                    for name, key in (("drafter_eager", "drafter_eager_s"), ("drafter_fused", "drafter_fused_s"),
                                      ("drafter_bucket", "drafter_bucket_s"))
                    if key in out}}
        for a in (2.5, 3.0)}
    # the oracle (TEST-ONLY): plain greedy first, then the loop proposing those tokens
    t0 = time.perf_counter()
    step_ = r.prefill([prompt])
    plain = [int(step_.logits[0].argmax())]
    t_dec = time.perf_counter()
    for i in range(tokens - 1):
        step_ = r.decode(torch.tensor([plain[-1]]), torch.tensor([p + i]), step_.state)
        plain.append(int(step_.logits[0].argmax()))
    plain_s = time.perf_counter() - t_dec
    t0 = time.perf_counter()
    res = sp.generate(target, _Oracle(prompt + plain, block), [prompt], tokens, k, keep_logits=False)
    spec_s = time.perf_counter() - t0
    if res.tokens[0] != plain:
        raise SystemExit("oracle speculation did not reproduce plain greedy decoding")
    pre_s = _median(lambda: r.verify_prefill([prompt], target.target_layers), 1)
    out["oracle"] = {"tokens": tokens, "plain_decode_s": plain_s, "spec_s_minus_prefill": spec_s - pre_s,
                     "mean_acceptance": res.stats.mean_acceptance,
                     "speedup": plain_s / max(spec_s - pre_s, 1e-9)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True, help="a cpu bundle with a chunk bucket of batch 1")
    ap.add_argument("--checkpoint", type=Path, default=None, help="its checkpoint (for the DSpark drafter's cost; "
                    "default: the bundle's own drafter, if it stores one)")
    ap.add_argument("--k", type=int, default=5, help="drafts per verify (<= dspark_block_size)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the oracle run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.repeats < 1:
        ap.error(f"--tokens and --repeats must be >= 1, got {a.tokens} and {a.repeats}")
    if a.checkpoint is not None and not a.checkpoint.is_dir():
        ap.error(f"--checkpoint {a.checkpoint}: no such folder")
    from dsneuron import UserError

    try:
        out = measure(a.bundle, a.checkpoint, a.k, a.tokens, a.repeats)
    except UserError as e:  # a missing or unusable bundle or checkpoint, a bad --k / --tokens: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text)


if __name__ == "__main__":
    main()
