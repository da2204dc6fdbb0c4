"""The neuron path proven on this CPU: each bucket's StableHLO module executed by XLA against the eager step.

    python -m dsneuron.compiler.stablehlo_check --config micro [--indexer kernel] [--speculative dspark] [--json OUT]

For every bucket of the plan (or those named with --bucket): the neuron export (compiler/export.py
with the neuron lowering and spelling), its StableHLO module (compiler/stablehlo.py), XLA:CPU's
compile of the portable artifact and one execution (runtime_min/executors/executor_stablehlo.py), each
timed, the module's facts (ModuleFacts: op counts, f64 / f8 / i64, the largest constant), and
every output against the same step run eagerly by torch (`agreement`; the byte caches compared by
their decoded values, `state_agreement`), next to the floor: the eager step with exact GEMMs
(float64 block partials, order "ascending") against the neuron target's one fp32 GEMM ("fused"),
how far a change of fp32 summation order alone moves each output. The tests use the same pieces
(tests/test_stablehlo.py); stage by stage, `dsneuron compare` on a `--probes` bundle re-runs every
stage on the module's own recorded inputs.

NOT on this path: neuronx-cc, the NKI kernels (their composites run through their torch
references), Trainium's own arithmetic.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dsneuron.graphs.quant import dequantize_state
from dsneuron.graphs.steps import state_format
from dsneuron.runtime_min.bundle.schema import MAIN_HIDDEN, PROBE_PREFIX

from .buckets import PlannedBucket
from .export import CompileError


@dataclass
class Agreement:
    """One output of the StableHLO run against the eager step: bit_identical, and otherwise how
    far: differing (share of elements whose bits differ), max_abs, max_rel (max_abs over the
    largest |value| of the eager output), for the logits cos (cosine similarity in fp64), and
    zero_mismatch: one side all zeros and the other not (a dropped write, whatever the bounds).
    cos: for an output named "logits" or "draft_logits"."""

    name: str
    dtype: str
    bit_identical: bool
    differing: float
    max_abs: float
    max_rel: float
    cos: float | None = None
    zero_mismatch: bool = False


def agreement(name: str, got: torch.Tensor, want: torch.Tensor) -> Agreement:
    """Compare one output (`got` from the module, `want` eager; same shape and dtype, else
    CompileError). NaN equals NaN whatever its payload."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise CompileError(f"{name}: the module gave {got.dtype} {tuple(got.shape)}, the eager step "
                           f"{want.dtype} {tuple(want.shape)}")
    same = _bits(got) == _bits(want)
    if want.dtype.is_floating_point:
        same = same | (got.isnan() & want.isnan())
    differing = 1.0 - float(same.sum()) / max(same.numel(), 1)
    max_abs = max_rel = 0.0
    if want.dtype.is_floating_point and not bool(same.all()):
        g, w = got.double(), want.double()
        max_abs = float((g - w).abs()[~same].nan_to_num(math.inf).max())
        max_rel = max_abs / max(float(w.abs().nan_to_num(0.0).max()), 1e-300)
    elif not bool(same.all()):
        max_abs = max_rel = math.inf
    cos = None
    if name.endswith("logits"):
        g, w = got.double().flatten(), want.double().flatten()
        cos = float(torch.dot(g, w) / (g.norm() * w.norm()).clamp_min(1e-300))
    zero_mismatch = bool((got == 0).all()) != bool((want == 0).all())
    return Agreement(name, str(want.dtype).removeprefix("torch."), bool(same.all()), differing, max_abs, max_rel, cos,
                     zero_mismatch)


