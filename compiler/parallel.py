"""Tensor and expert parallelism applied to a loaded model: one rank's shard, and the collectives.

`shard_model(model, par, rank, comm)` cuts a full `graphs.model.Transformer` down, in place, to what
rank `rank` of a tensor-parallel world of `par.tp` processes holds under the parallel rule
(compiler/placement.py `placement`, written once and shared with `dsneuron plan`):

| placement | tensors | what a rank holds | collective |
|---|---|---|---|
| TP | attn.wq_b, attn_sink | its heads, H / tp of them, rank r the r-th run | - |
| TP | attn.wo_a | the output groups of its heads (o_groups / tp) | - |
| TP | attn.wo_b | those groups' input columns (row-parallel) | chain of the K-block partials |
| TP | ffn.shared_experts | w1 / w3 rows and w2 columns of inter / tp | chain of w2's K-block partials |
| TP | engram.wkv | its input columns (whole 32-blocks of hash columns) | chain of the K-block partials |
| EXPERTS | ffn.experts.E | EP group rank // moe_tp runs experts [g E/ep, (g+1) E/ep) | chain of the routed sum |
| VOCAB | embed, head | vocabulary rows [r V/tp, (r+1) V/tp) | all-gather of the rows / of the logits |
| REPLICATED, HOST | the rest: norms, wq_a, wkv, compressor, indexer, gate, hc, engram tables | all of it | - |

Exact by construction: where one process adds terms in a fixed order (a GEMM's K-block partials,
a token's routed experts by ascending id) and a rank holds a contiguous run of them, the ranks add
theirs in rank order onto one fp32 accumulator passed along (`Comm.chain`) instead of summing
partial results (an all-reduce re-associates, and tiny's random weights turn the last-bit
differences into other greedy tokens: 6 of 9 steps agreed in a trial). So a sharded run gives one
process's logits bit for bit; the cost is that the row-parallel stages run one rank after the
other. The routing, the caches and everything replicated are computed identically on every rank.

The collectives are the ops of runtime_min/executors/collectives.py, so the same shard runs eagerly in both
GEMM orders (the golden's "ascending" with the routed MoE, and the cpu target's "kernel", whose
row-parallel GEMMs continue the previous rank's sums with `gemm_panels_acc`) and as AOTInductor
stage executables, which call the ops through the proxy executor: tests/test_parallel.py checks
each against one process bit for bit. `run_sharded` runs the eager shards with torch.distributed's
gloo backend on this host; a sharded bundle (compiler/sharded_bundle.py) compiles each rank's shard
into its own bundle, which runtime_min/sharded.py runs. Refused by name: an expert split over moe_tp =
tp / ep > 1 ranks, a tp that does not divide model.o_groups. Shapes
follow the official DeepSeek-V4 inference/model.py parallel layers (ColumnParallelLinear /
RowParallelLinear / ParallelEmbedding, its `world_size` split) and NxDI's moe_ep_degree x
moe_tp_degree.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from dsneuron import UserError
from dsneuron.graphs.config import ModelConfig
from dsneuron.graphs.golden import Golden, check_sequence
from dsneuron.graphs.model import Linear, Transformer
from dsneuron.runtime_min.executors import collectives  # noqa: F401  registers the collective ops
from dsneuron.runtime_min.sharded import free_port

from .placement import EXPERTS, TP, VOCAB, Instance, Parallel, check_parallel, placement, vocab_rows

BLOCK = 32


@dataclass(frozen=True)
class Comm:
    """The collectives of rank `rank` of `world`, as the ops of runtime_min/executors/collectives.py (so that
    eager runs and compiled stages make the same calls). Without a process group: no-ops."""

    rank: int
    world: int

    def chain(self, add: Callable[[torch.Tensor], torch.Tensor], zero: torch.Tensor, tag: int = 0) -> torch.Tensor:
        """An fp32 sum the ranks continue in rank order: rank 0 runs add(zero), rank r > 0 runs `add`
        on rank r-1's result, and the last rank's result is every rank's. So the adds are those one
        process makes when it adds rank 0's terms, then rank 1's, ... (a row-parallel GEMM's K
        blocks, the routed experts by id): bit-identical to it, where an all-reduce would
        re-associate. Costs one send per rank and a broadcast, in sequence. `tag` keeps two chains
        of one graph apart."""
        acc = torch.ops.dsneuron.chain_recv(zero, tag)
        return torch.ops.dsneuron.chain_pass(add(acc), tag)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' t [...] stacked in rank order -> [world, ...]."""
        return torch.ops.dsneuron.gather_ranks(t, self.world)


