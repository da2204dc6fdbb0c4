"""Torch references of the indexer-logits ops: the V4.1 model's bf16 form and the FP8/FP4 MQA logits.

score[s, t] = sum_h relu(q[s, h] . k[t]) * w[s, h]. `mqa_logits_bf16` reproduces the V4.1 model's
eager expression (deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py Indexer.forward) bit for bit.
`mqa_logits` and `mqa_logits_sparse` take quantized operands and follow the DeepGEMM indexer
(docs/numerics.md "Kernel tests: edge cases and tolerances") with the output conventions of DeepGEMM's MQA-logits API
(csrc/apis/attention.hpp): ks-relative dense columns, block-mapped sparse columns, -inf outside
the row's range, bf16 rows on 512-byte boundaries.

`paged_mqa_logits_ref` and `paged_mqa_logits_sparse_ref` score the same keys read through a block
table from a paged cache (DeepGEMM csrc/apis/attention.hpp, paged section; DeepGEMM tests/test_attention.py
ref_fp8_paged_mqa_logits): one row per query token of each sequence, one column per context
position. They are references only; the runtime keeps no paged cache yet, so no op calls them.
"""

from __future__ import annotations

import math

import torch

from dsneuron.kernels_nki.formats import (PACKED_FP4_DTYPES, SCALE_BLOCK, SPELLING, dequantize_e2m1, dequantize_e4m3,
                                         e4m3_to_float, ue8m0_to_float)

#: Logits rows start on 512-byte boundaries (the seed's get_logits_stride): 256 bf16 columns.
ROW_ALIGN_ELEMS = 512 // torch.bfloat16.itemsize

#: Key-block sizes of the candidate-block (sparse) path (seed: sparse_block_kv in (8, 16)).
SPARSE_BLOCK_SIZES = (8, 16)

_SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)

#: Working-set budget for one chunk of query rows (their fp32 [rows, H, T] head scores).
_CHUNK_BYTES = 8 << 20


# --------------------------------------------------------------------------- bf16 form (V4.1 model)

