"""The neuron path as far as a host without Trainium runs it: each bucket to HLO, executed on XLA:CPU.

On a trn host, backend_neuron.compile_neff runs a bucket's exported program on the XLA device with
`NkiDispatch` answering each NKI op by its kernel, torch-neuronx turns the trace into HLO and
neuronx-cc compiles that into a NEFF. Here torch-xla (2.9, on the torch 2.9 that torch-neuronx 2.9
is built on; `PJRT_DEVICE=CPU`) stands in for the device: `trace_bucket` runs the same program on
the XLA device under the same `NkiDispatch` seam with `REFERENCE_KERNELS`, where each op's
adapter (kernels_nki/neuron_adapters.py) calls the op's torch reference in place of the `@nki.jit`
kernel. So only the kernel call differs from a trn host. The HLO text is checked (`hlo_facts`),
then XLA compiles and executes it on the CPU, and `check_bucket` compares every output with the
same step module run eagerly on the CPU (torch's own float8 casts, the "fused" GEMM order the
neuron target traces).

NOT on this path: neuronx-cc, the NKI kernels inside a NEFF, NEFF execution, Trainium's own
arithmetic. Known wall ahead (reported as `HloFacts.f64_instructions`, not refused): the graphs'
exact float64 dot products, in the inlined `mqa_logits_bf16` reference of the indexer and in
`sparse_attn_ref` where it stands in for the kernel, reach the HLO as f64, which Trainium's
engines do not compute. Needs torch_xla importable (scripts/xla-check makes a venv with it);
backend_hlo.require_torch_xla raises BundleError naming what is missing.
"""

from __future__ import annotations

import copy
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dsneuron.graphs.quant import dequantize_state
from dsneuron.graphs.steps import state_format
from dsneuron.kernels_nki.neuron_adapters import NkiBinding, call_mqa_logits, call_sparse_attn

from dsneuron.runtime_min.schema import BundleError

from .buckets import PlannedBucket
from .export import CompileError

#: The NKI ops the model graphs call, each answered by a torch function with its kernel's calling
#: convention (sparse_attn_ref takes the padded slot table the adapter builds, as the kernel does;
#: dsneuron::mqa_logits is called by the indexer in mode "kernel").
REFERENCE_KERNELS: dict[str, NkiBinding] = {
    "dsneuron::sparse_attn": NkiBinding("dsneuron.kernels_nki.sparse_attn_ref:sparse_attn_ref", call_sparse_attn),
    "dsneuron::mqa_logits": NkiBinding("dsneuron.kernels_nki.mqa_logits_ref:mqa_logits_kernel_ref", call_mqa_logits),
}

def require_torch_xla() -> Any:
    """The torch_xla module; BundleError (exit 2 from the CLI) naming what is missing."""
    try:
        import torch_xla
    except ImportError as e:
        raise BundleError(f"--hlo-only needs torch-xla, which is not importable here ({e}); scripts/xla-check "
                          "makes a venv with torch==2.9.0 and torch-xla==2.9.0 (PJRT_DEVICE=CPU runs it on the CPU)") from None
    return torch_xla


#: HLO ops counted in the report: loops and data-dependent movement, the ops that make or break a
#: static NEFF schedule
COUNTED_OPS = ("while", "sort", "gather", "scatter", "custom-call", "dot", "reduce")

