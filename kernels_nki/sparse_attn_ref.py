"""Torch reference of `dsneuron::sparse_attn`: attention over gathered KV rows, 64-key online softmax.

Follows the V4.1 `sparse_attn` kernel (deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py
Attention.forward calls it; its CPU kernel is summarised in docs/numerics.md "The forward pass")
and the FlashMLA sm90 sparse-decode pipeline it mirrors (docs/numerics.md "Kernel tests: edge cases and tolerances").

Dot products: q . k over D and P @ V over each 64-key block are float64 GEMMs rounded once to fp32.
Both operands are bf16 values, so every product is exact (16 significant bits) and the float64 sum
is exact unless one row's products span more than 53 - 16 - log2(D) = 28 binades: the result is the
correctly rounded sum whatever order the BLAS adds in, and a query's output does not depend on how
many queries share the call or on the host (an fp32 GEMM's order does).

Domain: natural exponent. `P = exp(s - m)` with `s = (q . k) * scale` already scaled, as the V4.1 CPU
kernel writes it. The GPU kernels compute `exp2(x * scale * log2(e) - m2)` because `ex2` is the
hardware instruction; here that would only add one more fp32 rounding (of `scale * log2(e)`) for no
speed gain, and the NKI activation engine also has a natural `exp`.
"""

from __future__ import annotations

import math

import torch

from dsneuron.kernels_nki.formats import SPELLING

#: Keys per online-softmax step, in index order: the V4.1 kernel's block, and FlashMLA's sm90
#: sparse-decode TOPK_BLOCK_SIZE (docs/numerics.md "Kernel tests: edge cases and tolerances").
BLOCK_KEYS = 64

#: Running-max start. Finite, so a block with no valid key rescales by exp(0) = 1 instead of
#: evaluating (-inf) - (-inf) = NaN (V4.1 kernel; FlashMLA MAX_INIT_VAL).
M_INIT = -1e30

#: Working-set budget for one chunk of query rows (their gathered fp32 KV rows dominate). Measured at
#: the tiny prefill shape: chunks that stay near the L2 cache run ~2.5x faster than 64 MiB ones.
_CHUNK_BYTES = 8 << 20
#: Budget when the reference is being traced (the cpu lowering inlines it): each chunk unrolls into
#: graph nodes, so fewer, larger chunks keep the graph small; the compiler plans that memory.
_TRACED_CHUNK_BYTES = 64 << 20


