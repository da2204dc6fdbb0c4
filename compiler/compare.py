"""`dsneuron compare`: a bundle against the eager golden model on the same checkpoint.

This model family amplifies noise (every linear re-quantizes its input to FP8 e4m3, routing and
indexer top-k are discrete), so end-to-end argmax equality is not a criterion. Two levels instead:

End to end, teacher-forced. Per prompt, the bundle generates `n_decode` tokens greedily; the bundle
and the golden then both run prefill + one decode step per token on that same sequence. Per step:
logits cosine, max relative error (max |d| / max |ref|), KL(golden || bundle), top-5 overlap, argmax
match and the golden's top-1/top-2 margin. Next to each, two floors: the golden compared with itself
(a) with every block-scaled GEMM summing its K blocks in reverse order (graphs.numerics.gemm_order; the
compiled steps sum each GEMM in the library's order, a difference of that kind) and (b) with its
embedding output moved one bf16 step up (graphs.numerics.nudged_embedding: how far one rounding
difference carries). (a) can be exactly 0 on small models and short prompts, where no fp32
reordering happens to flip a bf16 rounding; (b) is never 0. The verdict: the bundle's mean 1 - cos
over the steps is no worse than the larger of the two floors' (`end_to_end_verdict`).

Stage by stage (probe bundles only, `dsneuron compile --probes`): every captured stage tensor of the
bundle (per layer: hyper-connection mixes, attention input/output, window KV, compressed KV,
indexer scores and selections, MoE routing and output, engram, the hidden stream; then norm and
logits) against the golden's tensor at the same name and step, next to the floor's, as max error
in bf16 ulps of the golden value, the share of elements more than 2 ulps off (isolated FP8 rounding
flips show up here) and the max relative error. Selections (top-k lists, expert indices, candidate
blocks) are compared as sets per row. Then the local error of every stage the golden can re-run:
the golden's stage on the BUNDLE's recorded input (the compiled executable cannot be entered
mid-graph, the golden can), compared with the bundle's output: the hyper-connection mixes, the
attention of every layer (at a decode step on the state the bundle's step was given), the MoE, and
the head. The re-run uses the bundle's declared GEMM order (the manifest's compiler.gemm_order:
"kernel" on cpu, the cpu kernels themselves; "fused" on neuron), its indexer mode (the manifest's
compiler.indexer) and its kernel numerics (the manifest's numerics: exact, or fast), so a local error is what the compiler did beyond those named deviations. A local error of
0-2 ulps with accumulated error growing along the layers is amplification, not a wrong stage; a
stage that re-quantises inside (MoE: the SwiGLU output to FP8 before w2) can turn one bf16 step of
an fp32 difference into a larger local error at a few elements, which the "> 2 ulp" share counts.

Shapes: the bundle runs at its padded bucket shapes, the golden at exact shapes; a bundle tensor is
cut to the golden's shape from the leading corner (positions count from 0 in both), and prefill
index lists are compared after taking out the offset of the compressed part (the window length,
which is the bucket's seq_len in prefill).
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dsneuron import UserError

#: stages that are selections (index lists, expert ids, candidate masks), compared as sets per row
SELECTIONS = (".indexer.topk", ".attn.idx", ".gate.indices", ".indexer.candidates")
_COMPRESSED = 10**9  # marks compressed-part entries of an index list after taking out the offset


# ----------------------------------------------------------------------------------------- metrics
def logit_metrics(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """got, ref fp32 [V] -> cosine, max_rel (max|d| / max|ref|), kl (ref || got, nats), top5 overlap
    (0..5), argmax match (0/1) and the ref's top-1/top-2 margin."""
    got, ref = got.double(), ref.double()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=0).item()
    max_rel = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    lp, lq = torch.log_softmax(ref, 0), torch.log_softmax(got, 0)
    kl = (lp.exp() * (lp - lq)).sum().item()
    top_ref, top_got = ref.topk(5).indices, got.topk(5).indices
    overlap = len(set(top_ref.tolist()) & set(top_got.tolist()))
    two = ref.topk(2).values
    return {"cos": cos, "max_rel": max_rel, "kl": kl, "top5": overlap, "argmax": float(top_ref[0] == top_got[0]),
            "margin": (two[0] - two[1]).item()}