_F8_TYPE = re.compile(r"\bf8e\w+|\bf4e\w+")
# "%name = <shape or (tuple of shapes)> op(" of one HLO instruction
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(\([^=]*?\)|\S+)\s+([a-z][\w-]*)\(", re.M)
_SHAPE = re.compile(r"[a-z]+\d*\[([^\]]*)\]")
_CONSTANT_ELEMS_LIMIT = 4096  # a weight baked into the HLO would be a constant far larger than this


@dataclass
class HloFacts:
    """What `hlo_facts` reads off one HLO module's text.

    float8_types: f8/f4 element types found (must be empty); f64_instructions: instructions with an
    f64 result (reported, not refused: Trainium's engines have no fp64, see the module docstring);
    dynamic_dims: shapes with a bounded
    dynamic dimension ("<=N" or "?"; must be none); parameters: parameter instructions of the entry
    computation; largest_constant: elements of the largest constant (weights are parameters, so
    this stays small); ops: {op: count} of COUNTED_OPS over the whole module; instructions: total.
    """

    float8_types: list[str]
    f64_instructions: int
    dynamic_dims: list[str]
    parameters: int
    largest_constant: int
    ops: dict[str, int]
    instructions: int


def hlo_facts(text: str) -> HloFacts:
    """Parse HLO text (torch_xla `_get_xla_tensors_hlo`) into HloFacts."""
    entry = text[text.find("ENTRY"):] if "ENTRY" in text else text
    ops = {op: 0 for op in COUNTED_OPS}
    largest, instructions, dynamic, f64 = 0, 0, [], 0
    for shape, op in _INSTR.findall(text):
        instructions += 1
        f64 += "f64[" in shape
        if op in ops:
            ops[op] += 1
        for dims in _SHAPE.findall(shape):
            if "<=" in dims or "?" in dims:
                dynamic.append(f"{shape}")
        if op == "constant":
            dims = (_SHAPE.findall(shape) or [""])[0]
            largest = max(largest, math.prod(int(d) for d in dims.split(",") if d.strip().isdigit()))
    return HloFacts(float8_types=sorted(set(_F8_TYPE.findall(text))), f64_instructions=f64, dynamic_dims=dynamic[:5],
                    parameters=len(re.findall(r"\sparameter\(\d+\)", entry)), largest_constant=largest,
                    ops=ops, instructions=instructions)


def hlo_problems(facts: HloFacts, n_inputs: int) -> list[str]:
    """What keeps an HLO module from being a neuron bucket: float8 types, dynamic shapes, fewer
    parameters than the program reads inputs (`used_inputs`: a weight folded into a constant) or
    a large constant."""
    out: list[str] = []
    if facts.float8_types:
        out.append(f"float8 element types {facts.float8_types}")
    if facts.dynamic_dims:
        out.append(f"dynamic shapes {facts.dynamic_dims}")
    if facts.parameters < n_inputs:
        out.append(f"{facts.parameters} parameters for {n_inputs} inputs (weights folded into constants?)")
    if facts.largest_constant > _CONSTANT_ELEMS_LIMIT:
        out.append(f"a constant of {facts.largest_constant} elements (> {_CONSTANT_ELEMS_LIMIT}: a baked weight?)")
    return out


def used_inputs(program: torch.export.ExportedProgram) -> int:
    """How many of the program's user inputs (weights, data, state) some node reads: each is one
    HLO parameter (an unread one, e.g. a state tensor the step passes through, is none)."""
    user = set(program.graph_signature.user_inputs)
    return sum(1 for n in program.graph.nodes if n.op == "placeholder" and n.name in user
               and any(u.op != "output" for u in n.users))


def trace_bucket(program: torch.export.ExportedProgram, args: list[torch.Tensor],
                 bindings: dict[str, NkiBinding] | None = None) -> tuple[list[torch.Tensor], list[str]]:
    """Run `program` on the XLA device with its NKI ops answered through backend_neuron.NkiDispatch
    (lnc 1) by `bindings` (default REFERENCE_KERNELS). args: the program's inputs (weights as the
    bundle stores them, viewed as the export's views say, then data and state), on the host or the
    device. Returns (the outputs as lazy XLA tensors, not yet executed; the aten ops torch-xla ran
    on the host: each such fallback executes the graph so far and cuts it, so a bucket needs none).
    Raises BundleError without torch-xla."""
    torch_xla = require_torch_xla()
    import torch_xla.debug.metrics as metrics

    from .backend_neuron import NkiDispatch, device_module

    dev = torch_xla.device()
    module = device_module(program, dev)
    metrics.clear_all()
    with torch.no_grad(), NkiDispatch(REFERENCE_KERNELS if bindings is None else bindings, 1):
        outs = list(module(*[a.to(dev) for a in args]))
    return outs, sorted(metrics.executed_fallback_ops())


@dataclass
class Agreement:
    """One output of the XLA run against the eager step: bit_identical, and otherwise how far:
    differing (fraction of elements whose bits differ), max_abs, max_rel (max_abs over the largest
    |value| of the eager output), for the logits cos (cosine similarity in fp64), and
    zero_mismatch: one side all zeros and the other not (a dropped write, whatever the bounds)."""

    name: str
    dtype: str
    bit_identical: bool
    differing: float
    max_abs: float
    max_rel: float
    cos: float | None = None
    zero_mismatch: bool = False


def agreement(name: str, got: torch.Tensor, want: torch.Tensor) -> Agreement:
    """Compare one output (`got` from XLA, `want` eager; same shape and dtype, else CompileError).
    NaN equals NaN whatever its payload."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise CompileError(f"{name}: XLA gave {got.dtype} {tuple(got.shape)}, the eager step {want.dtype} {tuple(want.shape)}")
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
    if name == "logits":
        g, w = got.double().flatten(), want.double().flatten()
        cos = float(torch.dot(g, w) / (g.norm() * w.norm()).clamp_min(1e-300))
    zero_mismatch = bool((got == 0).all()) != bool((want == 0).all())
    return Agreement(name, str(want.dtype).removeprefix("torch."), bool(same.all()), differing, max_abs, max_rel, cos,
                     zero_mismatch)


def _bits(t: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


@dataclass
class BucketReport:
    """One bucket's XLA check: its HLO (file, facts, problems), every output's Agreement with the
    eager step, the floor (the eager step in GEMM order "ascending", exact float64 block partials,
    against the same eager step in the neuron target's "fused" order: how far a change of fp32
    summation order alone moves each output) and the wall seconds of each phase."""

    bucket: str
    hlo_file: str
    exported_nodes: int
    facts: HloFacts
    problems: list[str]
    outputs: list[Agreement] = field(default_factory=list)
    floor: list[Agreement] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bucket_inputs(steps: Any, hasher: Any, cfg: Any, pb: PlannedBucket, prefill_len: int, seed: int = 0
                  ) -> list[torch.Tensor]:
    """Data (and state) inputs of bucket `pb` that exercise it: random tokens; prefill rows of
    lengths seq_len, seq_len-3, ...; a decode step after an eager prefill of prefill_len tokens per
    row (its state from that prefill, the token at position prefill_len). Engram ids from `hasher`
    (runtime_min.engram_hash.NgramHasher, None without engram layers)."""
    g = torch.Generator().manual_seed(seed)
    B = pb.batch

    def ids(tokens: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*tokens.shape, 0, 0, dtype=torch.int64) if hasher is None else hasher.hash_sequence(tokens)

    if pb.kind == "prefill":
        S = pb.seq_len
        tokens = torch.randint(2, cfg.vocab_size, (B, S), generator=g)
        valid = torch.tensor([max(1, S - 3 * b) for b in range(B)], dtype=torch.int64)
        return [tokens, valid, ids(tokens)]
    seq = torch.randint(2, cfg.vocab_size, (B, prefill_len + 1), generator=g)
    graph = steps.prefill(B, prefill_len, pb.capacity)
    eng = ids(seq)
    with torch.no_grad():
        out = graph.module(seq[:, :prefill_len], torch.full((B,), prefill_len, dtype=torch.int64),
                           eng[:, :prefill_len])
    state = list(out[1:])
    return [seq[:, prefill_len:], torch.full((B,), prefill_len, dtype=torch.int64), eng[:, prefill_len:], *state]


def check_bucket(parts: Any, cfg: Any, pb: PlannedBucket, work: Path, prefill_len: int, seed: int = 0) -> BucketReport:
    """Export bucket `pb` for the neuron target, trace it on XLA (`trace_bucket`), write its HLO to
    work/<stem>.hlo.txt, execute it on XLA:CPU and compare every output with the eager step on
    the same inputs (`agreement`). parts: compiler/compile.py ModelParts built for target "neuron"."""
    from dsneuron.runtime_min.engram_hash import NgramHasher

    hasher = NgramHasher(parts.host_params["engram"]) if parts.host_params.get("engram") else None
    graph = parts.steps.prefill(pb.batch, pb.seq_len, pb.capacity) if pb.kind == "prefill" \
        else parts.steps.decode(pb.batch, pb.capacity)
    t0 = time.perf_counter()
    inputs = bucket_inputs(parts.steps, hasher, cfg, pb, prefill_len, seed)
    with torch.no_grad():
        want = list(graph.module(*inputs))
        exact = copy.copy(graph.module)  # the same step in another GEMM summation order
        exact.order = "ascending"
        floor = list(exact(*inputs))
    t1 = time.perf_counter()
    from .backend_hlo import HloBackend  # imports this module: not at the top
    from .compile import _export

    record, program = _export(parts, pb, HloBackend())  # the program a neuron compile of pb compiles
    weights = [parts.weights[n].view(getattr(torch, record["views"][n])) if n in record["views"] else parts.weights[n]
               for n in record["weights"]]
    t2 = time.perf_counter()
    outs, fallbacks = trace_bucket(program, [*weights, *inputs])
    hlo = require_torch_xla()._XLAC._get_xla_tensors_hlo(outs)
    t3 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    stem = pb.label.replace(" ", "_")
    hlo_file = work / f"{stem}.hlo.txt"
    hlo_file.write_text(hlo)
    facts = hlo_facts(hlo)
    report = BucketReport(pb.label, str(hlo_file), len(program.graph.nodes), facts,
                          hlo_problems(facts, used_inputs(program))
                          + [f"host fallback of {op}" for op in fallbacks])
    require_torch_xla().sync()
    got = [o.cpu() for o in outs]
    report.seconds = {"eager": t1 - t0, "export": t2 - t1, "trace": t3 - t2, "execute": time.perf_counter() - t3}
    report.outputs = [state_agreement(cfg, n, o, w) for n, o, w in zip(graph.outputs, got, want)]
    report.floor = [state_agreement(cfg, n, f, w) for n, f, w in zip(graph.outputs, floor, want)]
    return report


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
