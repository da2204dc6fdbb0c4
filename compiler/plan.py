"""`dsneuron plan`: what a config's bucket plan costs per rank, and whether it fits an instance.

    dsneuron plan --config v4.1-flash --target neuron --instance trn2.48xlarge --tp 64 [--ep 64] [--json OUT]

For every bucket of the plan (compiler/buckets.py) and every rank it reports, without allocating
any model tensor (the model is built on fake tensors, torch._subclasses.FakeTensorMode, so the two
384M x 256 engram tables of V4.1-Flash are never materialised):

- FLOPs of the step: prefill for the bucket's batch x seq_len tokens, decode per token. Counted by
  torch.utils.flop_counter.FlopCounterMode on the stage graphs (graphs/stages.py) run on fake
  tensors in the golden's GEMM order "ascending" (the same products as the neuron steps' "fused"
  order, without the zero rows "fused" pads calls of fewer than 8 rows to; prefill attention
  stages, whose GEMMs all have >= 8 rows, run "fused", see `_walk`). Convention: 2 x the
  multiply-adds of the matrix products (GEMMs, batched GEMMs, einsums); elementwise work is not
  counted. The two attention custom ops are counted by formula (`CUSTOM_FLOPS`; the tests check
  the formulas against a count of their torch references): sparse_attn 4*B*S*H*K*D (q.k and P@V
  over the K index slots, empty slots included, as the kernel processes them), mqa_logits_bf16
  2*B*S*H*T*D. The per-token stages (embedding, engram, MoE half; graphs/stages.py `per_token`) are
  counted on one token and multiplied by the bucket's token count; the routed experts' count is
  then multiplied by the rows the exported MoE computes per routed pair (`expert_rows_factor`: the
  blockwise layout's padding, graphs/moe_blocks.py, at most 1.25x, or E/k where every expert on
  every token is fewer rows). The head reads one position per row.
- Weight bytes held by the rank, in checkpoint formats (FP8 e4m3 + UE8M0 scales, FP4 experts,
  bf16/fp32 small tensors), summed over graphs/spec.py `checkpoint_spec` with the parallel rule
  below, so they agree with a real checkpoint's safetensors headers. DSpark (mtp.*) tensors are not
  placed (basic mode does not run them); engram tables stay on the host.
- Decode state bytes per sequence at the bucket's capacity: graphs/steps.py `state_layout`, times
  the bucket's batch. The state is replicated on every rank (one MQA latent per position: there is
  no KV head to split, as NxDI replicates KV heads when kv_heads < tp).
- Activation peak: the largest live intermediates of one stage at the bucket's shape, measured, not
  estimated by hand: each distinct stage is run on fake tensors, with the parallel rule applied to
  the model (`rank_config`: the rank's heads, its experts, its share of the vocabulary) in the
  neuron steps' GEMM order ("fused"), and a dispatch mode (`_LiveBytes`) adds up the storage bytes
  of every tensor the stage's ops create and still hold, in eager order; the peak over the run,
  plus the stage's non-state inputs, is the stage's figure; the bucket's is the largest stage's.
  It includes what the graph as written materialises: the dequantised weight copies (tensors
  computed from weights alone, shown apart: e.g. V4.1's engram.wkv decoded to fp32 in the XLA
  spelling's integer arithmetic), a prefill stage's fresh state (which the state column counts
  too); a compiler that fuses the decode into the GEMM, or aliases the state, needs less.
- HBM need = weights + batch x state + activation peak, against the instance's HBM per rank; a plan
  that does not fit is refused (exit 2) naming the bucket, the rank and the numbers. No reserve is
  taken for the runtime, the executables' code or collective buffers.
- The distinct stage kinds to compile (graphs/stages.py attn_kind / ffn_kind) and the layers each
  serves.
- The weight bytes one decode token reads (the whole head, every layer's dense weights, the
  activated routed experts and the shared expert, the looked-up engram rows, one embedding row) and
  the roofline time per token: the slowest rank's bytes / the rank's HBM bandwidth. The slowest
  rank holds the largest share and, under balanced routing (the best case for it), reads
  ceil(k / EP) expert slices per layer; engram rows come from the host and are listed apart.

Parallel plan and instances: compiler/placement.py (the one rule, `placement`, which the sharded
compile reuses).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from dsneuron import UserError
from dsneuron.graphs.config import ModelConfig

from .buckets import PlannedBucket, plan_buckets
from .config import CompileConfig
from .placement import (EXPERTS, HOST, REPLICATED, TP, UNUSED, VOCAB, GiB, Instance, Parallel, check_parallel,
                        default_parallel, device_bytes, placement, rank_config, resolve_instance, spec_bytes,
                        vocab_rows, weight_bytes)

# ----------------------------------------------------------------------------------------- fake runs


def _sparse_attn_flops(q, kv, sink, idx, scale, out_shape=None, **kw) -> int:
    b, s, h, d = q
    return 4 * b * s * h * idx[2] * d


def _mqa_logits_bf16_flops(q, k, w, out_shape=None, **kw) -> int:
    b, s, h, d = q
    return 2 * b * s * h * k[1] * d


def custom_flops() -> dict:
    """FlopCounterMode custom_mapping for the model's two attention custom ops (module docstring)."""
    import torch

    import dsneuron.kernels_nki  # noqa: F401  registers the ops

    return {torch.ops.dsneuron.sparse_attn: _sparse_attn_flops,
            torch.ops.dsneuron.mqa_logits_bf16: _mqa_logits_bf16_flops}


