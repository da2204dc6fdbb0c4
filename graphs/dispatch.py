"""Kernel dispatch of the graphs: where the numerics switches (graphs/numerics.py) send a GEMM, a
QDQ, a state-row encoding, a mean of squares or the sparse attention: to the reference expression
(graphs/quant.py, the torch.ops.dsneuron ops) or to the cpu target's kernels (kernels_nki/cpu_*.py,
built on first use), bit-identical where the golden needs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dsneuron.kernels_nki  # noqa: F401  registers torch.ops.dsneuron.*

from .numerics import NUMERICS
from .quant import INDEX_K_FORMAT, StateFormat, act_quant_qdq, dequantize_state, fp4_act_quant_qdq, fp4_operand_bytes, quantize_state


def kernel_gemm(a: torch.Tensor, owner: nn.Module, prefix: str, fmt: str, n: int,
                init: torch.Tensor | None = None) -> torch.Tensor:
    """a fp32 [..., K] @ W.T -> fp32 [..., n] through the cpu kernel (GEMM order "kernel"), W the
    prepared weight `owner` holds as buffers <prefix>kernel_w / <prefix>kernel_w_scale; with init
    fp32 [..., n] each element's block sum starts from init (cpu_gemm.gemm_acc). Numerics "fast"
    (`kernel_numerics`) runs it on the bf16 dot product kernel unless fmt is fp32."""
    kernels = _gemm_kernels(fmt)
    lead = a.shape[:-1]
    prepared = {"w": getattr(owner, f"{prefix}kernel_w"), "w_scale": getattr(owner, f"{prefix}kernel_w_scale")}
    a2 = a.reshape(-1, a.shape[-1])
    if init is None:
        return kernels.gemm(a2, prepared, fmt, n).reshape(*lead, n)
    return kernels.gemm_acc(a2, prepared, fmt, n, init.reshape(-1, n)).reshape(*lead, n)


def _gemm_kernels(fmt: str):
    """The module whose gemm / gemm_acc / gemm_segments run a GEMM on `fmt` weights in the current
    numerics: cpu_gemm (exact), or cpu_gemm_fast (fast, but fp32 weights, which it does not take)."""
    if NUMERICS.numerics == "fast" and fmt != "fp32":
        from dsneuron.kernels_nki import cpu_gemm_fast  # builds the kernels on first use

        return cpu_gemm_fast
    from dsneuron.kernels_nki import cpu_gemm  # builds the kernels on first use

    return cpu_gemm


def kernel_gemm_segments(a: torch.Tensor, offsets: torch.Tensor, owner: nn.Module, prefix: str, fmt: str,
                         n: int) -> torch.Tensor:
    """Grouped `kernel_gemm`: rows offsets[e]..offsets[e+1]-1 of a fp32 [R, K] against the e-th of
    the stacked prepared weights <prefix>kernel_w / _scale of `owner` -> fp32 [R, n]."""
    w, ws = getattr(owner, f"{prefix}kernel_w"), getattr(owner, f"{prefix}kernel_w_scale")
    return _gemm_kernels(fmt).gemm_segments(a, offsets, {"w": w, "w_scale": ws}, fmt, n)


def kernel_fp8_activation(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """`fp8_activation` (FP8 QDQ, fp32 out) as one cpu kernel call: bit-identical, and one graph
    node where the decomposed QDQ is ~35 (kernels_nki/cpu_gemm.py `fp8_act_dequant`)."""
    from dsneuron.kernels_nki import cpu_gemm

    return cpu_gemm.fp8_act_dequant(x, block)


def fp8_qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    """`act_quant_qdq` (x.dtype out); in GEMM order "kernel" through `kernel_fp8_activation`."""
    if NUMERICS.gemm_order != "kernel":
        return act_quant_qdq(x, block)
    return kernel_fp8_activation(x, block).to(x.dtype)


def fp4_qdq(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    """`fp4_act_quant_qdq` (x.dtype out); in GEMM order "kernel" as one cpu kernel call, bit-identical
    (kernels_nki/cpu_gemm.py `fp4_act_dequant`), where the decomposed QDQ is ~40 graph nodes."""
    if NUMERICS.gemm_order != "kernel":
        return fp4_act_quant_qdq(x, block, scale_fmt)
    from dsneuron.kernels_nki import cpu_gemm

    return cpu_gemm.fp4_act_dequant(x, block, scale_fmt).to(x.dtype)


def state_bytes(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """x [..., K] bf16/fp32 before its QDQ -> the cache rows uint8 [..., fmt.row_bytes(K)] that hold
    its QDQ (`quant.quantize_state`); in GEMM order "kernel" as one cpu kernel call, bit-identical
    (kernels_nki/cpu_gemm.py `state_quant`)."""
    if NUMERICS.gemm_order != "kernel":
        return quantize_state(x, fmt)
    from dsneuron.kernels_nki import cpu_gemm

    return cpu_gemm.state_quant(x, fmt.block, fmt.elem, fmt.scale)


def state_values(b: torch.Tensor, K: int, fmt: StateFormat) -> torch.Tensor:
    """Cache rows uint8 [..., fmt.row_bytes(K)] -> their values bf16 [..., K], exact
    (`quant.dequantize_state`; GEMM order "kernel": cpu_gemm.py `state_dequant`)."""
    if NUMERICS.gemm_order != "kernel":
        return dequantize_state(b, K, fmt).to(torch.bfloat16)
    from dsneuron.kernels_nki import cpu_gemm

    return cpu_gemm.state_dequant(b, K, fmt.block, fmt.elem, fmt.scale)


def kernel_mean_square(xf: torch.Tensor) -> torch.Tensor:
    """`mean_square` (xf fp32 [..., D] -> fp32 [..., 1]) as one cpu kernel call, bit-identical: the
    golden's ATen expression, run from C++ (kernels_nki/cpu_gemm.py `mean_square`)."""
    from dsneuron.kernels_nki import cpu_gemm

    return cpu_gemm.mean_square(xf)


