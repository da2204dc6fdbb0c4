"""Benchmark: each reference custom op against a naive per-token Python loop, at the tiny model's shapes.

    python -m dsneuron.bench.ops [--runs 7] [--naive-runs 3] [--threads N]

Both sides run in the same process on the same inputs; the table reports medians and their ratio
(naive / op) from this one run, plus the largest difference between the two results in bf16 steps
(the naive loops follow the same rounding points, so it should be 0 or 1). Absolute times are noisy on
a shared machine; the ratio is the figure to quote, and `--threads 1` keeps it steady where other
jobs compete for the cores (two-thread parallel regions then stall on descheduled threads). Shapes: the `tiny` config (8 heads of 512,
window 128 + 64 compressed keys; indexer 4 heads of 128 over 357 compressed keys, candidate blocks
32 x 8) at a 715-token prefill and a 1-token decode.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

import dsneuron.kernels_nki  # noqa: F401  (registers torch.ops.dsneuron)
from dsneuron.kernels_nki.formats import pack_fp4
from dsneuron.kernels_nki.sparse_attn_ref import BLOCK_KEYS, M_INIT

PREFILL, WINDOW, TOPK = 715, 128, 64
N_HEADS, HEAD_DIM = 8, 512
IDX_HEADS, IDX_DIM, COMPRESSED = 4, 128, 357
CAND_BLOCKS, CAND_BLOCK_SIZE = 32, 8


# ------------------------------------------------------------------------------ naive per-token loops

def naive_sparse_attn(q, kv, sink, idx, scale):
    """One query token at a time: gather its rows, then the 64-key online softmax over its heads."""
    bsz, seqlen, n_heads, dim = q.shape
    n_kv = kv.shape[1]
    out = torch.zeros(bsz, seqlen, n_heads, dim, dtype=torch.bfloat16)
    for b in range(bsz):
        for s in range(seqlen):
            ids = idx[b, s].long()
            ok = (ids >= 0) & (ids < n_kv)
            rows = torch.where(ok.unsqueeze(-1), kv[b, ids.clamp(0, max(n_kv - 1, 0))].float(), 0.0)
            logits = (q[b, s].float() @ rows.T) * scale
            logits = logits.masked_fill(~ok, -math.inf)
            m = torch.full((n_heads,), M_INIT)
            den = torch.zeros(n_heads)
            acc = torch.zeros(n_heads, dim)
            for j0 in range(0, ids.numel(), BLOCK_KEYS):
                blk = logits[:, j0:j0 + BLOCK_KEYS]
                m_new = torch.maximum(m, blk.amax(-1))
                alpha = torch.exp(m - m_new)
                p = torch.exp(blk - m_new.unsqueeze(-1))
                den = den * alpha + p.sum(-1)
                acc = acc * alpha.unsqueeze(-1) + p.bfloat16().float() @ rows[j0:j0 + BLOCK_KEYS]
                m = m_new
            if ok.any():
                out[b, s] = (acc / (den + torch.exp(sink - m)).unsqueeze(-1)).bfloat16()
    return out


def naive_mqa_logits_bf16(q, k, w):
    """One query token at a time: bf16 [H,D] x [D,T] product, relu, bf16 weight, head sum."""
    bsz, seqlen = q.shape[:2]
    out = torch.empty(bsz, seqlen, k.shape[1], dtype=torch.bfloat16)
    for b in range(bsz):
        for s in range(seqlen):
            out[b, s] = ((q[b, s] @ k[b].T).relu() * w[b, s].unsqueeze(-1)).sum(0)
    return out


def _dequant_fp4(packed, sf):
    codes = torch.stack([packed.view(torch.uint8) & 0xF, packed.view(torch.uint8) >> 4], -1).flatten(-2)
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    scale = torch.pow(2.0, sf.float() - 127).repeat_interleave(32, -1)
    return table[codes.long()] * scale


def naive_mqa_logits(q, q_sf, kv, kv_sf, weights, ks, ke, max_seqlen_k):
    """One query token at a time: dequantize its heads, score keys ks..ke, write ks-relative columns."""
    kf = _dequant_fp4(kv, kv_sf)
    out = torch.full((q.shape[0], max_seqlen_k), -math.inf, dtype=torch.bfloat16)
    for s in range(q.shape[0]):
        lo, hi = int(ks[s]), min(int(ke[s]), int(ks[s]) + max_seqlen_k)
        qf = _dequant_fp4(q[s], q_sf[s])
        out[s, :hi - lo] = ((qf @ kf[lo:hi].T).relu() * weights[s].float().unsqueeze(-1)).sum(0).bfloat16()
    return out


def naive_mqa_logits_sparse(q, q_sf, kv, kv_sf, weights, ks, ke, block_idx, block_size):
    """One query token at a time over its selected blocks."""
    kf = _dequant_fp4(kv, kv_sf)
    out = torch.full((q.shape[0], block_idx.shape[1] * block_size), -math.inf, dtype=torch.bfloat16)
    offs = torch.arange(block_size)
    for s in range(q.shape[0]):
        lo, hi = int(ks[s]), int(ke[s])
        keys = (block_idx[s].long().unsqueeze(-1) * block_size + lo % block_size + offs).flatten()
        ok = (block_idx[s].long().repeat_interleave(block_size) >= 0) & (keys >= lo) & (keys < hi)
        if ok.any():
            qf = _dequant_fp4(q[s], q_sf[s])
            score = ((qf @ kf[keys[ok]].T).relu() * weights[s].float().unsqueeze(-1)).sum(0)
            out[s, ok] = score.bfloat16()
    return out


# ------------------------------------------------------------------------------------ tiny-shape inputs

def sparse_attn_inputs(seqlen: int, gen: torch.Generator):
    """Window + compressed keys as the tiny model lays them out: kv = [window rows | compressed rows]."""
    if seqlen == 1:  # decode after a 715-token prompt: full window ring, every compressed entry visible
        n_win, visible = WINDOW, torch.full((1,), COMPRESSED)
        window = torch.arange(WINDOW).view(1, WINDOW)
    else:
        n_win, pos = seqlen, torch.arange(seqlen).view(-1, 1)
        window = pos - WINDOW + 1 + torch.arange(WINDOW)
        window = torch.where(window < 0, -1, window)
        visible = (torch.arange(seqlen) + 1) // 2
    n_kv = n_win + COMPRESSED
    picks = torch.rand(seqlen, COMPRESSED, generator=gen).argsort(-1)[:, :TOPK].sort(-1).values
    compressed = torch.where(picks < visible.view(-1, 1), picks + n_win, -1)
    idx = torch.cat([window, compressed], -1).to(torch.int32).unsqueeze(0)
    q = torch.randn(1, seqlen, N_HEADS, HEAD_DIM, generator=gen).bfloat16()
    kv = torch.randn(1, n_kv, HEAD_DIM, generator=gen).bfloat16()
    sink = torch.randn(N_HEADS, generator=gen)
    return q, kv, sink, idx, HEAD_DIM ** -0.5


def mqa_bf16_inputs(seqlen: int, gen: torch.Generator):
    q = torch.randn(1, seqlen, IDX_HEADS, IDX_DIM, generator=gen).bfloat16()
    k = torch.randn(1, COMPRESSED, IDX_DIM, generator=gen).bfloat16()
    w = (torch.randn(1, seqlen, IDX_HEADS, generator=gen) * (IDX_DIM * IDX_HEADS) ** -0.5).bfloat16()
    return q, k, w


def _fp4_operand(shape, gen):
    codes = torch.randint(0, 16, (*shape[:-1], shape[-1]), generator=gen)
    sf = torch.randint(124, 130, (*shape[:-1], shape[-1] // 32), generator=gen).to(torch.uint8)
    return pack_fp4(codes), sf


def mqa_fp4_inputs(seqlen: int, gen: torch.Generator):
    """Causal compressed ranges: query s sees compressed keys [0, (s+1)//2) (decode: all of them)."""
    q, q_sf = _fp4_operand((seqlen, IDX_HEADS, IDX_DIM), gen)
    kv, kv_sf = _fp4_operand((COMPRESSED, IDX_DIM), gen)
    w = torch.randn(seqlen, IDX_HEADS, generator=gen)
    ke = torch.full((1,), COMPRESSED) if seqlen == 1 else (torch.arange(seqlen) + 1) // 2
    return q, q_sf, kv, kv_sf, w, torch.zeros(seqlen, dtype=torch.int32), ke.to(torch.int32)


def candidate_blocks(ke: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Up to 32 reachable 8-key blocks per row, sorted, -1 padded (the candidate-source output)."""
    n_blocks = -(-COMPRESSED // CAND_BLOCK_SIZE)
    reach = (ke.view(-1, 1) + CAND_BLOCK_SIZE - 1) // CAND_BLOCK_SIZE
    score = torch.where(torch.arange(n_blocks) < reach, torch.rand(ke.numel(), n_blocks, generator=gen), -1.0)
    top = score.topk(min(CAND_BLOCKS, n_blocks), dim=-1)
    ranked = torch.where(top.values >= 0, top.indices, n_blocks).sort(-1).values
    return torch.where(ranked < n_blocks, ranked, -1).to(torch.int32)


# ------------------------------------------------------------------------------------------ timing

def median_seconds(fn: Callable[[], torch.Tensor], runs: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up, and the result to compare
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 steps between two bf16 tensors (equal infinities count 0)."""
    def key(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return int((key(a) - key(b)).abs().max()) if a.numel() else 0


def cases(gen: torch.Generator):
    for label, seqlen in (("prefill", PREFILL), ("decode", 1)):
        args = sparse_attn_inputs(seqlen, gen)
        shape = f"S={seqlen} H={N_HEADS} D={HEAD_DIM} K={args[3].shape[-1]} N={args[1].shape[1]}"
        yield (f"sparse_attn {label}", shape,
               lambda a=args: torch.ops.dsneuron.sparse_attn(*a), lambda a=args: naive_sparse_attn(*a))
    for label, seqlen in (("prefill", PREFILL), ("decode", 1)):
        args = mqa_bf16_inputs(seqlen, gen)
        yield (f"mqa_logits_bf16 {label}", f"S={seqlen} H={IDX_HEADS} D={IDX_DIM} T={COMPRESSED}",
               lambda a=args: torch.ops.dsneuron.mqa_logits_bf16(*a), lambda a=args: naive_mqa_logits_bf16(*a))
    for label, seqlen in (("prefill", PREFILL), ("decode", 1)):
        args = mqa_fp4_inputs(seqlen, gen)
        cols = int(args[6].max())
        yield (f"mqa_logits fp4 {label}", f"S={seqlen} H={IDX_HEADS} D={IDX_DIM} T={COMPRESSED}",
               lambda a=args, c=cols: torch.ops.dsneuron.mqa_logits(*a, c),
               lambda a=args, c=cols: naive_mqa_logits(*a, c))
        blocks = candidate_blocks(args[6], gen)
        yield (f"mqa_logits_sparse fp4 {label}", f"S={seqlen} NB={CAND_BLOCKS} B={CAND_BLOCK_SIZE}",
               lambda a=args, bl=blocks: torch.ops.dsneuron.mqa_logits_sparse(*a, bl, CAND_BLOCK_SIZE),
               lambda a=args, bl=blocks: naive_mqa_logits_sparse(*a, bl, CAND_BLOCK_SIZE))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each op (median reported)")
    parser.add_argument("--naive-runs", type=int, default=3, help="timed runs of each naive loop")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {args.runs} op runs "
          f"and {args.naive_runs} naive runs")
    header = f"{'op':<30} {'shape':<34} {'op ms':>10} {'naive ms':>10} {'naive/op':>9} {'max bf16 steps':>15}"
    print(header)
    print("-" * len(header))
    for name, shape, op, naive in cases(gen):
        t_op, out_op = median_seconds(op, args.runs)
        t_naive, out_naive = median_seconds(naive, args.naive_runs)
        print(f"{name:<30} {shape:<34} {t_op * 1e3:>10.2f} {t_naive * 1e3:>10.2f} {t_naive / t_op:>9.1f} "
              f"{bf16_steps(out_op, out_naive):>15}")


if __name__ == "__main__":
    main()