def _live_bytes_mode(known: set, weights: set):
    """A TorchDispatchMode that tracks the storage bytes of the tensors the ops under it create and
    that are still referenced (storages in `known`, i.e. inputs and weights, excluded). `.peak`: the
    largest total; `.peak_weights`: how much of it, at that moment, was computed from weights alone
    (storages in `weights` or derived from them only: the in-graph dequantised weight copies)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live: dict[Any, tuple[int, bool]] = {}
            self.derived: set[int] = set(weights)
            self.now = self.now_weights = self.peak = self.peak_weights = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for ref in [r for r in self.live if r.expired()]:
                n, from_weights = self.live.pop(ref)
                self.now -= n
                self.now_weights -= n if from_weights else 0
            ins = [StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)]
            from_weights = bool(ins) and all(c in self.derived for c in ins)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    ref = StorageWeakRef(st)
                    if from_weights:
                        self.derived.add(ref.cdata)
                    if ref.cdata not in known and ref not in self.live:
                        self.live[ref] = (st.nbytes(), from_weights)
                        self.now += st.nbytes()
                        self.now_weights += st.nbytes() if from_weights else 0
            if self.now > self.peak:
                self.peak, self.peak_weights = self.now, self.now_weights
            return out

    return LiveBytes()


@functools.lru_cache(maxsize=4)
def _fake_model(cfg: ModelConfig, max_seq_len: int):
    """(FakeTensorMode, Transformer on fake tensors) for `cfg`: no parameter has storage. The
    engram tables get one row per hash column: they stay on the host, which sends the looked-up
    rows (the parallel rule), so no table-sized temporary of the in-graph lookup is counted; their
    bytes come from checkpoint_spec."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from dsneuron.graphs.model import Transformer

    rows = ((cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads,) * len(cfg.engram_layer_ids)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    with mode:
        model = Transformer(cfg, rows, max_seq_len)
    return mode, model


def _bucket_env(cfg: ModelConfig, b: PlannedBucket):
    """(wiring values, state names) of bucket b: its data inputs, and its decode state for a decode
    or chunk bucket (a chunk: the capacity's last S positions); made inside a FakeTensorMode by the
    caller, so nothing is allocated."""
    import torch

    from dsneuron.graphs.steps import n_engram_cols, state_layout

    E, C = n_engram_cols(cfg)
    B, S = b.batch, b.seq_len
    env = {"tokens": torch.zeros(B, S, dtype=torch.int64)}
    if b.kind != "decode":  # a prefill's, or a chunk's: its S tokens are real
        env["valid_len"] = torch.full((B,), S, dtype=torch.int64)
    if b.kind != "prefill":  # a decode step at the last position; a chunk ending there
        env["pos"] = torch.full((B,), b.capacity - (S if b.kind == "chunk" else 1), dtype=torch.int64)
    for e in range(E):
        env[f"engram_ids.{e}"] = torch.zeros(B, S, C, dtype=torch.int64)
    state = state_layout(cfg, B, b.capacity)
    if b.kind != "prefill":
        for n, (shape, dtype) in state.items():
            env[n] = torch.empty(shape, dtype=dtype)
    return env, set(state)


def _walk(cfg: ModelConfig, max_seq_len: int, b: PlannedBucket, order: str, visit: Callable):
    """Run bucket b's stages in order on fake tensors, in the neuron graphs' spelling
    (kernels_nki/formats.py neuron_spelling); each distinct (kind, input shapes) stage is given to
    visit(stage, args, mode) once, which returns its outputs; returns [(stage, key)].
    order "count": "ascending" (no padded GEMM rows) except the attention stages of a prefill whose
    every GEMM has at least MIN_GEMM_ROWS rows, which run "fused" (the same products, one GEMM
    instead of float64 chunks: minutes faster on the real model)."""
    import torch

    from dsneuron.graphs.quant import MIN_GEMM_ROWS
    from dsneuron.graphs.stages import build_stages, head_position
    from dsneuron.kernels_nki.formats import neuron_spelling

    mode, model = _fake_model(cfg, max_seq_len)
    if order == "count":
        ratio = max(cfg.compress_ratios[:cfg.n_layers])
        big = b.kind == "prefill" and b.batch * b.seq_len // max(ratio, 1) >= MIN_GEMM_ROWS
        stages = build_stages(model, b.kind, b.batch, b.capacity, order="ascending")
        for st in stages:
            if big and not st.per_token:
                st.module.order = "fused"
    else:
        stages = build_stages(model, b.kind, b.batch, b.capacity, order=order)
    done: dict[tuple, tuple] = {}
    seq = []
    with mode, neuron_spelling():
        values, _ = _bucket_env(cfg, b)
        values["last"] = head_position(values)
        for st in stages:
            args = [values[n] for n in st.inputs]
            key = (st.kind, *((tuple(a.shape), a.dtype) for a in args))
            if key not in done:
                done[key] = tuple(visit(st, args, mode))
            values.update(zip(st.outputs, (torch.empty_like(t) for t in done[key])))
            seq.append((st, key))
    return seq


def _module_key(st, fqn: str) -> str:
    """A FlopCounterMode module path of stage st -> the `placement` name it stands for."""
    parts = fqn.split(".")[1:]  # drop the stage class name
    if parts and parts[0] == "block":
        parts = parts[1:]
    if parts and parts[0] == "engram":
        parts = parts[1:]
        return ".".join([f"layers.{st.layer}.engram", *parts])
    if st.layer is None:
        return ".".join(parts) or st.kind
    return ".".join([f"layers.{st.layer}", *parts]) if parts else f"layers.{st.layer}"


def _exclusive(counts: dict[str, int]) -> dict[str, int]:
    """Inclusive per-module counts -> each module's own: every count is subtracted from its nearest
    counted ancestor (a module called as a method, as a stage's `block` half is, has no entry)."""
    out = dict(counts)
    for name, n in counts.items():
        parent = name
        while "." in parent:
            parent = parent.rsplit(".", 1)[0]
            if parent in out:
                out[parent] -= n
                break
    return out


def count_flops(cfg: ModelConfig, par: Parallel, max_seq_len: int, b: PlannedBucket) -> tuple[list[float], dict[str, float]]:
    """(FLOPs of bucket b's step on every rank, the step's FLOPs by placement), decode per token
    (module docstring: convention, per-token stages). A rank computes all of the replicated
    FLOPs, 1/tp of the TP-split ones, its vocabulary rows' share of the head, and 1/world of the
    routed experts' (balanced routing)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    by_where: dict[str, float] = {}
    per_key: dict[tuple, dict[str, float]] = {}

    def visit(st, args, mode):
        scale = 1
        run_args = args
        if st.per_token and st.kind != "head":
            run_args = [a[:1, :1] for a in args]
            scale = args[0].shape[0] * args[0].shape[1]
        fc = FlopCounterMode(display=False, custom_mapping=custom_flops())
        with fc:
            outs = st.module(*run_args)
        flops: dict[str, float] = {}
        counts = {name: sum(v.values()) for name, v in fc.get_flop_counts().items() if name != "Global"}
        rows = expert_rows_factor(cfg, st.module.layer, scale) if st.kind.startswith("ffn") else 1.0
        for fqn, n in _exclusive(counts).items():
            if n:
                where = placement(cfg, par, _module_key(st, fqn))
                flops[where] = flops.get(where, 0) + n * scale * (rows if where == EXPERTS else 1)
        per_key[(st.kind, *((tuple(a.shape), a.dtype) for a in args))] = flops
        if scale != 1:  # outputs at the bucket's token count
            outs = tuple(torch.empty((args[0].shape[0], args[0].shape[1], *o.shape[2:]), dtype=o.dtype) for o in outs)
        return outs

    for st, key in _walk(cfg, max_seq_len, b, "count", visit):
        for where, n in per_key[key].items():
            by_where[where] = by_where.get(where, 0) + n
    if b.kind == "decode":
        by_where = {w: n / b.batch for w, n in by_where.items()}
    return flops_per_rank(cfg, par, by_where), by_where


def expert_rows_factor(cfg: ModelConfig, layer: int, tokens: int) -> float:
    """The expert rows the exported MoE of `layer` computes for a call of `tokens` tokens, over its
    routed (token, expert) pairs (graphs/model.py MoE.forward, routed=False): 1 for a call routing
    fewer pairs than experts (each pair gathers its expert), the blockwise layout's n_blocks *
    block / pairs (graphs/moe_blocks.py, at most PAD_LIMIT), or E / k for every expert on every
    token where that is fewer rows. Counted with the model's experts: an expert-parallel rank's
    own layout is not modelled."""
    from dsneuron.graphs.moe_blocks import block_size, n_blocks, use_blocks

    n_exp, k = cfg.moe_experts(layer)
    pairs = tokens * k
    if pairs < n_exp:
        return 1.0
    if not use_blocks(tokens, k, n_exp):
        return n_exp / k
    block = block_size(pairs, n_exp)
    return n_blocks(pairs, n_exp, block) * block / pairs


def flops_per_rank(cfg: ModelConfig, par: Parallel, by_where: dict[str, float]) -> list[float]:
    """Each rank's FLOPs from a step's FLOPs by placement (`count_flops`)."""
    per_rank = []
    for r in range(par.world):
        share = {REPLICATED: 1.0, TP: 1 / par.tp, EXPERTS: 1 / par.world,
                 VOCAB: vocab_rows(cfg, par, r) / cfg.vocab_size, HOST: 0.0, UNUSED: 0.0}
        per_rank.append(sum(n * share[w] for w, n in by_where.items()))
    return per_rank


def activation_peak(cfg: ModelConfig, par: Parallel, max_seq_len: int, b: PlannedBucket) -> tuple[int, int, str]:
    """(bytes, of which dequantised weight copies, stage name) of the largest stage activation of
    bucket b on one rank (module docstring)."""
    from dsneuron.graphs.steps import state_layout

    local = rank_config(cfg, par)
    state_names = set(state_layout(cfg, b.batch, b.capacity))
    best: list = [0, 0, ""]

    def visit(st, args, mode):
        from torch.multiprocessing.reductions import StorageWeakRef

        weights = {StorageWeakRef(t.untyped_storage()).cdata for t in (*st.module.parameters(), *st.module.buffers())}
        known = weights | {StorageWeakRef(t.untyped_storage()).cdata for t in args}
        inputs = sum(a.untyped_storage().nbytes() for a, n in zip(args, st.inputs) if n not in state_names)
        tracker = _live_bytes_mode(known, weights)
        with tracker:
            outs = st.module(*args)
        if tracker.peak + inputs > best[0]:
            best[:] = [tracker.peak + inputs, tracker.peak_weights, st.name]
        return outs

    _walk(local, max_seq_len, b, "fused", visit)
    return best[0], best[1], best[2]


def state_bytes(cfg: ModelConfig, batch: int, capacity: int) -> int:
    """Decode state bytes of `batch` sequences at `capacity` (graphs/steps.py state_layout)."""
    import torch

    from dsneuron.graphs.steps import state_layout

    return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
               for shape, dt in state_layout(cfg, batch, capacity).values())


def decode_state_read(cfg: ModelConfig, capacity: int) -> int:
    """State bytes one sequence's decode step reads at `capacity`: the whole window rings, indexer
    keys (the indexer scores every compressed position) and compressor partial groups, and of the
    compressed KV only the index_topk rows each compressed layer attends to (graphs/model.py
    Attention._compressed gathers them before decoding)."""
    import torch

    from dsneuron.graphs.steps import state_layout

    layout = state_layout(cfg, 1, capacity)
    total = 0
    for name, (shape, dt) in layout.items():
        if not name.endswith(".compress_kv"):
            total += math.prod(shape) * torch.empty((), dtype=dt).element_size()
    for L in range(cfg.n_layers):
        src = cfg.kv_source_of(L)
        if cfg.compress_ratios[L] and src is not None:
            _, rows, row_bytes = layout[f"layers.{src}.compress_kv"][0]
            total += min(rows, cfg.index_topk) * row_bytes
    return total


# ----------------------------------------------------------------------------------------- decode roofline


def decode_read(cfg: ModelConfig, par: Parallel, spec: dict) -> dict[str, Any]:
    """Weight bytes one decode token reads: total over all ranks, the slowest rank's, and the
    engram rows sent from the host (module docstring)."""
    n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    total = host = 0
    ranks = [0] * par.world
    cats = {"head": 0, "embed row": 0, "dense": 0, "routed experts": 0, "shared expert": 0, "engram rows (host)": 0}
    for name, s in spec.items():
        where, n = placement(cfg, par, name), spec_bytes(s)
        if where == UNUSED:
            continue
        if where == HOST:
            rows = n // s.shape[0] * n_cols
            host += rows
            cats["engram rows (host)"] += rows
            continue
        if name.startswith("embed."):
            row = n // s.shape[0]
            cats["embed row"] += row
            ranks[0] += row
            total += row
            continue
        if where == EXPERTS:
            L = int(name.split(".")[1])
            n_exp, k = cfg.moe_experts(L)
            total += n * k // n_exp
            cats["routed experts"] += n * k // n_exp
            continue
        cat = "head" if name.startswith("head.") else "shared expert" if ".shared_experts." in name else "dense"
        cats[cat] += n
        total += n
        if where == REPLICATED:
            for i in range(par.world):
                ranks[i] += n
        elif where == TP:
            for i in range(par.world):
                ranks[i] += n // par.tp
        else:
            row = n // s.shape[0]
            for i in range(par.world):
                ranks[i] += row * vocab_rows(cfg, par, i)
    # the slowest rank reads ceil(k / EP) expert slices per layer (balanced routing)
    one_expert = {}
    for name, s in spec.items():
        if placement(cfg, par, name) == EXPERTS and ".experts.0." in name:
            L = int(name.split(".")[1])
            one_expert[L] = one_expert.get(L, 0) + spec_bytes(s)
    slowest_experts = 0
    for L, n in one_expert.items():
        _, k = cfg.moe_experts(L)
        slowest_experts += -(-k // par.ep) * n // par.moe_tp
    slowest = max(ranks) + slowest_experts
    return {"total": total, "slowest_rank": slowest, "host": host, "by_part": cats}


# ----------------------------------------------------------------------------------------- long contexts


@dataclass
class ContextRow:
    """One decode capacity of the long-context table (`context_rows`), bytes per rank.

    state: one sequence's decode state; decode_activation / chunk_activation: the largest stage
    activation of a decode step / of a chunk of chunk_len tokens at that capacity (measured as
    `activation_peak`); decode_need / chunk_need: the worst rank's weights + state + that
    activation; decode_read: the bytes one decode token reads on the slowest rank (its weights'
    share as `decode_read`, plus the state it reads, `decode_state_read`: all of it but the
    compressed KV rows the step does not attend to); chunk_flops: one chunk's FLOPs on the busiest rank; chunk_read: the
    bytes a chunk reads on the worst rank (all its weights and the state)."""

    capacity: int
    state: int
    decode_activation: int
    decode_need: int
    decode_read: int
    decode_roofline_s: float
    chunk_len: int
    chunk_flops: float
    chunk_activation: int
    chunk_need: int
    chunk_read: int
    chunk_roofline_s: float
    #: chunks of a prompt filling the capacity: its first chunk_len tokens are a prefill
    chunks: int


def context_rows(cfg: ModelConfig, par: Parallel, inst: Instance, held: list[int], read: dict[str, Any],
                 capacities: list[int], chunk_len: int, log: Callable[[str], None] | None = None) -> list[ContextRow]:
    """The long-context table: per decode capacity, one sequence's state, the decode step's and a
    chunk's HBM need on the worst rank and their memory-roofline time (bytes read / the rank's
    bandwidth), and a chunk's FLOPs. held: weight bytes per rank on the device; read: `decode_read`.
    Raises UserError for a capacity the state layout refuses or a chunk_len above a capacity."""
    rows = []
    r = max(range(par.world), key=held.__getitem__)
    for c in capacities:
        if chunk_len > c:
            raise UserError(f"--chunk {chunk_len}: longer than the capacity {c}")
        try:
            st = state_bytes(cfg, 1, c)
        except ValueError as e:
            raise UserError(f"--contexts {c}: {e}") from None
        if log:
            log(f"context {c}: decode and a chunk of {chunk_len}")
        dec = PlannedBucket("decode", 1, 1, c)
        chunk = PlannedBucket("chunk", 1, chunk_len, c)
        d_act = activation_peak(cfg, par, c, dec)[0]
        c_act = activation_peak(cfg, par, c, chunk)[0]
        flops = max(count_flops(cfg, par, c, chunk)[0])
        d_read = read["slowest_rank"] + decode_state_read(cfg, c)
        c_read = held[r] + st
        rows.append(ContextRow(c, st, d_act, held[r] + st + d_act, d_read, d_read / inst.bw_per_rank, chunk_len, flops,
                               c_act, held[r] + st + c_act, c_read, c_read / inst.bw_per_rank,
                               -(-(c - chunk_len) // chunk_len)))
    return rows


def render_contexts(rows: list[ContextRow], have: int, console) -> None:
    """The long-context table."""
    from rich.table import Table

    t = Table("capacity", "state MiB / seq", "decode need GiB", "verdict", "decode read GiB", "roofline ms/token",
              "chunk", "chunk FLOPs", "chunk need GiB", "verdict", "chunk roofline ms", "chunks to fill",
              title=f"long contexts, batch 1, worst rank (have {_g(have)} GiB); decode reads its state (of the compressed KV, the rows it attends)")
    for x in rows:
        t.add_row(f"{x.capacity:,}", f"{x.state / 2**20:.1f}", _g(x.decode_need),
                  "fits" if x.decode_need <= have else f"short by {_g(x.decode_need - have)}",
                  _g(x.decode_read), f"{x.decode_roofline_s * 1e3:.2f}", str(x.chunk_len), _flops(x.chunk_flops),
                  _g(x.chunk_need), "fits" if x.chunk_need <= have else f"short by {_g(x.chunk_need - have)}",
                  f"{x.chunk_roofline_s * 1e3:.2f}", str(x.chunks))
    console.print(t)


# ----------------------------------------------------------------------------------------- the plan


@dataclass
class BucketRow:
    """One bucket's figures on every rank (lists indexed by rank)."""

    label: str
    kind: str
    batch: int
    seq_len: int
    capacity: int
    flops: list[float]
    weights: list[int]
    state: int
    activation: int
    activation_stage: str
    #: of `activation`: the in-graph dequantised weight copies live at the peak
    activation_weight_copies: int = 0
    #: the step's FLOPs (all ranks, each counted once) by placement
    flops_by_placement: dict = field(default_factory=dict)

    def need(self, rank: int) -> int:
        return self.weights[rank] + self.state + self.activation