def check_mqa_logits_bf16_args(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> None:
    """Shape and dtype contract of `mqa_logits_bf16`; raises ValueError (works on fake tensors)."""
    if q.dtype != torch.bfloat16 or q.dim() != 4:
        raise ValueError(f"mqa_logits_bf16: q must be bf16 [B,S,H,D], got {q.dtype} {tuple(q.shape)}")
    bsz, seqlen, n_heads, dim = q.shape
    if k.dtype != torch.bfloat16 or k.dim() != 3 or k.shape[0] != bsz or k.shape[2] != dim:
        raise ValueError(f"mqa_logits_bf16: k must be bf16 [B={bsz},T,D={dim}], got {k.dtype} {tuple(k.shape)}")
    if w.dtype != torch.bfloat16 or tuple(w.shape) != (bsz, seqlen, n_heads):
        raise ValueError(
            f"mqa_logits_bf16: w must be bf16 [B={bsz},S={seqlen},H={n_heads}], got {w.dtype} {tuple(w.shape)}"
        )


def mqa_logits_bf16_ref(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Indexer scores as the V4.1 model computes them after FP4 quantize-dequantize.

    Args:
        q: [B, S, H, D] bf16 index queries (already FP4-QDQ'd by the caller).
        k: [B, T, D] bf16 index keys (already FP4-QDQ'd).
        w: [B, S, H] bf16 head weights (weights_proj output times the softmax and head scales).

    Returns:
        [B, S, T] bf16, no masking (the model masks). Rounding points, as in
        Indexer.forward: each (s, h, t) dot exact, rounded to fp32 and then to bf16; relu; times
        the bf16 weight, rounded to bf16; summed over h in fp32 with one final bf16 rounding.
        The model's bf16 einsum accumulates in fp32; on FP4-QDQ'd operands that fp32 sum is
        exact (products are multiples of 1/4 below 37 times one power of two per 32-block, so it
        is exact while the block scales of q and k span at most 9 binades), so the two agree
        bitwise there, and this form does not depend on the host's bf16 GEMM kernel. It holds the
        same [B, S, H, T] bf16 intermediate the model does.

    Raises:
        ValueError: on a shape or dtype outside the contract.
    """
    check_mqa_logits_bf16_args(q, k, w)
    # the dot products in float64 (exact), rounded to fp32 and then bf16: what a bf16 GEMM with
    # fp32 accumulation gives when its fp32 sum is exact, as it is on FP4-QDQ'd operands, without
    # depending on which bf16 GEMM kernel the host's library picks. The neuron spelling sums in
    # fp32 (Trainium has no fp64; its matmul accumulates in fp32): the same bits while that sum is exact
    wide = torch.float32 if SPELLING.neuron else torch.float64
    score = torch.einsum("bshd,btd->bsht", q.to(wide), k.to(wide)).float().to(torch.bfloat16)
    return (score.relu() * w.unsqueeze(-1)).sum(dim=2)


# --------------------------------------------------------------------------- FP8 / FP4 forms

def logits_layout(rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(shape, stride) of a [rows, cols] bf16 logits tensor whose rows start every 512 bytes."""
    stride = -(-cols // ROW_ALIGN_ELEMS) * ROW_ALIGN_ELEMS
    return (rows, cols), (max(stride, 1), 1)


def _operand_format(x: torch.Tensor, what: str) -> str:
    if x.dtype == torch.float8_e4m3fn:
        return "fp8"
    if x.dtype in PACKED_FP4_DTYPES:
        return "fp4"
    raise ValueError(f"{what}: expected float8_e4m3fn or packed e2m1 bytes {PACKED_FP4_DTYPES}, got {x.dtype}")


def check_mqa_operands(op: str, q: torch.Tensor, q_sf: torch.Tensor, kv: torch.Tensor, kv_sf: torch.Tensor,
                       weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor) -> None:
    """Shape and dtype contract shared by `mqa_logits` and `mqa_logits_sparse` (works on fake tensors).

    Raises ValueError naming the argument, the expected and the received shape or dtype.
    """
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [S,H,D] (fp8) or [S,H,D/2] (packed fp4), got {tuple(q.shape)}")
    if kv.dim() != 2:
        raise ValueError(f"{op}: kv must be [T,D] (fp8) or [T,D/2] (packed fp4), got {tuple(kv.shape)}")
    fmt = _operand_format(q, f"{op}: q")
    if _operand_format(kv, f"{op}: kv") != fmt:
        raise ValueError(f"{op}: q ({q.dtype}) and kv ({kv.dtype}) must use the same format")
    n_rows, n_heads, width = q.shape
    if kv.shape[1] != width:
        raise ValueError(f"{op}: kv last dim must equal q's ({width}), got {tuple(kv.shape)}")
    dim = width * (2 if fmt == "fp4" else 1)
    if dim == 0 or dim % SCALE_BLOCK:
        raise ValueError(f"{op}: head dim must be a positive multiple of {SCALE_BLOCK}, got {dim}")
    groups = dim // SCALE_BLOCK
    for name, sf, shape in (("q_sf", q_sf, (n_rows, n_heads, groups)), ("kv_sf", kv_sf, (kv.shape[0], groups))):
        if sf.dtype not in _SCALE_DTYPES or tuple(sf.shape) != shape:
            raise ValueError(f"{op}: {name} must be UE8M0 {_SCALE_DTYPES} {shape}, got {sf.dtype} {tuple(sf.shape)}")
    if weights.dtype not in _WEIGHT_DTYPES or tuple(weights.shape) != (n_rows, n_heads):
        raise ValueError(
            f"{op}: weights must be fp32 or bf16 [S={n_rows},H={n_heads}], got {weights.dtype} {tuple(weights.shape)}"
        )
    for name, bound in (("ks", ks), ("ke", ke)):
        if bound.dtype != torch.int32 or tuple(bound.shape) != (n_rows,):
            raise ValueError(f"{op}: {name} must be int32 [S={n_rows}], got {bound.dtype} {tuple(bound.shape)}")


def check_mqa_logits_sparse_extra(block_idx: torch.Tensor, block_size: int, n_rows: int,
                                  op: str = "mqa_logits_sparse") -> None:
    """Shape and dtype contract of the sparse variants' block list (n_rows query rows); raises ValueError."""
    if block_size not in SPARSE_BLOCK_SIZES:
        raise ValueError(f"{op}: block_size must be one of {SPARSE_BLOCK_SIZES}, got {block_size}")
    if block_idx.dtype != torch.int32 or block_idx.dim() != 2 or block_idx.shape[0] != n_rows:
        raise ValueError(
            f"{op}: block_idx must be int32 [S={n_rows},NB], "
            f"got {block_idx.dtype} {tuple(block_idx.shape)}"
        )


def check_ranges(op: str, ks: torch.Tensor, ke: torch.Tensor, n_kv: int) -> None:
    """Value contract of the per-row key ranges: 0 <= ks <= ke <= T. Raises ValueError naming the first bad row.

    Skipped while the reference is traced (the cpu lowering inlines it): a value check needs a host
    sync that a graph cannot hold. The ranges then come from the model's own graph, not from a caller.
    """
    if torch.compiler.is_compiling():
        return
    bad = (ks < 0) | (ks > ke) | (ke > n_kv)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{op}: row {row} has the key range [ks={int(ks[row])}, ke={int(ke[row])}); "
            f"need 0 <= ks <= ke <= T={n_kv}"
        )


def _dequantize(x: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float8_e4m3fn:
        return dequantize_e4m3(x, sf)
    return dequantize_e2m1(x, sf)


def _logits_at(q: torch.Tensor, q_sf: torch.Tensor, kv: torch.Tensor, kv_sf: torch.Tensor, weights: torch.Tensor,
               keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """bf16 logits [S, C] (512-byte rows): score of key keys[s, c] where valid, -inf elsewhere."""
    n_rows, n_heads = q.shape[:2]
    n_kv, n_cols = kv.shape[0], keys.shape[1]
    if n_kv == 0 or n_rows * n_cols == 0:
        logits = torch.full((n_rows, n_cols), -math.inf, dtype=torch.bfloat16, device=q.device)
    else:
        qf = _dequantize(q, q_sf)  # exact in fp32 (e4m3/e2m1 times a power of two)
        kf = _dequantize(kv, kv_sf)
        wf = weights.float()
        safe = keys.clamp(0, n_kv - 1)
        if torch.compiler.is_compiling():
            # traced (the cpu lowering inlines this reference): one chunk, since a loop over a
            # dynamic row count cannot be traced, and the compiler plans the memory anyway
            logits = _score_rows(qf, kf, wf, safe, valid)
        else:  # eager: chunks of rows bound the [rows, H, T] scores
            step = max(1, _CHUNK_BYTES // (8 * n_heads * n_kv))
            logits = torch.cat([_score_rows(qf[r0:r0 + step], kf, wf[r0:r0 + step], safe[r0:r0 + step],
                                            valid[r0:r0 + step]) for r0 in range(0, n_rows, step)])
    # rows padded to the aligned stride, then viewed back to n_cols: the seed's 512-byte rows
    (_, width), (stride, _) = logits_layout(n_rows, n_cols)
    return torch.nn.functional.pad(logits, (0, stride - width))[:, :width]


def _score_rows(qf: torch.Tensor, kf: torch.Tensor, wf: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """bf16 [R, C]: fp32 scores of rows qf [R,H,D] against every key kf [T,D], then the wanted keys
    [R, C] picked (the [R, T] scores are small at the model's shapes), -inf where not valid:
    torch.where keeps NaN/inf of unpicked keys out."""
    head = torch.einsum("shd,td->sht", qf, kf)
    score = (head.relu() * wf.unsqueeze(-1)).sum(dim=1)
    return torch.where(valid, score.gather(1, keys), -math.inf).to(torch.bfloat16)


def mqa_logits_ref(q: torch.Tensor, q_sf: torch.Tensor, kv: torch.Tensor, kv_sf: torch.Tensor,
                   weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, max_seqlen_k: int) -> torch.Tensor:
    """Dense MQA logits over contiguous keys, FP8 or FP4 operands.

    Args:
        q: [S, H, D] float8_e4m3fn, or [S, H, D/2] packed e2m1 (int8/uint8/float4_e2m1fn_x2; even
            element in the low nibble). S counts query tokens of every request (no batch dim).
        q_sf: [S, H, D/32] UE8M0 scales (float8_e8m0fnu or exponent bytes uint8), one per 32 elements.
        kv: [T, D] or [T, D/2], same format as q. T counts keys of every request.
        kv_sf: [T, D/32] UE8M0 scales.
        weights: [S, H] fp32 or bf16 head weights.
        ks, ke: [S] int32 absolute key range [ks, ke) of each row; 0 <= ks <= ke <= T.
        max_seqlen_k: output columns (>= 0). Pass max(ke - ks) for the compressed form, or T with
            ks = 0 for the full form.

    Returns:
        [S, max_seqlen_k] bf16, rows starting every 512 bytes. Column j of row s is key ks[s] + j:
        bf16(sum_h relu(q[s,h] . kv[t]) * w[s,h]) with dequantized operands (value times
        2^(byte - 127) per 32-group, exact in fp32), dot products and the head sum in fp32;
        -inf where ks[s] + j >= ke[s].

    Raises:
        ValueError: on a shape, dtype or range outside the contract.
    """
    check_mqa_operands("mqa_logits", q, q_sf, kv, kv_sf, weights, ks, ke)
    if max_seqlen_k < 0:
        raise ValueError(f"mqa_logits: max_seqlen_k must be >= 0, got {max_seqlen_k}")
    check_ranges("mqa_logits", ks, ke, kv.shape[0])
    ks64, ke64 = ks.long().unsqueeze(1), ke.long().unsqueeze(1)
    keys = ks64 + torch.arange(max_seqlen_k, dtype=torch.int64, device=ks.device)
    return _logits_at(q, q_sf, kv, kv_sf, weights, keys, keys < ke64)


def mqa_logits_kernel_ref(q: torch.Tensor, q_sf: torch.Tensor, kv: torch.Tensor, kv_sf: torch.Tensor,
                          weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, max_seqlen_k: int,
                          fmt: str) -> torch.Tensor:
    """`mqa_logits_ref` in the calling convention of `mqa_logits_nki.mqa_logits_kernel`: operands as
    bytes (q, kv uint8 e4m3fn codes for fmt "fp8" or packed e2m1 for "fp4"; scales uint8 UE8M0
    exponents) -> the kernel's whole output, bf16 [S, stride] with stride = max_seqlen_k rounded up
    to 256 columns (512-byte rows; the columns past max_seqlen_k are 0). It is the decomposition of
    the kernel's StableHLO composite (compiler/stablehlo.py); the ranges are not value-checked
    (that would be a host sync), as in the kernel. Raises ValueError for a fmt other than "fp8" / "fp4"."""
    keys = ks.long().unsqueeze(1) + torch.arange(max_seqlen_k, dtype=torch.int64, device=ks.device)
    return _kernel_logits(q, q_sf, kv, kv_sf, weights, keys, keys < ke.long().unsqueeze(1), fmt, "mqa_logits_kernel_ref")


def mqa_logits_sparse_kernel_ref(q: torch.Tensor, q_sf: torch.Tensor, kv: torch.Tensor, kv_sf: torch.Tensor,
                                 weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, block_idx: torch.Tensor,
                                 block_size: int, fmt: str) -> torch.Tensor:
    """`mqa_logits_sparse_ref` in the calling convention of `mqa_logits_nki.mqa_logits_sparse_kernel`
    (operands as bytes, as `mqa_logits_kernel_ref`) -> bf16 [S, stride] for NB * block_size
    columns. Raises ValueError for a fmt other than "fp8" / "fp4"."""
    keys, valid = _block_keys(ks, ke, block_idx, block_size)
    return _kernel_logits(q, q_sf, kv, kv_sf, weights, keys, valid, fmt, "mqa_logits_sparse_kernel_ref")


def _kernel_logits(q, q_sf, kv, kv_sf, weights, keys, valid, fmt, what):
    if fmt == "fp8":
        qf = e4m3_to_float(q).unflatten(-1, (-1, SCALE_BLOCK)) * ue8m0_to_float(q_sf).unsqueeze(-1)
        kf = e4m3_to_float(kv).unflatten(-1, (-1, SCALE_BLOCK)) * ue8m0_to_float(kv_sf).unsqueeze(-1)
        qf, kf = qf.flatten(-2), kf.flatten(-2)
    elif fmt == "fp4":
        qf, kf = dequantize_e2m1(q, q_sf), dequantize_e2m1(kv, kv_sf)
    else:
        raise ValueError(f"{what}: fmt must be fp8 or fp4, got {fmt!r}")
    logits = _score_rows(qf, kf, weights.float(), keys.clamp(0, max(kv.shape[0] - 1, 0)), valid)
    (_, width), (stride, _) = logits_layout(q.shape[0], keys.shape[1])
    return torch.nn.functional.pad(logits, (0, stride - width))


def _block_keys(ks: torch.Tensor, ke: torch.Tensor, block_idx: torch.Tensor, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys int64 [S, NB*B], valid bool [S, NB*B]) of the sparse variants: column b*B + o of row s
    is key block_idx[s, b] * B + ks[s] % B + o, valid where the block is not empty (>= 0) and the key
    lies in [ks[s], ke[s])."""
    n_blocks = block_idx.shape[1]
    ks64, ke64 = ks.long().unsqueeze(1), ke.long().unsqueeze(1)
    blocks = block_idx.long().repeat_interleave(block_size, dim=1)
    offset = torch.arange(block_size, dtype=torch.int64, device=ks.device).repeat(n_blocks)
    keys = blocks * block_size + ks64 % block_size + offset
    return keys, (blocks >= 0) & (keys >= ks64) & (keys < ke64)


def mqa_logits_sparse_ref(q: torch.Tensor, q_sf: torch.Tensor, kv: torch.Tensor, kv_sf: torch.Tensor,
                          weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, block_idx: torch.Tensor,
                          block_size: int) -> torch.Tensor:
    """MQA logits over selected key blocks (the candidate-block path), FP8 or FP4 operands.

    Args: as `mqa_logits_ref`, plus
        block_idx: [S, NB] int32 selected blocks per row; negative entries (-1) are empty.
        block_size: B, keys per block: 8 or 16.

    Returns:
        [S, NB * B] bf16, rows starting every 512 bytes. Column b*B + o of row s is key
        t = block_idx[s, b] * B + ks[s] % B + o (blocks are aligned to the row's start), with the
        score of `mqa_logits_ref`; -inf where the block is empty or t lies outside [ks[s], ke[s]).
        Every entry of block_idx is read. (The seed's kernel reads only the first
        ceil((ke - ks) / B) entries; the two agree whenever the blocks that reach into the range
        come first, as a sorted candidate list with -1 padding at the end does.)

    Raises:
        ValueError: on a shape, dtype, block size or range outside the contract.
    """
    check_mqa_operands("mqa_logits_sparse", q, q_sf, kv, kv_sf, weights, ks, ke)
    check_mqa_logits_sparse_extra(block_idx, block_size, q.shape[0])
    check_ranges("mqa_logits_sparse", ks, ke, kv.shape[0])
    keys, valid = _block_keys(ks, ke, block_idx, block_size)
    return _logits_at(q, q_sf, kv, kv_sf, weights, keys, valid)


# --------------------------------------------------------------------------- paged KV cache

def check_paged_operands(op: str, q: torch.Tensor, q_sf: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor) -> None:
    """Shape and dtype contract shared by the paged references (works on fake tensors).

    Raises ValueError naming the argument, the expected and the received shape or dtype.
    """
    if q.dim() != 4 or q.shape[1] < 1:
        raise ValueError(f"{op}: q must be [B,N,H,D] (fp8) or [B,N,H,D/2] (packed fp4) with N >= 1 query tokens "
                         f"per sequence, got {tuple(q.shape)}")
    fmt = _operand_format(q, f"{op}: q")
    n_seq, next_n, n_heads, width = q.shape
    dim = width * (2 if fmt == "fp4" else 1)
    if dim == 0 or dim % SCALE_BLOCK:
        raise ValueError(f"{op}: head dim must be a positive multiple of {SCALE_BLOCK}, got {dim}")
    groups = dim // SCALE_BLOCK
    if q_sf.dtype not in _SCALE_DTYPES or tuple(q_sf.shape) != (n_seq, next_n, n_heads, groups):
        raise ValueError(f"{op}: q_sf must be UE8M0 {_SCALE_DTYPES} {(n_seq, next_n, n_heads, groups)}, "
                         f"got {q_sf.dtype} {tuple(q_sf.shape)}")
    # one token is `width` data bytes plus `groups` scale bytes, stored in two runs per page
    if (kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[1] < 1 or kv_cache.shape[2] != 1
            or kv_cache.shape[3] != width + groups):
        raise ValueError(f"{op}: kv_cache must be uint8 [pages, page_size >= 1, 1, {width}+{groups}] for {fmt} "
                         f"D={dim}, got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    if weights.dtype not in _WEIGHT_DTYPES or tuple(weights.shape) != (n_seq * next_n, n_heads):
        raise ValueError(f"{op}: weights must be fp32 or bf16 [B*N={n_seq * next_n},H={n_heads}], "
                         f"got {weights.dtype} {tuple(weights.shape)}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) not in ((n_seq,), (n_seq, next_n)):
        raise ValueError(f"{op}: context_lens must be int32 [B={n_seq}] or [B={n_seq},N={next_n}], "
                         f"got {context_lens.dtype} {tuple(context_lens.shape)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != n_seq:
        raise ValueError(f"{op}: block_table must be int32 [B={n_seq},max_blocks], "
                         f"got {block_table.dtype} {tuple(block_table.shape)}")


def _row_ends(op: str, context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """int64 [B, N]: query token n of sequence b sees context positions < end[b, n]. Per-row lens
    [B, N] are the ends; per-sequence lens [B] give DeepGEMM's causal rule ctx - N + n + 1."""
    lens = context_lens.long()
    if lens.dim() == 1:
        ends = lens[:, None] - next_n + 1 + torch.arange(next_n)
        if bool((ends[:, 0] < 0).any()):
            b = int((ends[:, 0] < 0).nonzero()[0, 0])
            raise ValueError(f"{op}: context_lens[{b}] = {int(lens[b])} is below next_n - 1 = {next_n - 1}; "
                             f"query token n sees positions < context_len - next_n + n + 1")
        return ends
    if bool((lens < 0).any()):
        b, n = (int(i) for i in (lens < 0).nonzero()[0])
        raise ValueError(f"{op}: context_lens[{b}, {n}] = {int(lens[b, n])} is negative")
    return lens


def _gather_pages(op: str, kv_cache: torch.Tensor, width: int, block_table: torch.Tensor,
                  ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pages each sequence's context covers, in table order, as token rows: (data uint8 [U*page, width],
    scales uint8 [U*page, D/32], start int64 [B]: the row of sequence b's position 0).

    Page p holds the bytes kv_cache[p] in row-major order: page_size * width data bytes (token-major),
    then page_size * D/32 scale bytes (DeepGEMM csrc/apis/attention.hpp, paged KV helpers). Only table slots below
    ceil(max_n end[b, n] / page_size) are read (DeepGEMM's contract: slots past the context may hold
    anything), and those must name a page of the cache.
    """
    n_pages, page_kv = kv_cache.shape[:2]
    n_slots = block_table.shape[1]
    seq_end = ends.amax(dim=1)
    used = -(-seq_end // page_kv)
    if bool((used > n_slots).any()):
        b = int((used > n_slots).nonzero()[0, 0])
        raise ValueError(f"{op}: sequence {b} has context {int(seq_end[b])} > max_blocks {n_slots} * page_size "
                         f"{page_kv}: it needs {int(used[b])} block_table slots")
    in_context = torch.arange(n_slots) < used[:, None]
    pages = block_table[in_context].long()  # a masked read: the slots past each context are never touched
    bad = (pages < 0) | (pages >= n_pages)
    if bool(bad.any()):
        b, slot = (int(i) for i in in_context.nonzero()[int(bad.nonzero()[0, 0])])
        raise ValueError(f"{op}: block_table[{b}, {slot}] = {int(block_table[b, slot])} lies inside sequence {b}'s "
                         f"context ({int(seq_end[b])} positions) but is not a page of kv_cache (0 <= id < {n_pages})")
    page_bytes = kv_cache.reshape(n_pages, -1)[pages]
    split, n_tokens = page_kv * width, pages.numel() * page_kv
    data = page_bytes[:, :split].reshape(n_tokens, width)
    scales = page_bytes[:, split:].reshape(n_tokens, kv_cache.shape[3] - width)
    return data, scales, (torch.cumsum(used, 0) - used) * page_kv


def _paged_logits_at(op: str, q: torch.Tensor, q_sf: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                     context_lens: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
    """bf16 logits [B*N, C] (512-byte rows): score of context position positions[r, c] of row r's
    sequence where valid and below the row's end, -inf elsewhere."""
    n_seq, next_n, n_heads, width = q.shape
    ends = _row_ends(op, context_lens, next_n)
    data, scales, start = _gather_pages(op, kv_cache, width, block_table, ends)
    kv = data.view(torch.float8_e4m3fn) if q.dtype == torch.float8_e4m3fn else data
    valid = valid & (positions < ends.reshape(-1, 1))
    keys = start.repeat_interleave(next_n)[:, None] + positions  # _logits_at clamps the invalid ones
    rows = n_seq * next_n
    return _logits_at(q.reshape(rows, n_heads, width), q_sf.reshape(rows, n_heads, q_sf.shape[3]), kv, scales, weights,
                      keys, valid)


def paged_mqa_logits_ref(q: torch.Tensor, q_sf: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
    """Dense MQA logits over a paged KV cache (decode: N query tokens per sequence), FP8 or FP4 operands.

    Args:
        q: [B, N, H, D] float8_e4m3fn, or [B, N, H, D/2] packed e2m1 (as `mqa_logits_ref`); N >= 1
            query tokens per sequence (DeepGEMM next_n).
        q_sf: [B, N, H, D/32] UE8M0 scales (float8_e8m0fnu or exponent bytes uint8).
        kv_cache: [pages, page_size, 1, Dk + D/32] uint8, Dk = D (fp8) or D/2 (fp4): page p's bytes
            kv_cache[p] (row-major) are page_size * Dk key bytes, token-major, then page_size * D/32
            UE8M0 bytes, one per 32 elements (the seed's page layout [page_kv * data | page_kv * sf]).
        weights: [B*N, H] fp32 or bf16; row b*N + n belongs to query token n of sequence b.
        context_lens: [B] int32 (query token n sees positions < context_lens[b] - N + n + 1: DeepGEMM's
            1-D causal rule) or [B, N] int32 (token n sees positions < context_lens[b, n]).
        block_table: [B, max_blocks] int32; context position j of sequence b is token j % page_size
            of page block_table[b, j // page_size]. Slots at or past ceil(context / page_size) (the
            context being the largest end among the sequence's rows) are never read and may hold anything.
        max_context_len: output columns (>= 0); positions from there on are not returned.

    Returns:
        [B*N, max_context_len] bf16, rows starting every 512 bytes. Column j of row b*N + n is context
        position j of sequence b, scored as `mqa_logits_ref` scores a key; -inf from the row's end on.

    Raises:
        ValueError: on a shape or dtype outside the contract; on context_lens below N - 1 (1-D) or
            negative (2-D); on a context longer than max_blocks * page_size; on a table slot inside a
            context that names no page of the cache; on max_context_len < 0.

    Sources: deepseek-ai/DeepGEMM:tests/test_attention.py (ref_fp8_paged_mqa_logits, the mask of
    test_paged_mqa_logits) and DeepGEMM csrc/apis/attention.hpp (fp8_fp4_paged_mqa_logits).
    """
    op = "paged_mqa_logits"
    check_paged_operands(op, q, q_sf, kv_cache, weights, context_lens, block_table)
    if max_context_len < 0:
        raise ValueError(f"{op}: max_context_len must be >= 0, got {max_context_len}")
    positions = torch.arange(max_context_len, dtype=torch.int64).expand(q.shape[0] * q.shape[1], -1)
    return _paged_logits_at(op, q, q_sf, kv_cache, weights, context_lens, block_table, positions,
                            torch.ones_like(positions, dtype=torch.bool))


def paged_mqa_logits_sparse_ref(q: torch.Tensor, q_sf: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                                context_lens: torch.Tensor, block_table: torch.Tensor, block_idx: torch.Tensor,
                                block_size: int) -> torch.Tensor:
    """MQA logits over selected context blocks of a paged KV cache, FP8 or FP4 operands.

    Args: as `paged_mqa_logits_ref`, plus
        block_idx: [B*N, NB] int32 selected blocks of context positions per row; negative entries are empty.
        block_size: B_s, positions per selected block: 8 or 16.

    Returns:
        [B*N, NB * B_s] bf16, rows starting every 512 bytes. Column b*B_s + o of row r is context position
        block_idx[r, b] * B_s + o of the row's sequence (blocks start at position 0: the seed's paged sparse
        kernel, ks = 0), with the dense op's score; -inf where the block is empty or the position lies at
        or past the row's end. Every entry of block_idx is read, as in `mqa_logits_sparse_ref`.

    Raises:
        ValueError: as `paged_mqa_logits_ref`, and on a block size or block_idx shape outside the contract.

    Source: DeepGEMM csrc/apis/attention.hpp (fp8_fp4_paged_sparse_mqa_logits), on the paged layout of `paged_mqa_logits_ref`.
    """
    op = "paged_mqa_logits_sparse"
    check_paged_operands(op, q, q_sf, kv_cache, weights, context_lens, block_table)
    check_mqa_logits_sparse_extra(block_idx, block_size, q.shape[0] * q.shape[1], op)
    blocks = block_idx.long().repeat_interleave(block_size, dim=1)
    positions = blocks * block_size + torch.arange(block_size, dtype=torch.int64).repeat(block_idx.shape[1])
    return _paged_logits_at(op, q, q_sf, kv_cache, weights, context_lens, block_table, positions, blocks >= 0)