def check_sparse_attn_args(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                           scale: float) -> None:
    """Shape and dtype contract of `sparse_attn` (works on fake tensors too).

    Raises ValueError naming the argument, the expected and the received shape or dtype.
    """
    if q.dtype != torch.bfloat16 or q.dim() != 4:
        raise ValueError(f"sparse_attn: q must be bf16 [B,S,H,D], got {q.dtype} {tuple(q.shape)}")
    bsz, seqlen, n_heads, dim = q.shape
    if kv.dtype != torch.bfloat16 or kv.dim() != 3 or kv.shape[0] != bsz or kv.shape[2] != dim:
        raise ValueError(f"sparse_attn: kv must be bf16 [B={bsz},N,D={dim}], got {kv.dtype} {tuple(kv.shape)}")
    if sink.dtype != torch.float32 or tuple(sink.shape) != (n_heads,):
        raise ValueError(f"sparse_attn: sink must be fp32 [H={n_heads}], got {sink.dtype} {tuple(sink.shape)}")
    if idx.dtype != torch.int32 or idx.dim() != 3 or tuple(idx.shape[:2]) != (bsz, seqlen):
        raise ValueError(f"sparse_attn: idx must be int32 [B={bsz},S={seqlen},K], got {idx.dtype} {tuple(idx.shape)}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"sparse_attn: scale must be finite and > 0, got {scale}")


def sparse_attn_ref(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                    *, rows_per_chunk: int | None = None) -> torch.Tensor:
    """Sparse attention with a per-head sink, K = V = the gathered KV row.

    Args:
        q: [B, S, H, D] bf16 queries.
        kv: [B, N, D] bf16 rows; each is both key and value.
        sink: [H] fp32 sink logit per head (natural-log units, not scaled by `scale`).
        idx: [B, S, K] int32 rows of kv each query attends to, in processing order. -1, and any
            value outside [0, N), marks an empty slot. Duplicates count once per occurrence.
        scale: softmax scale applied to the fp32 dot products (> 0).
        rows_per_chunk: query rows (of B*S) handled at once; None picks it from an 8 MiB budget
            (64 MiB while traced). The result does not depend on it.

    Returns:
        [B, S, H, D] bf16. Per (b, s, h), over 64-key blocks of the index list in order:
        s_j = fp32(q . kv[idx_j]) * scale (-inf for an empty slot); m_new = max(m, max_j s_j) with
        m starting at -1e30; P_j = exp(s_j - m_new) in fp32; l = l*exp(m - m_new) + sum_j P_j (the
        unrounded P, the block's sum in float64 rounded once to fp32); O = O*exp(m - m_new) +
        sum_j bf16(P_j) * kv_j (the block's sum exact in float64, rounded once to fp32). So the
        result depends on which 64-key block each index falls in, not on its place in the block. Then
        out = bf16(O / (l + exp(sink - m))): the sink joins the denominator only. A row with no
        valid slot (l == 0) gives 0 whatever the sink.

    Empty slots are gathered from an appended zero row, never from kv, so NaN or inf in rows no
    valid slot references cannot reach the result.

    Raises:
        ValueError: on a shape, dtype or scale outside the contract (`check_sparse_attn_args`).
    """
    check_sparse_attn_args(q, kv, sink, idx, scale)
    bsz, seqlen, n_heads, dim = q.shape
    n_kv, topk = kv.shape[1], idx.shape[2]
    rows = bsz * seqlen
    if rows == 0 or topk == 0 or n_kv == 0:
        return torch.zeros_like(q, memory_format=torch.contiguous_format)

    valid = (idx >= 0) & (idx < n_kv)
    # flat row of kv for each slot; empty slots point at the zero row appended after the last batch
    base = (torch.arange(bsz, dtype=torch.int64, device=idx.device) * n_kv).view(bsz, 1, 1)
    flat_idx = torch.where(valid, idx.long() + base, bsz * n_kv).view(rows, topk)
    valid = valid.view(rows, topk)
    table = torch.cat([kv.reshape(bsz * n_kv, dim), kv.new_zeros(1, dim)])
    qf = q.reshape(rows, n_heads, dim).float()
    sink_f = sink.view(1, n_heads)

    if rows_per_chunk is None:
        per_row = 8 * (topk * dim + 3 * n_heads * topk + 2 * n_heads * dim)
        budget = _TRACED_CHUNK_BYTES if torch.compiler.is_compiling() else _CHUNK_BYTES
        rows_per_chunk = max(1, budget // per_row)
    if isinstance(rows, torch.SymInt):  # traced with a dynamic token count: one chunk, no guard on it
        return _attend(qf, table, flat_idx, valid, sink_f, scale).view(bsz, seqlen, n_heads, dim)
    parts = [_attend(qf[r0:r0 + rows_per_chunk], table, flat_idx[r0:r0 + rows_per_chunk],
                     valid[r0:r0 + rows_per_chunk], sink_f, scale) for r0 in range(0, rows, rows_per_chunk)]
    return torch.cat(parts).view(bsz, seqlen, n_heads, dim)


def _attend(qf: torch.Tensor, table: torch.Tensor, flat_idx: torch.Tensor, valid: torch.Tensor,
            sink: torch.Tensor, scale: float) -> torch.Tensor:
    """One chunk: qf [R,H,D] fp32, table [B*N+1, D] bf16, flat_idx/valid [R,K] -> bf16 [R,H,D]."""
    rows, n_heads, dim = qf.shape
    topk = flat_idx.shape[1]
    # float64 GEMMs: the operands are bf16 values, so every product is exact and the float64 sums
    # are exact too (see the module docstring); fp32 bmm would sum in an order the BLAS picks, and
    # MKL takes another entry point for one matrix than for a batch of them. The neuron spelling
    # (the kernel's StableHLO decomposition) sums in fp32, as the NKI kernel's PSUM does: Trainium
    # has no fp64, and the fp32 sum of exact products is within one fp32 rounding per add
    wide = torch.float32 if SPELLING.neuron else torch.float64
    kvg = table.index_select(0, flat_idx.reshape(-1)).view(rows, topk, dim).to(wide)  # exact upcast
    logits = torch.bmm(qf.to(wide), kvg.transpose(1, 2)).float() * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), -math.inf)

    m = torch.full((rows, n_heads), M_INIT, dtype=torch.float32, device=qf.device)
    denom = torch.zeros(rows, n_heads, dtype=torch.float32, device=qf.device)
    acc = torch.zeros(rows, n_heads, dim, dtype=torch.float32, device=qf.device)
    for j0 in range(0, topk, BLOCK_KEYS):
        s = logits[:, :, j0:j0 + BLOCK_KEYS]
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new.unsqueeze(-1))  # empty slots: exp(-inf) = 0, m_new stays finite
        # the block's sum of P in float64, rounded once: the same whatever position each key has
        # in the block (the reference's prefill and decode lists place the keys differently)
        denom = denom * alpha + p.to(wide).sum(dim=-1).float()
        # the kernel feeds P to the PV matmul as bf16; the denominator keeps the fp32 P
        pv = torch.bmm(p.to(torch.bfloat16).to(wide), kvg[:, j0:j0 + BLOCK_KEYS]).float()
        acc = acc * alpha.unsqueeze(-1) + pv
        m = m_new
    total = denom + torch.exp(sink - m)
    o = acc / total.unsqueeze(-1)
    # torch.where, not a multiply: 0/0 or x/inf must not leak from rows with no valid slot
    return torch.where((denom > 0).unsqueeze(-1), o, 0.0).to(torch.bfloat16)