@dataclass
class Plan:
    """Everything `dsneuron plan` prints (module docstring); `to_dict` is its JSON form."""

    config: str
    target: str
    instance: Instance
    parallel: Parallel
    buckets: list[BucketRow]
    weights: list[dict[str, int]]
    kinds: dict[str, list[str]]
    decode: dict[str, Any]
    checkpoint_bytes: int
    notes: list[str] = field(default_factory=list)
    #: the long-context table (`context_rows`), empty unless asked for
    contexts: list[ContextRow] = field(default_factory=list)

    @property
    def have(self) -> int:
        return self.instance.hbm_per_rank

    def worst(self) -> tuple[BucketRow, int]:
        """(bucket, rank) with the largest HBM need."""
        return max(((b, r) for b in self.buckets for r in range(self.parallel.world)), key=lambda br: br[0].need(br[1]))

    def fits(self) -> bool:
        b, r = self.worst()
        return b.need(r) <= self.have

    @property
    def roofline_s(self) -> float:
        return self.decode["slowest_rank"] / self.instance.bw_per_rank

    def to_dict(self) -> dict[str, Any]:
        b, r = self.worst()
        return {
            "config": self.config, "target": self.target,
            "instance": {**dataclasses.asdict(self.instance), "ranks": self.instance.ranks,
                         "hbm_per_rank": self.instance.hbm_per_rank, "bw_per_rank": self.instance.bw_per_rank},
            "parallel": {"tp": self.parallel.tp, "ep": self.parallel.ep, "moe_tp": self.parallel.moe_tp,
                         "world": self.parallel.world},
            "buckets": [dataclasses.asdict(x) | {"need": [x.need(i) for i in range(self.parallel.world)]}
                        for x in self.buckets],
            "weights_per_rank": self.weights, "checkpoint_bytes": self.checkpoint_bytes,
            "stage_kinds": self.kinds, "decode_read": self.decode, "roofline_s_per_token": self.roofline_s,
            "fits": self.fits(), "worst": {"bucket": b.label, "rank": r, "need": b.need(r), "have": self.have},
            "notes": self.notes, "contexts": [dataclasses.asdict(x) for x in self.contexts],
        }