def plain_fmt(owner: nn.Module, prefix: str) -> str:
    """The kernel format of a prepared plain weight: bf16 or fp32 panels (a bf16 checkpoint weight
    the model holds as fp32 is prepared from its bf16 bytes)."""
    return "bf16" if getattr(owner, f"{prefix}kernel_w").dtype == torch.bfloat16 else "fp32"


def sparse_attn(q: torch.Tensor, keys: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """`torch.ops.dsneuron.sparse_attn` (q bf16 [B,S,H,hd], keys bf16 [B,N,hd], sink fp32 [H], idx
    int32 [B,S,K] contiguous -> bf16 [B,S,H,hd]); in GEMM order "kernel" the cpu kernel: fixed fp32
    order, its own exp (kernels_nki/cpu_attn.py)."""
    if NUMERICS.gemm_order == "kernel":
        from dsneuron.kernels_nki import cpu_attn  # builds the kernels on first use

        return cpu_attn.sparse_attn_cpu(q, keys, sink, idx, scale)
    return torch.ops.dsneuron.sparse_attn(q, keys, sink, idx, scale)


def official_index_scores(q: torch.Tensor, index_k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The indexer's scores as the official bf16 expression gives them (indexer mode "official"):
    q bf16 [B,S,H,D] (FP4-QDQ'd), index_k the cache rows uint8 [B,T,D/2 + D/32] (`quant.INDEX_K_FORMAT`),
    w bf16 [B,S,H] -> bf16 [B,S,T] (`mqa_logits_ref.mqa_logits_bf16_ref` on the dequantised keys). In GEMM
    order "kernel" the cpu op that reads the cache bytes directly, bit-identical
    (kernels_nki/cpu_index.py)."""
    if NUMERICS.gemm_order == "kernel":
        from dsneuron.kernels_nki import cpu_index  # builds the kernels on first use

        return cpu_index.index_scores(q, index_k, w)
    k = state_values(index_k, q.shape[-1], INDEX_K_FORMAT)
    return torch.ops.dsneuron.mqa_logits_bf16(q, k, w)


def fp4_index_scores(q: torch.Tensor, index_k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The indexer's scores through the FP4 MQA-logits op (indexer mode "kernel").

    q: [B,S,H,D] bf16 holding FP4-QDQ'd values (e2m1 times a UE8M0 scale per 32 elements);
    index_k: the cache rows uint8 [B,T,D/2 + D/32] (packed e2m1, then UE8M0 exponent bytes:
    `quant.INDEX_K_FORMAT`, the op's operand format); w: [B,S,H] bf16 head weights. Returns bf16 [B,S,T]: bf16(sum_h relu(q_h . k) * w_h)
    with the dot products and the head sum in fp32 (`torch.ops.dsneuron.mqa_logits`), where the
    official expression rounds each head's dot and product to bf16 (`mqa_logits_bf16`). The keys are
    the stored bytes; q is re-encoded as the bytes that hold it (`quant.fp4_operand_bytes`, exact);
    the batch becomes one
    row list over the batch's keys, each row's range [b*T, b*T + T) its own sequence's.
    Source: seeds/003 fp8_fp4_mqa_logits (DeepGEMM); DeepSeek-V4.1-Flash:inference/model.py Indexer.
    """
    B, S, H, D = q.shape
    T = index_k.shape[1]
    q_codes, q_sf = fp4_operand_bytes(q)
    n = INDEX_K_FORMAT.code_bytes(D)
    k_codes, k_sf = index_k[..., :n], index_k[..., n:]
    starts = (torch.arange(B * S, device=q.device) // S * T).to(torch.int32)
    logits = torch.ops.dsneuron.mqa_logits(q_codes.flatten(0, 1), q_sf.flatten(0, 1), k_codes.flatten(0, 1),
                                           k_sf.flatten(0, 1), w.flatten(0, 1), starts, starts + T, T)
    return logits.unflatten(0, (B, S))


def kernel_experts(moe: nn.Module, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The routed experts of `moe` (graphs.model MoE) through the cpu kernels' grouped GEMM: every
    (token, expert) pair is a row, the rows sorted by expert, one GEMM call per projection; each
    token's expert outputs are then added in ascending expert id, as the routed loop adds them. x bf16 [N, D],
    weights fp32 [N, k], indices int64 [N, k] -> fp32 [N, D] (before the shared expert)."""
    N, k = indices.shape
    ids, perm = indices.sort(dim=-1)  # each token's experts in ascending id
    w = weights.gather(1, perm).reshape(-1)
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # [N*k] pairs grouped by expert
    lo, hi = moe.owned.start, moe.owned.stop
    offsets = torch.searchsorted(flat[order], torch.arange(lo, hi + 1, device=x.device))
    shard = (lo, hi) != (0, moe.n_experts)
    if shard:  # an EP shard holds experts lo..hi-1: other ranks' rows run with its first or last expert, unused
        offsets = torch.cat([offsets.new_zeros(1), offsets[1:-1], offsets.new_full((1,), N * k)])
    a = kernel_fp8_activation(x, 32)[order // k]  # each row's token, QDQ'd as its expert's linear does
    ex = moe.experts[lo]
    gate = kernel_gemm_segments(a, offsets, moe, "experts_w1_", "fp4", ex.w1.out_features).to(x.dtype).float()
    up = kernel_gemm_segments(a, offsets, moe, "experts_w3_", "fp4", ex.w3.out_features).to(x.dtype).float()
    if ex.limit > 0:
        up = up.clamp(-ex.limit, ex.limit)
        gate = gate.clamp(max=ex.limit)
    h = w[order].unsqueeze(-1) * (F.silu(gate) * up)
    out = kernel_gemm_segments(kernel_fp8_activation(h.to(x.dtype), 32), offsets, moe, "experts_w2_", "fp4",
                               ex.w2.out_features).to(x.dtype)
    out = torch.empty_like(out).index_copy(0, order, out).view(N, k, -1)  # back to (token, its j-th expert)

    def add_owned(y: torch.Tensor) -> torch.Tensor:
        for j in range(k):
            # another rank's expert adds +0, which leaves y as it is (y, a sum from +0, is never -0)
            y = y + (torch.where(((ids[:, j] >= lo) & (ids[:, j] < hi)).unsqueeze(-1), out[:, j], 0)
                     if shard else out[:, j])
        return y
    y = torch.zeros_like(x, dtype=torch.float32)
    return add_owned(y) if moe.chain is None else moe.chain(add_owned, y)


def grouped_gemm(o: torch.Tensor, owner: nn.Module, prefix: str, lin: nn.Module) -> torch.Tensor:
    """o bf16 [B,S,G,d] against the block-diagonal bf16 Linear `lin` (weight [G*r, d], group g's
    rows against block g: wo_a, model.py Attention.forward) -> fp32 [B,S,G,r] before its one bf16
    rounding (BF16_GEMM in graphs/numerics.py). GEMM order "kernel": one grouped cpu GEMM on the
    weight `owner` holds prepared under `prefix`; "fused": an fp32 einsum; else exact products
    summed in float64 (quant.exact_linear)."""
    B, S, G = o.shape[:3]
    r = lin.out_features // G
    if NUMERICS.gemm_order == "kernel":  # one grouped GEMM: the rows of group g against wo_a's block g
        rows = B * S
        a = o.permute(2, 0, 1, 3).reshape(G * rows, -1).float()
        offsets = torch.arange(G + 1, device=o.device) * rows
        return kernel_gemm_segments(a, offsets, owner, prefix, "bf16", r).view(G, B, S, -1).permute(1, 2, 0, 3)
    w = lin.weight.view(G, r, -1)
    if NUMERICS.gemm_order == "fused":
        return torch.einsum("bsgd,grd->bsgr", o.float(), w.float())
    return torch.einsum("bsgd,grd->bsgr", o.double(), w.double()).float()