def bf16_ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| in units of the bf16 spacing at |ref| (2^(e-8) for |ref| in [2^(e-1), 2^e));
    fp32 [..]. Zero and subnormal refs use the spacing at the smallest normal."""
    r = ref.float()
    exp = torch.frexp(r.abs().clamp_min(2.0**-126)).exponent
    return (got.float() - r).abs() / torch.ldexp(torch.ones_like(r), exp - 8)


def tensor_metrics(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """A float stage: max_ulp (bf16 ulps), over2 (share of elements > 2 ulps off), max_rel."""
    if got.shape != ref.shape:
        raise ValueError(f"shape {tuple(got.shape)} vs golden {tuple(ref.shape)}")
    if ref.numel() == 0:  # e.g. no compressed group yet at a 1-token prefill
        return {"max_ulp": 0.0, "over2": 0.0, "max_rel": 0.0}
    finite = torch.isfinite(ref.float()) & torch.isfinite(got.float())
    same_inf = (got.float() == ref.float()) & ~finite
    if not bool((finite | same_inf).all()):
        return {"max_ulp": math.inf, "over2": 1.0, "max_rel": math.inf}
    if not bool(finite.any()):
        return {"max_ulp": 0.0, "over2": 0.0, "max_rel": 0.0}
    u = bf16_ulps(got[finite], ref[finite])
    d = (got[finite].float() - ref[finite].float()).abs()
    scale = ref[finite].float().abs().max().clamp_min(1e-30)
    return {"max_ulp": u.max().item(), "over2": (u > 2).float().mean().item(), "max_rel": (d.max() / scale).item()}


def selection_metrics(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """A selection stage: rows (last dim = the selected set, or a boolean mask) whose sets differ."""
    if got.shape != ref.shape:
        raise ValueError(f"shape {tuple(got.shape)} vs golden {tuple(ref.shape)}")
    if got.dtype != torch.bool:
        got, ref = got.sort(-1).values, ref.sort(-1).values
    rows = (got != ref).reshape(-1, got.shape[-1]).any(-1) if got.dim() else (got != ref).reshape(1)
    return {"rows_differ": rows.float().mean().item() if rows.numel() else 0.0}


def _cut(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """t cut to `shape` from the leading corner (bundle padding beyond the golden's positions)."""
    if t.dim() != len(shape) or any(a < b for a, b in zip(t.shape, shape)):
        raise ValueError(f"bundle shape {tuple(t.shape)} does not cover golden {tuple(shape)}")
    return t[tuple(slice(0, n) for n in shape)]


def _unoffset(idx: torch.Tensor, offset: int) -> torch.Tensor:
    """Index list with its compressed part (entries >= offset) relabelled independent of offset."""
    return torch.where(idx >= offset, idx - offset + _COMPRESSED, idx)


def stage_metrics(name: str, got: torch.Tensor, ref: torch.Tensor, offsets: tuple[int, int] | None) -> dict[str, float]:
    """One stage: selection or float metrics of bundle `got` against golden `ref`. offsets: (bundle,
    golden) window lengths in prefill, to align the index lists' compressed parts."""
    got = _cut(got, ref.shape)
    if name.endswith(SELECTIONS):
        if offsets is not None and name.endswith((".indexer.topk", ".attn.idx")):
            got, ref = _unoffset(got.long(), offsets[0]), _unoffset(ref.long(), offsets[1])
        return selection_metrics(got, ref)
    return tensor_metrics(got, ref)


# ----------------------------------------------------------------------------------------- local re-runs
def local_reruns(model: Any, probes: dict[str, torch.Tensor], prefill_len: int | None = None,
                 decode_pos: int | None = None, state: dict[str, torch.Tensor] | None = None,
                 engram_ids: torch.Tensor | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The golden's stages re-run on the bundle's recorded inputs (one step, batch row 0):
    {stage: (bundle output, golden output on the bundle's input)}, the bundle's at its bucket shape
    (compare them with `stage_metrics`). model: graphs.model.Transformer.

    Give prefill_len (the prompt length) at the prefill step, or decode_pos (the token's position)
    and state (the state tensors the bundle's decode step was given, batch 1, `StepResult.state_in`)
    at a decode step. Attention is re-run layer by layer in order on each layer's recorded input, so
    a layer that reads another layer's compressed KV, indexer keys, top-k or candidate blocks gets
    them from the golden re-run of that source layer on the bundle's input; the stages inside each
    attention (quantised window and compressed KV, indexer scores, candidate blocks, top-k, index
    list, the sparse attention result `attn.core`) are returned too, and the output projection
    (`attn.out`) is re-run on the bundle's `attn.core`. With engram_ids (int64 [1, L, E, C], the
    golden's hash ids of this step's tokens) the engram layers are re-run too. The mixes, the MoE
    (in its exported form: dense at prefill, routed experts gathered at decode) and the head are
    pure functions of their recorded inputs."""
    from dsneuron.graphs.context import Capture
    from dsneuron.graphs.mhc import hc_post
    from dsneuron.graphs.steps import init_state

    if (prefill_len is None) == (decode_pos is None) or (decode_pos is not None and state is None):
        raise ValueError("local_reruns: give prefill_len, or decode_pos with state")
    inside = Capture()  # what each attention re-run computes on the way: quantised KV, scores, selections
    if prefill_len is not None:
        L = prefill_len
        ctx = model.inputs(L, torch.arange(L).unsqueeze(0), torch.tensor([L]), None, inside)
        state = init_state(model.cfg, 1, model.max_seq_len)
    else:
        L = 1
        pos = torch.tensor([decode_pos])
        ctx = model.inputs(1, pos.unsqueeze(1), None, pos, inside)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    shared: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}"
        if layer.engram is not None and engram_ids is not None and f"{p}.engram.in" in probes:
            e = model.cfg.engram_layer_ids.index(i)
            o = layer.engram(probes[f"{p}.engram.in"][:L].unsqueeze(0), engram_ids[:, :, e])
            out[f"{p}.engram.out"] = (probes[f"{p}.engram.out"], o[0])
        if f"{p}.attn.in" in probes:
            layer.attn(probes[f"{p}.attn.in"][:L].unsqueeze(0), ctx, state, {}, shared)
            if f"{p}.attn.core" in probes:
                cos, sin = ctx.rope[layer.attn.ratio > 0]
                o = layer.attn.output(probes[f"{p}.attn.core"][:L].unsqueeze(0), cos, sin)
                out[f"{p}.attn.out"] = (probes[f"{p}.attn.out"], o[0])
        x_in = probes.get(f"{p}.engram.out", probes.get(f"layers.{i - 1}.out"))
        if x_in is not None and f"{p}.hc_attn.comb" in probes:
            for j, t in enumerate(layer.hc_mixes(x_in.unsqueeze(0), "attn")):
                part = ("pre", "post", "comb")[j]
                out[f"{p}.hc_attn.{part}"] = (probes[f"{p}.hc_attn.{part}"], t[0])
            mid = hc_post(probes[f"{p}.attn.out"].unsqueeze(0), x_in.unsqueeze(0),
                          probes[f"{p}.hc_attn.post"].unsqueeze(0), probes[f"{p}.hc_attn.comb"].unsqueeze(0))
            for j, t in enumerate(layer.hc_mixes(mid, "ffn")):
                part = ("pre", "post", "comb")[j]
                out[f"{p}.hc_ffn.{part}"] = (probes[f"{p}.hc_ffn.{part}"], t[0])
        if f"{p}.ffn.in" in probes:
            # as the exported steps run it (routed=False: grouped in kernel order, dense or gathered
            # in fused order, whose GEMM calls hold other rows than the routed loop's)
            out[f"{p}.ffn.out"] = (probes[f"{p}.ffn.out"], layer.ffn(probes[f"{p}.ffn.in"].unsqueeze(0), routed=False)[0])
    if "final.norm" in probes:
        out["final.logits"] = (probes["final.logits"], model.head(probes["final.norm"].unsqueeze(0).float())[0])
    out.update({name: (probes[name], t[0]) for name, t in inside.tensors.items() if name in probes})
    return out


# ----------------------------------------------------------------------------------------- the run
@dataclass
class PromptReport:
    """One prompt: n_prompt tokens + the decoded ids; per step the end-to-end metrics (bundle and
    floor), and with probes per stage and step {stage: {"bundle": m, "floor": m, "local": m}}."""

    name: str
    n_prompt: int
    n_steps: int
    steps: list[dict[str, dict[str, float]]] = field(default_factory=list)
    stages: dict[str, list[dict[str, dict[str, float]]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "n_prompt": self.n_prompt, "n_steps": self.n_steps,
                "verdict": end_to_end_verdict(self), "steps": self.steps, "stages": self.stages}


def compare_bundle(bundle: Path, prompts: list[tuple[str, str]] | None, n_decode: int = 8, checkpoint: Path | None = None,
                   cache_dir: Path | None = None, log: Callable[[str], None] = print,
                   verify_key: Path | None = None) -> list[PromptReport]:
    """Run the comparison (module docstring) for each prompt that fits the bundle.

    prompts: [(name, text)]; None takes the shipped ones (default_prompts.NAMES), or the small set
    (SMALL_NAMES) when one of those does not fit the bundle. verify_key: as Session.load.
    checkpoint: the checkpoint the bundle was compiled from (default: the manifest's compile.checkpoint,
    or the deterministic one of its seed, made under `cache_dir` if missing).
    Raises BundleError for a bundle that does not load, UserError when no prompt fits its buckets or
    capacity, or n_decode < 0.
    """
    from dsneuron.compiler.config import CompileConfig
    from dsneuron.compiler.default_prompts import shipped_prompts
    from dsneuron.compiler.model_steps import checkpoint_for
    from dsneuron.graphs.config import ModelConfig
    from dsneuron.graphs.golden import Golden
    from dsneuron.runtime_min.session import Session

    if n_decode < 0:
        raise UserError(f"--decode must be >= 0, got {n_decode}")
    session = Session.load(bundle, verify_key)
    m = session.manifest
    model_cfg = ModelConfig.from_dict(m.model_config)
    compile_cfg = CompileConfig.from_dict(m.compile_config)
    ckpt = Path(checkpoint) if checkpoint is not None else checkpoint_for(model_cfg, compile_cfg, cache_dir)
    max_prefill = max(b.seq_len for b in m.buckets if b.kind == "prefill")

    def fits(ids: list[int]) -> bool:
        return len(ids) <= max_prefill and len(ids) + n_decode <= session.max_capacity

    if prompts is None:
        prompts = shipped_prompts(lambda text: fits(session.encode(text)))
    todo, text_of = [], dict(prompts)
    for name, text in prompts:
        ids = session.encode(text)
        if not fits(ids):
            log(f"skipping prompt {name!r}: {len(ids)} tokens + {n_decode} decode steps do not fit this bundle "
                f"(largest prefill bucket {max_prefill}, context capacity {session.max_capacity})")
            continue
        todo.append((name, ids))
    if not todo:
        raise UserError(f"no prompt fits this bundle (largest prefill bucket {max_prefill} tokens, context capacity "
                        f"{session.max_capacity}); pass shorter prompts with --prompts FILE or fewer --decode steps")
    runs = []
    for name, ids in todo:
        log(f"prompt {name!r}: {len(ids)} tokens + {n_decode} decode steps")
        # the continuation is the bundle's greedy one (EOS may end it early); both sides are then fed it
        seq = ids + (session.generate_ids([text_of[name]], n_decode)[0] if n_decode else [])
        runs.append((name, seq, len(ids), session.teacher_forced(seq, len(ids))))
    compiler, capacity, tokenizer = declared_numerics(session.manifest), session.max_capacity, session.bundle.tokenizer_file
    # the bundle's side is done: its weights go before the golden's come (at V4.1's widths each
    # takes most of the memory a host of this kind has)
    del session
    gc.collect()
    golden = Golden(model_cfg, ckpt, capacity, tokenizer=tokenizer)
    return [compare_records(got, compiler, golden, name, seq, n_prompt) for name, seq, n_prompt, got in runs]


def compare_sequence(session: Any, golden: Any, name: str, seq: list[int], n_prompt: int) -> PromptReport:
    """Both levels of the comparison for one teacher-forced sequence: prefill seq[:n_prompt], then one
    decode step per remaining id. session: runtime_min Session; golden: graphs.golden.Golden on the
    bundle's checkpoint. Raises UserError as Session.teacher_forced (prompt or sequence too long)."""
    return compare_records(session.teacher_forced(seq, n_prompt), declared_numerics(session.manifest), golden, name, seq,
                           n_prompt)


def declared_numerics(manifest: Any) -> dict[str, Any]:
    """A manifest's `compiler` section with its kernel numerics added as "numerics" (Manifest.numerics):
    everything the local re-runs take from the bundle."""
    return {**manifest.compiler, "numerics": manifest.numerics}


def compare_records(got: list[Any], compiler: dict[str, Any], golden: Any, name: str, seq: list[int],
                    n_prompt: int) -> PromptReport:
    """`compare_sequence` on the bundle's records of that sequence, already run: got, the
    Session.teacher_forced records; compiler, `declared_numerics` of the bundle's manifest (its GEMM
    order, indexer mode and kernel numerics, which the local re-runs take)."""
    from dsneuron.graphs.numerics import gemm_order, indexer_mode, kernel_numerics, nudged_embedding

    probes = bool(got[0].probes)
    ref = golden.teacher_forced(seq, n_prompt, capture=probes)
    with gemm_order("descending"):
        floor = golden.teacher_forced(seq, n_prompt, capture=probes)
    with nudged_embedding():
        nudge = golden.teacher_forced(seq, n_prompt)
    rep = PromptReport(name, n_prompt, len(got))
    engram_ids = golden.engram_ids(torch.tensor([seq]))  # [1, len(seq), E, C]
    for step, (g, r, f, n) in enumerate(zip(got, ref, floor, nudge)):
        rep.steps.append({"bundle": logit_metrics(g.logits, r.logits), "floor": logit_metrics(f.logits, r.logits),
                          "nudge": logit_metrics(n.logits, r.logits)})
        if not probes:
            continue
        prefill = step == 0
        offsets = (_bucket_seq_len(g.probes), n_prompt) if prefill else None
        for stage, r_t in r.capture.items():
            if stage not in g.probes:  # a probe bundle compiled before the stage was captured
                continue
            r_t = r_t[0]  # golden batch row 0, as the bundle's probes
            entry = {"bundle": stage_metrics(stage, g.probes[stage], r_t, offsets),
                     "floor": stage_metrics(stage, f.capture[stage][0], r_t, (n_prompt, n_prompt) if prefill else None)}
            rep.stages.setdefault(stage, []).append(entry)
        # the golden stage in the bundle's declared numerics: its GEMM order (the cpu kernels', or
        # one fp32 GEMM per projection on neuron)
        order = compiler.get("gemm_order", "fused")
        if order == "kernel":
            golden.attach_kernel_weights()
        indexer, numerics = compiler.get("indexer", "official"), compiler.get("numerics", "exact")
        with torch.inference_mode(), gemm_order(order), indexer_mode(indexer), kernel_numerics(numerics):
            if prefill:
                at = {"prefill_len": n_prompt, "engram_ids": engram_ids[:, :n_prompt]}
            else:
                p = n_prompt + step - 1
                at = {"decode_pos": p, "state": g.state_in, "engram_ids": engram_ids[:, p:p + 1]}
            for stage, (b_out, g_out) in local_reruns(golden.model, g.probes, **at).items():
                rep.stages[stage][-1]["local"] = stage_metrics(stage, b_out, g_out, offsets)
    return rep


#: fp32 stages: a local error past 2 bf16 ulps at most this relative is an fp32 sum in another order
FP32_STAGES = (".hc_attn.pre", ".hc_attn.post", ".hc_attn.comb", ".hc_ffn.pre", ".hc_ffn.post", ".hc_ffn.comb",
               ".gate.weights", "final.logits")
FP32_REORDER_REL = 1e-6
#: stages rounded to FP8/FP4 (QDQ) from an fp32 result: a reordered sum moves a value across a
#: rounding boundary now and then, one quantisation step (120 bf16 ulps at most: an e2m1 step of
#: 0.5 at 1.0 is 64, at 1.5 it is about 85; an e4m3 step 16), at isolated elements
QDQ_STAGES = (".compress_kv.entry", ".attn.window_kv")
QDQ_STEP_ULPS = 128
QDQ_SHARE = 0.02
#: stages that re-quantise inside (the FP8 activation QDQ before each FP8 GEMM: the attention's
#: query, compressor and output projections, the MoE's SwiGLU output before w2, the engram
#: projection; the indexer's FP4 QDQ of its query): a flipped value there moves isolated output elements
QDQ_INSIDE = (".attn.core", ".attn.out", ".indexer.scores", ".ffn.out", ".engram.out", ".compressor.latent")
#: stages that read the step's compressed KV, which carry a QDQ step of it on to every query that
#: attends to the flipped entry
AFTER_QDQ = (".attn.core", ".attn.out", ".indexer.scores")


def local_deviations(rep: PromptReport) -> list[tuple[str, int, float, str | None]]:
    """Every local re-run past 2 bf16 ulps as (stage, step, max_ulp, named deviation or None). Named:
    "fp32 order" (an fp32 stage at most FP32_REORDER_REL off), "QDQ step" (a QDQ stage off at no more
    than QDQ_SHARE of its elements, by at most QDQ_STEP_ULPS), "QDQ inside" (a stage of QDQ_INSIDE
    off at no more than QDQ_SHARE of its elements), "after a QDQ step" (a stage of AFTER_QDQ at a
    step where a QDQ stage had a QDQ step). Targets that sum in their own order (the neuron
    target's StableHLO on XLA) show these; the cpu target's kernels follow the golden's. The local
    re-run recomputes a layer's KV caches from its input, so a stage that reads them carries their
    QDQ steps: feeding it the bundle's own caches would take those out (not done)."""
    flipped = {i for stage, per_step in rep.stages.items() if stage.endswith(QDQ_STAGES)
               for i, e in enumerate(per_step) if e.get("local", {}).get("max_ulp", 0.0) > 2}
    out = []
    for stage, per_step in rep.stages.items():
        for i, e in enumerate(per_step):
            m = e.get("local", {})
            if m.get("max_ulp", 0.0) <= 2:
                continue
            reason = None
            if stage.endswith(FP32_STAGES) and m["max_rel"] <= FP32_REORDER_REL:
                reason = "fp32 order"
            elif stage.endswith(QDQ_STAGES) and m["max_ulp"] <= QDQ_STEP_ULPS and m["over2"] <= QDQ_SHARE:
                reason = "QDQ step"
            elif stage.endswith(QDQ_INSIDE) and m["over2"] <= QDQ_SHARE:
                reason = "QDQ inside"
            elif stage.endswith(AFTER_QDQ) and i in flipped:
                reason = "after a QDQ step"
            out.append((stage, i, m["max_ulp"], reason))
    return out


def worst_local(rep: PromptReport, metric: str = "max_ulp") -> tuple[str, float]:
    """(stage, value) of the largest local error over all steps: `metric` "max_ulp" (bf16 ulps of a
    float stage) or "rows_differ" (share of rows whose selected set differs); ("", 0.0) without one."""
    worst = ("", 0.0)
    for stage, per_step in rep.stages.items():
        for entry in per_step:
            value = entry.get("local", {}).get(metric, 0.0)
            if value > worst[1]:
                worst = (stage, value)
    return worst


def end_to_end_verdict(rep: PromptReport) -> dict[str, float | bool]:
    """Mean over the steps of 1 - cos for the bundle and both floors; ok when the bundle's is no
    larger than the larger floor's."""
    mean = {who: sum(1 - s[who]["cos"] for s in rep.steps) / len(rep.steps) for who in ("bundle", "floor", "nudge")}
    return {**mean, "ok": mean["bundle"] <= max(mean["floor"], mean["nudge"])}


def _bucket_seq_len(probes: dict[str, torch.Tensor]) -> int:
    """The prefill bucket's seq_len, read off a per-position probe (the window KV of layer 0)."""
    return int(probes["layers.0.attn.window_kv"].shape[0])


# ----------------------------------------------------------------------------------------- output
def stage_kind(stage: str) -> str:
    """"layers.3.attn.out" -> "attn.out" (stages aggregate over layers in the terminal table)."""
    parts = stage.split(".")
    return ".".join(parts[2:]) if parts[0] == "layers" else stage


def summarise_stages(report: PromptReport) -> dict[str, dict[str, float]]:
    """Per stage kind, over layers and steps: worst bundle/floor/local max_ulp, mean over2, worst
    max_rel (float stages) or mean rows_differ (selections)."""
    out: dict[str, dict[str, float]] = {}
    for stage, per_step in report.stages.items():
        agg = out.setdefault(stage_kind(stage), {})
        for entry in per_step:
            for who, m in entry.items():
                for key, v in m.items():
                    k = f"{who}.{key}"
                    if key in ("max_ulp", "max_rel"):
                        agg[k] = max(agg.get(k, 0.0), v)
                    else:
                        agg[k + ".sum"] = agg.get(k + ".sum", 0.0) + v
                        agg[k + ".n"] = agg.get(k + ".n", 0.0) + 1
    for agg in out.values():
        for k in [k for k in agg if k.endswith(".sum")]:
            agg[k[:-4]] = agg.pop(k) / agg.pop(k[:-4] + ".n")
    return out


def render(reports: list[PromptReport], console: Any) -> None:
    """Terminal tables: end to end per prompt and step (bundle | floor), then stages per prompt."""
    from rich.table import Table

    for rep in reports:
        t = Table(title=f"{rep.name}: {rep.n_prompt} prompt tokens, {rep.n_steps - 1} decode steps "
                        "(bundle | floor reversed K blocks | floor nudged embedding)")
        for col in ("step", "cos", "max rel", "KL", "top-5", "argmax", "margin"):
            t.add_column(col, justify="right")
        for i, s in enumerate(rep.steps):
            b, f, n = s["bundle"], s["floor"], s["nudge"]
            t.add_row("prefill" if i == 0 else f"decode {i}", f"{b['cos']:.4f} | {f['cos']:.4f} | {n['cos']:.4f}",
                      f"{b['max_rel']:.1e} | {f['max_rel']:.1e} | {n['max_rel']:.1e}",
                      f"{b['kl']:.0e} | {f['kl']:.0e} | {n['kl']:.0e}", f"{b['top5']} | {f['top5']} | {n['top5']}",
                      f"{b['argmax']:.0f} | {f['argmax']:.0f} | {n['argmax']:.0f}", f"{b['margin']:.3f}")
        console.print(t)
        v = end_to_end_verdict(rep)
        used, name = max((v["floor"], "reversed K blocks"), (v["nudge"], "nudged embedding"))
        ratio = f", {v['bundle'] / used:.2f}x the floor" if used > 0 else ""
        local = ""
        if rep.stages:
            devs = local_deviations(rep)
            bad = [d for d in devs if d[3] is None]
            named = {}
            for d in devs:
                if d[3] is not None:
                    named[d[3]] = named.get(d[3], 0) + 1
            local = ("; stages: every local re-run within 2 bf16 ulps" if not devs else
                     "; stages: every local re-run within 2 bf16 ulps but named deviations ("
                     + ", ".join(f"{n} {why}" for why, n in named.items()) + ")" if not bad else
                     f"; stages: a local re-run is {max(d[2] for d in bad):.3g} bf16 ulps off at "
                     f"{max(bad, key=lambda d: d[2])[0]} (more than 2, not a named deviation)")
        console.print(f"end to end, mean 1 - cos: bundle {v['bundle']:.2e}; floors {v['floor']:.2e} (reversed K) and "
                      f"{v['nudge']:.2e} (nudged); the floor used is the larger, {name} ({used:.2e}), margin "
                      f"{used - v['bundle']:+.2e}{ratio}: {'no worse than the floor' if v['ok'] else 'WORSE than the floor'}"
                      f"{local}", soft_wrap=True)  # one line a script can grep, whatever the terminal width
        if not rep.stages:
            console.print("no stage probes in this bundle: compile it with --probes for the stage-by-stage table")
            continue
        st = Table(title=f"{rep.name}: stages over all layers and steps (bundle | floor; local = golden stage on the bundle's input)")
        for col in ("stage", "max ulp", "> 2 ulp", "max rel", "local max ulp", "rows differ"):
            st.add_column(col, justify="right" if col != "stage" else "left")
        for kind, a in summarise_stages(rep).items():
            if "bundle.rows_differ" in a:
                local = f" (local {a['local.rows_differ']:.3f})" if "local.rows_differ" in a else ""
                st.add_row(kind, "", "", "", "", f"{a['bundle.rows_differ']:.3f} | {a['floor.rows_differ']:.3f}{local}")
            else:
                local = f"{a['local.max_ulp']:.1f}" if "local.max_ulp" in a else "-"
                st.add_row(kind, f"{a['bundle.max_ulp']:.1f} | {a['floor.max_ulp']:.1f}",
                           f"{a['bundle.over2']:.4f} | {a['floor.over2']:.4f}",
                           f"{a['bundle.max_rel']:.2e} | {a['floor.max_rel']:.2e}", local, "")
        console.print(st)
        stage, ulps = worst_local(rep)
        console.print(f"largest local error (golden stage on the bundle's input): {ulps:.3g} bf16 ulps at {stage or '-'} (goal: <= 2)",
                      soft_wrap=True)
        sel_stage, rows = worst_local(rep, "rows_differ")
        console.print("local selections (golden top-k on the bundle's input): "
                      + (f"rows differ at {sel_stage}, share {rows:.3f}" if rows else "all identical"))