def stage_kinds(cfg: ModelConfig) -> dict[str, list[str]]:
    """{stage kind: the stages it serves} of one step (graphs/stages.py attn_kind / ffn_kind)."""
    from dsneuron.graphs.stages import attn_kind, ffn_kind

    kinds: dict[str, list[str]] = {"embed": ["embed"]}
    for L in range(cfg.n_layers):
        if L in cfg.engram_layer_ids:
            kinds.setdefault("engram", []).append(f"layers.{L}.engram")
        kinds.setdefault(attn_kind(cfg, L), []).append(f"layers.{L}.attn")
        kinds.setdefault(ffn_kind(cfg, L), []).append(f"layers.{L}.ffn")
    kinds["head"] = ["head"]
    return kinds


def make_plan(model_cfg: ModelConfig, compile_cfg: CompileConfig, target: str = "cpu", instance: str | None = None,
              tp: int | None = None, ep: int | None = None, config_name: str = "",
              log: Callable[[str], None] | None = None, contexts: list[int] | None = None,
              chunk_len: int | None = None, bandwidth_gbs: float | None = None) -> Plan:
    """The plan of a config on a target/instance with tp/ep (defaults: `default_parallel`), with the
    long-context table (`context_rows`) at the decode capacities `contexts` for chunks of
    chunk_len tokens (default: the largest prefill length); bandwidth_gbs: the cpu target's read
    bandwidth in GB/s (None: measured, `host_instance`). Raises UserError (ConfigError) for a bad
    plan, target, instance, bandwidth or split."""
    from dsneuron.graphs.engram import engram_layout
    from dsneuron.graphs.spec import checkpoint_spec

    inst = resolve_instance(target, instance, bandwidth_gbs)
    par = default_parallel(model_cfg, inst, tp, ep)
    check_parallel(model_cfg, par, inst)
    plan = plan_buckets(compile_cfg, model_cfg)
    rows = engram_layout(model_cfg).num_embeddings if model_cfg.engram_layer_ids else ()
    spec = checkpoint_spec(model_cfg, rows)
    weights = weight_bytes(model_cfg, par, spec)
    # on the cpu target the host is the rank: the engram tables it keeps share the same memory
    held = [device_bytes(w) + (w[HOST] if inst.name == "host" else 0) for w in weights]
    # before the fake runs (minutes for a large model): weights and state alone must fit
    worst_state = max(plan.buckets, key=lambda b: state_bytes(model_cfg, b.batch, b.capacity))
    st = state_bytes(model_cfg, worst_state.batch, worst_state.capacity)
    r = max(range(par.world), key=held.__getitem__)
    if held[r] + st > inst.hbm_per_rank:
        raise UserError(f"plan does not fit {inst.name}: bucket {worst_state.label} on rank {r} needs at least "
                        f"{_g(held[r] + st)} GiB (weights {_g(held[r])} + state {_g(st)}, before activations), the rank "
                        f"has {_g(inst.hbm_per_rank)} GiB; {_advice(inst)}")
    out = []
    for b in plan.buckets:
        if log:
            log(f"counting {b.label}")
        flops, by_where = count_flops(model_cfg, par, compile_cfg.max_seq_len, b)
        act, copies, where = activation_peak(model_cfg, par, compile_cfg.max_seq_len, b)
        out.append(BucketRow(b.label, b.kind, b.batch, b.seq_len, b.capacity, flops, held,
                             state_bytes(model_cfg, b.batch, b.capacity), act, where, copies, by_where))
    notes = [
        "FLOPs count the expert rows the graphs compute: a prefill's or chunk's (token, expert) pairs "
        "in expert blocks, padded, over the routed pairs "
        f"({', '.join(f'{b.label} {expert_rows_factor(model_cfg, 0, b.batch * b.seq_len):.2f}x' for b in plan.buckets if b.kind != 'decode')}).",
        "Weights in checkpoint formats; the bundle stores attn.wo_a dequantised to bf16, which adds to these "
        "(the cpu kernels read the head as its stored bf16 and the FP8/FP4 scales widened to fp32: "
        "graphs/kernel_weights.py).",
    ]
    read = decode_read(model_cfg, par, spec)
    rows = context_rows(model_cfg, par, inst, held, read, sorted(contexts), chunk_len or plan.prefill_seq_lens[-1], log) \
        if contexts else []
    return Plan(config_name, target, inst, par, out, weights, stage_kinds(model_cfg), read,
                sum(spec_bytes(s) for s in spec.values()), notes, rows)