def check_shardable(cfg: ModelConfig, par: Parallel) -> None:
    """Refuse (UserError) a parallel plan the rule cannot place (plan.check_parallel, for a world of
    par.tp processes) and what `shard_model` does not implement yet."""
    check_parallel(cfg, par, Instance("processes", max(par.tp, 1), 1, 0, 0.0))
    if par.moe_tp != 1:
        raise UserError(f"--tp {par.tp} --ep {par.ep}: each expert would be split over tp/ep={par.moe_tp} ranks, which "
                        f"the cpu target does not run yet; use --ep {par.tp}")
    if cfg.o_groups % par.tp:
        raise UserError(f"--tp {par.tp}: must divide model.o_groups={cfg.o_groups} on the cpu target (a rank's heads "
                        "in whole output groups)")


def _shard_linear(lin: Linear, lo: int, hi: int, dim: int) -> None:
    """Keep output rows (dim 0) or input columns (dim 1) lo..hi of lin's weight and its scale grid
    (FP8: one scale per 32 x 32 tile; FP4: per row and 32 columns; lo, hi multiples of 32 where
    the scale grid is cut)."""
    w = lin.weight.data
    packed = 2 if lin.kind == "fp4" and dim == 1 else 1  # two e2m1 codes per byte along the input
    lin.weight = nn.Parameter(w.narrow(dim, lo // packed, (hi - lo) // packed).clone(), requires_grad=False)
    if lin.kind in ("fp8", "fp4"):
        per = BLOCK if (lin.kind == "fp8" or dim == 1) else 1
        if lo % per or hi % per:
            raise ValueError(f"shard of {lin.kind} linear at {lo}..{hi} along dim {dim} cuts its {per}-blocks")
        s = lin.scale.data
        lin.scale = nn.Parameter(s.narrow(dim, lo // per, -(-(hi - lo) // per)).clone(), requires_grad=False)
    if dim == 0:
        lin.out_features = hi - lo
    else:
        lin.in_features = hi - lo
    lin.cached = None


def _span(n: int, parts: int, i: int) -> tuple[int, int]:
    per = n // parts
    return i * per, (i + 1) * per


class VocabEmbedding(nn.Module):
    """Rows [rank * per, (rank + 1) * per) of the embedding bf16 [V, D] (official ParallelEmbedding):
    each rank looks up the tokens it holds, the lookups are all-gathered and each token takes its
    owner's row, so every rank gets the exact rows [B, S, D]."""

    def __init__(self, weight: torch.Tensor, per: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.per, self.comm = per, comm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = (tokens - self.comm.rank * self.per).clamp(0, self.weight.size(0) - 1)
        rows = self.comm.all_gather(self.weight[local])  # [world, B, S, D]
        owner = (tokens // self.per).clamp(max=self.comm.world - 1)
        return rows.gather(0, owner.unsqueeze(0).unsqueeze(-1).expand(1, *rows.shape[1:]))[0]


def gather_vocab(comm: Comm, vocab: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The head's gather: each rank's fp32 logits [..., per] side by side in rank order, cut to the
    vocabulary [..., vocab] (the last rank's rows are zero-padded to per)."""
    def gather(y: torch.Tensor) -> torch.Tensor:
        parts = comm.all_gather(y)  # [world, ..., per]
        return torch.cat([parts[r] for r in range(comm.world)], dim=-1)[..., :vocab]
    return gather


def shard_model(model: Transformer, par: Parallel, rank: int, comm: Comm, cache: bool = True) -> Transformer:
    """Cut `model` (a full Transformer) to rank `rank`'s shard in place (module docstring) and return
    it. cache: rebuild the golden's float64 weight copies for the kept slices (eager runs); a model
    that is only traced (a compile, compiler/model_steps.py) skips them. Raises UserError for what
    `check_shardable` refuses, ValueError for a rank outside 0..tp-1."""
    cfg = model.cfg
    check_shardable(cfg, par)
    if not 0 <= rank < par.tp:
        raise ValueError(f"shard_model: rank must be in 0..{par.tp - 1}, got {rank}")
    tp = par.tp
    if tp == 1:
        return model
    hd, heads, groups = cfg.head_dim, cfg.n_heads // tp, cfg.o_groups // tp
    for L, block in enumerate(model.layers):
        attn = block.attn
        assert placement(cfg, par, f"layers.{L}.attn.wq_b.weight") == TP
        _shard_linear(attn.wq_b, rank * heads * hd, (rank + 1) * heads * hd, 0)
        attn.attn_sink = nn.Parameter(attn.attn_sink.data[rank * heads:(rank + 1) * heads].clone(), requires_grad=False)
        cols = (rank * groups * cfg.o_lora_rank, (rank + 1) * groups * cfg.o_lora_rank)
        _shard_linear(attn.wo_a, *cols, 0)
        _shard_linear(attn.wo_b, *cols, 1)
        attn.wo_b.chain = functools.partial(comm.chain, tag=4 * L)
        attn.cfg = dataclasses.replace(attn.cfg, n_heads=heads, o_groups=groups)
        moe = block.ffn
        n_exp = moe.n_experts
        g = rank // par.moe_tp
        lo, hi = _span(n_exp, par.ep, g)
        assert placement(cfg, par, f"layers.{L}.ffn.experts.{lo}.w1.weight") == EXPERTS
        for e in range(n_exp):
            if not lo <= e < hi:
                moe.experts[e] = nn.Module()  # another group's expert: nothing held here
        moe.owned, moe.chain = range(lo, hi), functools.partial(comm.chain, tag=4 * L + 1)
        if placement(cfg, par, f"layers.{L}.ffn.shared_experts.w1.weight") == TP:
            sh = moe.shared_experts
            a, b = _span(sh.w1.out_features, tp, rank)
            _shard_linear(sh.w1, a, b, 0)
            _shard_linear(sh.w3, a, b, 0)
            _shard_linear(sh.w2, a, b, 1)
            sh.w2.chain = functools.partial(comm.chain, tag=4 * L + 2)
        if block.engram is not None and placement(cfg, par, f"layers.{L}.engram.wkv.weight") == TP:
            a, b = _span(block.engram.wkv.in_features, tp, rank)
            _shard_linear(block.engram.wkv, a, b, 1)
            block.engram.wkv.chain = functools.partial(comm.chain, tag=4 * L + 3)
            block.engram.wkv_cols = slice(a, b)
    assert placement(cfg, par, "embed.weight") == VOCAB and placement(cfg, par, "head.weight") == VOCAB
    per = -(-cfg.vocab_size // tp)
    lo = rank * per
    hi = lo + vocab_rows(cfg, par, rank)
    model.embed = VocabEmbedding(model.embed.weight.data[lo:hi].clone(), per, comm)
    head = model.head
    # pad the last rank's rows so that every rank's logits have V/tp columns for the all-gather
    w = head.weight.data[lo:hi]
    if w.size(0) < per:
        w = torch.cat([w, w.new_zeros(per - w.size(0), w.size(1))])
    head.weight = nn.Parameter(w.clone(), requires_grad=False)
    head.out_features, head.cached, head.gather = per, None, gather_vocab(comm, cfg.vocab_size)
    if cache:
        model.cache_dequantized()
    return model


# ----------------------------------------------------------------------------------------- run


def _rank_main(rank: int, args: dict[str, Any]) -> None:
    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}", rank=rank,
                            world_size=args["par"].tp)
    try:
        golden = Golden(args["cfg"], Path(args["checkpoint"]), args["max_seq_len"])
        shard_model(golden.model, args["par"], rank, Comm(rank, args["par"].tp))
        ids, n_prompt, n_decode = args["ids"], args["n_prompt"], len(args["ids"]) - args["n_prompt"]
        timing = None
        if args["timed"] and n_decode:
            # warm (the kernel weights are prepared at the first run), then the full run and the
            # prefill alone: the full run's excess is the decode's
            golden.teacher_forced(ids[:n_prompt], n_prompt, cpu_kernels=args["cpu_kernels"])
            marks = [(time.perf_counter(), collectives.collective_seconds())]
        records = golden.teacher_forced(ids, n_prompt, cpu_kernels=args["cpu_kernels"])
        if args["timed"] and n_decode:
            marks.append((time.perf_counter(), collectives.collective_seconds()))
            golden.teacher_forced(ids[:n_prompt], n_prompt, cpu_kernels=args["cpu_kernels"])
            marks.append((time.perf_counter(), collectives.collective_seconds()))
            (t0, c0), (t1, c1), (t2, c2) = marks
            timing = (((t1 - t0) - (t2 - t1)) / n_decode, ((c1 - c0) - (c2 - c1)) / n_decode)
        torch.save({"logits": [r.logits for r in records], "held": held_bytes(golden.model), "timing": timing},
                   f"{args['out']}.{rank}")
    except Exception as e:  # the parent names it; the rank's traceback goes to its stderr as well
        Path(f"{args['out']}.{rank}.error").write_text(f"{type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()


def held_bytes(model: nn.Module) -> int:
    """Bytes of the parameters `model` holds on the device, the engram tables (kept on the host by
    the plan) aside."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".engram.embed." not in n)


@dataclass
class ShardedRun:
    """What `run_sharded` returns: rank 0's teacher-forced logits fp32 [V] per step (every rank
    has the same) and each rank's `held_bytes`. With timed=True, rank 0's seconds per decoded token
    (`decode_s`) and, of them, the seconds inside the collectives (`collective_s`, waits included:
    runtime_min/executors/collectives.py collective_seconds); else None."""

    logits: list[torch.Tensor]
    held: list[int]
    decode_s: float | None = None
    collective_s: float | None = None


def run_sharded(cfg: ModelConfig, checkpoint: Path, max_seq_len: int, par: Parallel, ids: list[int],
                n_prompt: int, cpu_kernels: bool = False, timed: bool = False) -> ShardedRun:
    """Teacher-forced logits (prefill of ids[:n_prompt], then one step per decoded id, as
    Golden.teacher_forced with `cpu_kernels`) from par.tp processes (torch.multiprocessing spawn,
    gloo over loopback), each holding its shard and os.cpu_count() / tp threads. Raises UserError for a parallel plan the
    cpu target cannot shard or a checkpoint that is no folder, ValueError for ids / n_prompt the
    model cannot run, RuntimeError naming each failed rank's error. timed: each rank also runs the
    prefill alone twice (a warm-up, then timed after the full run), and the decode's seconds per token are reported (ShardedRun)."""
    import torch.multiprocessing as mp

    check_shardable(cfg, par)
    # what the ranks would each fail on, refused once here
    check_sequence(len(ids), n_prompt, max_seq_len)
    if not all(0 <= int(t) < cfg.vocab_size for t in ids):
        raise ValueError(f"run_sharded: token ids must be in 0..{cfg.vocab_size - 1} (model.vocab_size)")
    if not Path(checkpoint).is_dir():
        raise UserError(f"run_sharded: checkpoint {checkpoint} is not a folder")
    threads = max(1, (os.cpu_count() or 1) // par.tp)
    with tempfile.TemporaryDirectory(prefix="dsneuron-sharded-") as tmp:
        args = {"cfg": cfg, "checkpoint": str(checkpoint), "max_seq_len": max_seq_len, "par": par, "ids": list(ids),
                "n_prompt": n_prompt, "cpu_kernels": cpu_kernels, "timed": timed, "port": free_port(), "threads": threads, "out": str(Path(tmp) / "logits.pt")}
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, args)) for r in range(par.tp)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        bad = [r for r, p in enumerate(procs) if p.exitcode]
        if bad:
            why = [Path(f"{args['out']}.{r}.error") for r in bad]
            said = "; ".join(f"rank {r}: {w.read_text()}" for r, w in zip(bad, why) if w.exists())
            raise RuntimeError(f"sharded run: rank(s) {bad} failed: {said or 'exit codes ' + str([procs[r].exitcode for r in bad])}")
        ranks = [torch.load(f"{args['out']}.{r}") for r in range(par.tp)]
        timing = ranks[0]["timing"] or (None, None)
        return ShardedRun(ranks[0]["logits"], [r["held"] for r in ranks], *timing)