def _bits(t: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def state_agreement(cfg: Any, name: str, got: torch.Tensor, want: torch.Tensor) -> Agreement:
    """`agreement` of one output, with a byte-format state (graphs/steps.py `state_format`:
    window_kv, compress_kv, index_k) compared by its decoded fp32 values: a pre-QDQ value one
    fp32 rounding apart can land on the next FP8/FP4 code, which as bytes is a different integer
    (no distance) and as a value is one quantisation step. Bit-identical bytes are bit-identical
    values, so `bit_identical` keeps its meaning."""
    fmt = state_format(cfg, name) if got.dtype == torch.uint8 else None
    if fmt is None:
        return agreement(name, got, want)
    return agreement(name, dequantize_state(got, fmt[1], fmt[0]), dequantize_state(want, fmt[1], fmt[0]))


def bucket_inputs(steps: Any, hasher: Any, cfg: Any, pb: PlannedBucket, prefill_len: int, seed: int = 0
                  ) -> list[torch.Tensor]:
    """Data (and state) inputs of bucket `pb` that exercise it: random tokens; a draft step
    seeding 1 + K positions ending at its position (row b's prefill_len + 3b), sampled in even
    rows and greedy in odd ones, on random rings; prefill rows of
    lengths seq_len, seq_len-3, ...; a decode step after an eager prefill of prefill_len tokens per
    row (its state from that prefill, without the probe outputs of a probe build; the token at
    position prefill_len); a chunk after the same prefill, row b's n - 3b tokens (at least 1; n the
    seq_len or what the capacity holds after the prefill) from position prefill_len. Engram ids from `hasher` (kernels_nki.engram_hash.NgramHasher, None
    without engram layers)."""
    g = torch.Generator().manual_seed(seed)
    B = pb.batch

    def ids(tokens: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*tokens.shape, 0, 0, dtype=torch.int64) if hasher is None else hasher.hash_sequence(tokens)

    if pb.kind == "draft":  # a verify's 1 + K positions to seed, a sampled row and a greedy one
        K, V, W = pb.seq_len, cfg.vocab_size, cfg.window_size
        pos = torch.tensor([prefill_len + 3 * b for b in range(B)], dtype=torch.int64)
        hidden = (torch.randn(B, W, len(cfg.dspark_target_layer_ids) * cfg.dim, generator=g) * 4).to(torch.bfloat16)
        gumbel = -torch.empty(B, K, V).exponential_(generator=g).log()
        temperature = torch.tensor([0.8 if b % 2 == 0 else 0.0 for b in range(B)])
        rings = [(torch.randn(B, W, cfg.head_dim, generator=g)).to(torch.bfloat16) for _ in range(cfg.n_mtp_layers)]
        return [torch.randint(2, V, (B,), generator=g), pos, hidden, pos - K, torch.full((B,), 1 + K), gumbel,
                temperature, *rings]
    if pb.kind == "prefill":
        S = pb.seq_len
        tokens = torch.randint(2, cfg.vocab_size, (B, S), generator=g)
        valid = torch.tensor([max(1, S - 3 * b) for b in range(B)], dtype=torch.int64)
        return [tokens, valid, ids(tokens)]
    fed = 1 if pb.kind == "decode" else pb.seq_len
    seq = torch.randint(2, cfg.vocab_size, (B, prefill_len + fed), generator=g)
    graph = steps.prefill(B, prefill_len, pb.capacity)
    eng = ids(seq)  # the chunk's ids hashed with the history before it, as the runtime hashes them
    with torch.no_grad():
        out = graph.module(seq[:, :prefill_len], torch.full((B,), prefill_len, dtype=torch.int64),
                           eng[:, :prefill_len])
    state = [t for name, t in zip(graph.outputs[1:], out[1:]) if not name.startswith(PROBE_PREFIX) and name != MAIN_HIDDEN]
    pos = torch.full((B,), prefill_len, dtype=torch.int64)
    if pb.kind == "decode":
        return [seq[:, prefill_len:].contiguous(), pos, eng[:, prefill_len:].contiguous(), *state]
    room = min(fed, pb.capacity - prefill_len)  # a chunk's tokens end within the capacity
    valid = torch.tensor([max(1, room - 3 * b) for b in range(B)], dtype=torch.int64)
    return [seq[:, prefill_len:].contiguous(), pos, valid, eng[:, prefill_len:].contiguous(), *state]


@dataclass
class BucketReport:
    """One bucket: its module's facts (compiler/stablehlo.py ModuleFacts as a dict), every
    output's Agreement with the eager step, the two floors' (`dsneuron compare`'s): exact GEMMs
    against fused (how far a change of GEMM summation order moves each output) and the embedding
    one bf16 step up (how far one rounding difference carries), and the wall seconds of each phase
    (export, lower: torch-mlir's import and pipeline, xla_compile, execute, eager)."""

    bucket: str
    facts: dict[str, Any]
    outputs: list[Agreement] = field(default_factory=list)
    floor: list[Agreement] = field(default_factory=list)
    nudge: list[Agreement] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    artifact_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_module(artifact: bytes, args: list[torch.Tensor], what: str) -> tuple[list[torch.Tensor], float, float]:
    """(outputs, compile seconds, execute seconds) of a StableHLO artifact on XLA:CPU."""
    import jax

    from dsneuron.runtime_min.executors.executor_stablehlo import compile_module, to_numpy, to_torch

    t0 = time.perf_counter()
    exe = compile_module(artifact, what)
    t1 = time.perf_counter()
    outs = [to_torch(o) for o in exe.execute([jax.device_put(to_numpy(a)) for a in args])]
    return outs, t1 - t0, time.perf_counter() - t1


def check_bucket(parts: Any, cfg: Any, pb: PlannedBucket, prefill_len: int, seed: int = 0) -> BucketReport:
    """Export bucket `pb` for the neuron target, lower it to StableHLO, execute it on XLA:CPU and
    compare every output with the eager step on the same inputs. parts: compiler/compile.py
    ModelParts built for target "neuron". Raises CompileError (or BundleError without jax) as the
    stages it runs."""
    from dsneuron.kernels_nki.engram_hash import NgramHasher

    from .backend_neuron import StableHLOBackend
    from .compile import export_bucket, step_graph

    backend = StableHLOBackend(None, [])
    hasher = NgramHasher(parts.host_params["engram"]) if parts.host_params.get("engram") else None
    graph = step_graph(parts.steps, pb)
    t0 = time.perf_counter()
    inputs = bucket_inputs(parts.steps, hasher, cfg, pb, prefill_len, seed)
    eager = eager_outputs(graph.module, inputs)
    t1 = time.perf_counter()
    record, program = export_bucket(parts, pb, backend)
    t2 = time.perf_counter()
    module = backend.lower(program, pb.label)
    artifact = module.artifact()
    t3 = time.perf_counter()
    weights = [parts.weights[n].view(getattr(torch, record["views"][n])) if n in record["views"] else parts.weights[n]
               for n in record["weights"]]
    got, compile_s, execute_s = run_module(artifact, [*weights, *inputs], pb.label)
    report = compare_outputs(cfg, pb.label, graph.outputs, got, eager)
    report.facts, report.artifact_bytes = module.facts().to_dict(), len(artifact)
    report.seconds = {"export": t2 - t1, "lower": t3 - t2, "xla_compile": compile_s, "execute": execute_s,
                      "eager": t1 - t0}
    return report


def eager_outputs(step: torch.nn.Module, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
    """(the step's outputs, the same step's with exact GEMMs, with its embedding one bf16 step up),
    run eagerly by torch in the neuron spelling: the reference and the two floors of
    `compare_outputs`. step: a graphs.steps step module (its `order` is the GEMM order)."""
    from dsneuron.graphs.numerics import nudged_embedding
    from dsneuron.kernels_nki.formats import neuron_spelling

    with torch.no_grad(), neuron_spelling():
        want = list(step(*inputs))
        exact = copy.copy(step)  # the same step in another GEMM summation order
        exact.order = "ascending"
        floor = list(exact(*inputs))
        with nudged_embedding():
            nudge = list(step(*inputs))
    return want, floor, nudge


def compare_outputs(cfg: Any, label: str, names: tuple[str, ...], got: list[torch.Tensor],
                    eager: tuple[list[torch.Tensor], ...]) -> BucketReport:
    """A BucketReport (without facts or times) of outputs `got` (named `names`) against the
    `eager_outputs` of the same step on the same inputs."""
    want, floor, nudge = eager
    report = BucketReport(label, {})
    report.outputs = [state_agreement(cfg, n, o, w) for n, o, w in zip(names, got, want)]
    report.floor = [state_agreement(cfg, n, f, w) for n, f, w in zip(names, floor, want)]
    report.nudge = [state_agreement(cfg, n, f, w) for n, f, w in zip(names, nudge, want)]
    return report


def logits_within_floor(report: BucketReport) -> tuple[float, float]:
    """(1 - cos of the module's logits, the larger floor's): `dsneuron compare`'s end-to-end rule
    on one step. A draft bucket's are its draft_logits, and its floor 0: the drafter has one GEMM
    order (graphs/dspark.py DraftStep), so its eager step in "ascending" is the same step."""
    def one_minus_cos(agreements: list[Agreement]) -> float:
        return 1 - next(a.cos for a in agreements if a.name.endswith("logits"))

    return one_minus_cos(report.outputs), max(one_minus_cos(report.floor), one_minus_cos(report.nudge))


def main() -> None:
    """The per-bucket table of the module docstring."""
    import argparse
    import dataclasses
    import json

    from rich.console import Console
    from rich.table import Table

    from .compile import bucket_plan, build_steps_for_config
    from .config import check_indexer, check_speculative, load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="micro")
    ap.add_argument("--indexer", default=None)
    ap.add_argument("--speculative", default=None, help="dspark: the verify buckets too")
    ap.add_argument("--bucket", action="append", help='a bucket label, e.g. "prefill b1 s16" (default: all)')
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    model_cfg, compile_cfg, _ = load_config(a.config)
    if a.indexer:
        compile_cfg = dataclasses.replace(compile_cfg, indexer=check_indexer(a.indexer, "--indexer"))
    if a.speculative:
        compile_cfg = dataclasses.replace(compile_cfg, speculative=check_speculative(a.speculative, "--speculative"))
    parts = build_steps_for_config(model_cfg, compile_cfg, target="neuron")
    plan = bucket_plan(compile_cfg, model_cfg, parts.steps, "neuron")
    console = Console(width=max(Console().width, 200))
    table = Table("bucket", "export s", "lower s", "XLA s", "run s", "KiB", "dot", "gather", "scatter", "sort", "while",
                  "comp.", "f8", "f64", "i64", "max const", "1-cos", "floor", title="StableHLO per bucket")
    reports = []
    for pb in plan.buckets:
        if a.bucket and pb.label not in a.bucket:
            continue
        prefill_len = min(b.seq_len for b in plan.buckets if b.kind == "prefill" and b.batch == pb.batch)
        r = check_bucket(parts, model_cfg, pb, prefill_len)
        reports.append(r)
        f, s = r.facts, r.seconds
        got, floor = logits_within_floor(r)
        table.add_row(r.bucket, f"{s['export']:.1f}", f"{s['lower']:.1f}", f"{s['xla_compile']:.1f}",
                      f"{s['execute']:.2f}", f"{r.artifact_bytes / 1024:.0f}",
                      *(str(f["ops"][k]) for k in ("dot_general", "gather", "scatter", "sort", "while", "composite")),
                      str(len(f["float8_types"])), str(f["f64_ops"]), str(f["i64_ops"]), str(f["largest_constant"]),
                      f"{got:.2e}", f"{floor:.2e}")
        console.print(f"{r.bucket}: done")
    console.print(table)
    if a.json:
        a.json.write_text(json.dumps([r.to_dict() for r in reports], indent=1))


if __name__ == "__main__":
    main()