# ----------------------------------------------------------------------------------------- output


def _g(n: float) -> str:
    return f"{n / GiB:.2f}"


def _flops(n: float) -> str:
    for unit, div in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f}"


def _groups(values: list[tuple]) -> list[tuple[str, int]]:
    """Runs of equal per-rank tuples as ("a-b", first rank)."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((f"{start}" if i - 1 == start else f"{start}-{i - 1}", start))
            start = i
    return out


def render(plan: Plan, console) -> None:
    """Print the plan as rich tables."""
    from rich.table import Table

    inst, par = plan.instance, plan.parallel
    console.print(f"[bold]{plan.config}[/] on [bold]{inst.name}[/] ({plan.target}): {inst.ranks} ranks of "
                  f"{_g(inst.hbm_per_rank)} GiB HBM and {inst.bw_per_rank / 1e9:.1f} GB/s each ({inst.note}); "
                  f"world {par.world} = tp {par.tp} (attention heads, vocabulary) with ep {par.ep} expert groups of "
                  f"moe_tp {par.moe_tp} inside", highlight=False)
    t = Table("bucket", "ranks", "FLOPs", "weights GiB", "state GiB", "activation GiB (stage; dequant copies)",
              "need GiB", "have GiB", "verdict",
              title="per bucket and rank (prefill FLOPs per call, decode per token; state for the bucket's batch)")
    for b in plan.buckets:
        per = [(b.flops[r], b.need(r)) for r in range(par.world)]
        for label, r in _groups(per):
            ok = b.need(r) <= plan.have
            t.add_row(b.label, label, _flops(b.flops[r]), _g(b.weights[r]), _g(b.state),
                      f"{_g(b.activation)} ({b.activation_stage}; {_g(b.activation_weight_copies)})", _g(b.need(r)),
                      _g(plan.have),
                      "[green]fits[/]" if ok else f"[red]short by {_g(b.need(r) - plan.have)}[/]")
    console.print(t)
    w = Table("ranks", "replicated", "tp split", "vocab split", "experts", "on device", "host (engram tables)",
              "not placed (DSpark)", title="weight GiB per rank, checkpoint formats "
              f"(checkpoint total {_g(plan.checkpoint_bytes)} GiB)")
    for label, r in _groups([tuple(x.values()) for x in plan.weights]):
        x = plan.weights[r]
        w.add_row(label, _g(x[REPLICATED]), _g(x[TP]), _g(x[VOCAB]), _g(x[EXPERTS]), _g(device_bytes(x)), _g(x[HOST]),
                  _g(x[UNUSED]))
    console.print(w)
    k = Table("stage kind", "count", "stages", title=f"stage kinds to compile per bucket shape ({len(plan.kinds)})")
    for kind, names in plan.kinds.items():
        shown = ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ... {names[-1]}"
        k.add_row(kind, str(len(names)), shown)
    console.print(k)
    d = plan.decode
    r = Table("part", "GiB", title="weight bytes one decode token reads (all ranks)")
    for part, n in d["by_part"].items():
        r.add_row(part, f"{n / GiB:.4f}")
    r.add_row("[bold]total (device)[/]", f"{d['total'] / GiB:.3f}")
    console.print(r)
    console.print(f"roofline: the slowest rank reads {_g(d['slowest_rank'])} GiB per decode token -> "
                  f"{plan.roofline_s * 1e3:.2f} ms per token at {inst.bw_per_rank / 1e9:.1f} GB/s "
                  f"({1 / plan.roofline_s:.0f} tokens/s per sequence at best)", highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
    if plan.contexts:
        render_contexts(plan.contexts, plan.have, console)


def _advice(inst: Instance) -> str:
    """What a plan that does not fit `inst` can change."""
    if inst.name == "host":
        return "the cpu target is this one host: plan smaller buckets, or --target neuron with more ranks"
    return "use more ranks (--tp, a larger --instance) or smaller buckets"


def check_fit(plan: Plan) -> None:
    """Raise UserError naming the worst bucket and rank when the plan does not fit."""
    b, r = plan.worst()
    if b.need(r) > plan.have:
        raise UserError(f"plan does not fit {plan.instance.name}: bucket {b.label} on rank {r} needs {_g(b.need(r))} GiB "
                        f"(weights {_g(b.weights[r])} + state {_g(b.state)} + activation {_g(b.activation)}), the rank has "
                        f"{_g(plan.have)} GiB; {_advice(plan.instance)}")
