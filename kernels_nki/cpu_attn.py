"""Sparse attention kernel of the cpu target with a fixed order of operations: fakes, wrapper, reference.

The C++ op lives in kernels_nki/cpu/sparse_attn.cpp, built into the one extension of `cpu_gemm`
(importing this module imports that one, which builds and loads it). Registered there:

    torch.ops.dsneuron.sparse_attn_cpu(q, kv, sink, idx, scale) -> bf16 [B,S,H,D]
    torch.ops.dsneuron.exp_cpu(x)                               -> fp32, x's shape (the kernel's exp)

with fake implementations here, so the op exports (symbolic S included) and runs inside AOTInductor
packages through the proxy executor. Same argument contract as `dsneuron::sparse_attn`
(sparse_attn_ref.check_sparse_attn_args): q [B,S,H,D] bf16, kv [B,N,D] bf16 (each row is both key
and value), sink [H] fp32, idx [B,S,K] int32 (-1 or any value outside [0, N) = empty slot), scale
> 0 (used as fp32). Bad arguments raise ValueError naming the argument, from the C++ op and the fake.

Contract, bit for bit, per query row (b, s) and head h, all fp32, over the index list in blocks of
64 slots in order (the last may be partial), m = -1e30, l = 0, o[:] = 0 at the start:

    logit_j = (acc = 0; for d ascending: acc = fma(q[h][d], k_j[d], acc)) * scale   (-inf if empty)
    m_new   = max(m, max_j logit_j);   alpha = exp(m - m_new);   p_j = exp(logit_j - m_new)
    l       = l * alpha + (sum_j p_j in slot order, from 0)                  (mul, then add)
    o[d]    = o[d] * alpha + (pv = 0; for j in order: pv = fma(bf16(p_j), v_j[d], pv))
    m       = m_new
    out[d]  = bf16(o[d] / (l + exp(sink[h] - m))), and 0 where l == 0 (no valid slot), whatever the sink

with k_j = v_j = kv[b, idx_j] upcast exactly, bf16() round to nearest even, and exp the kernel's own
(`exp_ref`; within 1 ulp, measured in tests). Empty slots never read kv, so NaN or inf in rows no
valid slot references cannot reach the result. NaN in used operands propagates (max is NaN-aware
and l == 0 is tested, not l > 0). `sparse_attn_cpu_ref` is exactly this sequence in torch ops.

Named deviations from the golden `sparse_attn_ref` (float64 dot products and block sums, each
rounded once, and torch.exp): here q . k and each block's P @ V are fp32 fma chains in a fixed
order, the block's sum of P is a chain of fp32 adds, and exp is `exp_ref` instead of torch.exp (which
need not be the same function on every host; `exp_ref` is within 0.85 ulp, one step off the
correctly rounded value for ~6% of the arguments |x| >= 0.35 that softmax sees). The
result stays within a few bf16 steps of the golden (the bound is derived and checked in
tests/test_cpu_attn.py), and it does not depend on S, B, the thread count or the ISA.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from dsneuron.kernels_nki.cpu_gemm import fma32
from dsneuron.kernels_nki.sparse_attn_ref import BLOCK_KEYS, M_INIT

# The exp of the kernel (sparse_attn.cpp `vexp`), constant for constant.
#: 1.5 * 2^23: fma(x, log2e, it) rounds x * log2(e) to an integer k (ties to even), k = bits - bits(it)
EXP_SHIFT = float.fromhex("0x1.8p23")
EXP_SHIFT_BITS = 0x4B400000
LOG2E = float.fromhex("0x1.715476p+0")
#: ln2 to 16 bits, so k * LN2_HI is exact for |k| < 256 and x - k * LN2_HI is exact (Sterbenz)
LN2_HI = float.fromhex("0x1.62e400p-1")
LN2_LO = float.fromhex("0x1.7f7d1cp-20")
#: exp(r) on [-ln2/2, ln2/2], coefficients of r^7 .. r^0 (Horner, fma): (exp(r) - 1 - r) / r^2 fit by
#: Chebyshev interpolation of degree 5, rounded to fp32; relative error ~2^-30 before rounding
EXP_POLY = tuple(float.fromhex(h) for h in ("0x1.a124e4p-13", "0x1.6d4316p-10", "0x1.1110e0p-7", "0x1.5554eap-5",
                                            "0x1.555556p-3", "0x1.0p-1", "0x1.0p0", "0x1.0p0"))
#: the clamp of x: exp(-104) < 2^-150 rounds to 0 and exp(89) overflows, so the formula itself gives 0 and inf
EXP_LO, EXP_HI = -104.0, 89.0


def _fp32(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def check_args(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float) -> None:
    """The C++ op's argument checks, on fake tensors too: ValueError naming the argument, on the
    same conditions as the C++ op (whose message spells dtypes in c10's names)."""
    fn = "sparse_attn_cpu"
    if q.dtype != torch.bfloat16 or q.dim() != 4:
        raise ValueError(f"{fn}: q must be bf16 [B,S,H,D], got {q.dtype} {tuple(q.shape)}")
    bsz, seqlen, n_heads, dim = q.shape
    if kv.dtype != torch.bfloat16 or kv.dim() != 3 or kv.shape[0] != bsz or kv.shape[2] != dim:
        raise ValueError(f"{fn}: kv must be bf16 [B={bsz},N,D={dim}], got {kv.dtype} {tuple(kv.shape)}")
    if sink.dtype != torch.float32 or sink.dim() != 1 or sink.shape[0] != n_heads:
        raise ValueError(f"{fn}: sink must be fp32 [H={n_heads}], got {sink.dtype} {tuple(sink.shape)}")
    if idx.dtype != torch.int32 or idx.dim() != 3 or idx.shape[0] != bsz or idx.shape[1] != seqlen:
        raise ValueError(f"{fn}: idx must be int32 [B={bsz},S={seqlen},K], got {idx.dtype} {tuple(idx.shape)}")
    if not (math.isfinite(scale) and math.isfinite(_fp32(scale)) and _fp32(scale) > 0):
        raise ValueError(f"{fn}: scale must be finite and > 0 in fp32, got {scale}")


@torch.library.register_fake("dsneuron::sparse_attn_cpu")
def _sparse_attn_cpu_fake(q, kv, sink, idx, scale):
    check_args(q, kv, sink, idx, scale)
    return q.new_empty(q.shape)


@torch.library.register_fake("dsneuron::exp_cpu")
def _exp_cpu_fake(x):
    if x.dtype != torch.float32:
        raise ValueError(f"exp_cpu: x must be fp32, got {x.dtype} {tuple(x.shape)}")
    return x.new_empty(x.shape)


def sparse_attn_cpu(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [B,S,H,D] bf16, kv [B,N,D] bf16, sink [H] fp32, idx [B,S,K] int32, scale -> bf16 [B,S,H,D]
    (contract: module docstring; reference: `sparse_attn_cpu_ref`)."""
    return torch.ops.dsneuron.sparse_attn_cpu(q, kv, sink, idx, scale)


def exp_cpu(x: torch.Tensor) -> torch.Tensor:
    """The kernel's fp32 exp, elementwise (debug op; equal to `exp_ref`)."""
    return torch.ops.dsneuron.exp_cpu(x)


# ------------------------------------------------------------------------------------------ reference

def _c(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def exp_ref(x: torch.Tensor) -> torch.Tensor:
    """The kernel's exp on an fp32 tensor, step for step in torch ops (fma32 for each fma)."""
    nan = x.isnan()
    xc = torch.where(nan, 0.0, x).clamp(EXP_LO, EXP_HI)
    t = fma32(xc, _c(LOG2E), _c(EXP_SHIFT))
    nk = _c(EXP_SHIFT) - t  # -k, exact
    r = fma32(nk, _c(LN2_LO), fma32(nk, _c(LN2_HI), xc))
    p = torch.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = fma32(p, r, _c(c))
    k = t.view(torch.int32) - EXP_SHIFT_BITS
    k1 = k >> 1  # arithmetic shift
    s1 = ((k1 + 127) << 23).view(torch.float32)
    s2 = ((k - k1 + 127) << 23).view(torch.float32)
    return torch.where(nan, x, (p * s1) * s2)


def sparse_attn_cpu_ref(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """The contract of the module docstring in plain torch, every fp32 rounding where the kernel has it.

    Each fma is `cpu_gemm.fma32` (exact); chains run for all (row, head, slot) side by side, one
    step per d (logits) or per slot (P @ V, block sums). Empty slots take an appended zero row, a
    -inf logit and p = 0, which leave every chain unchanged. Slow (D + 2K steps); for tests.
    """
    check_args(q, kv, sink, idx, scale)
    bsz, seqlen, n_heads, dim = q.shape
    n_kv, topk, rows = kv.shape[1], idx.shape[2], bsz * seqlen
    if q.numel() == 0:
        return torch.zeros(q.shape, dtype=torch.bfloat16)
    valid = ((idx >= 0) & (idx < n_kv)).view(rows, topk)
    base = (torch.arange(bsz) * n_kv).view(bsz, 1, 1)
    flat = torch.where(valid.view(bsz, seqlen, topk), idx.long() + base, bsz * n_kv).view(rows, topk)
    table = torch.cat([kv.reshape(bsz * n_kv, dim), kv.new_zeros(1, dim)])
    kg = table[flat].float()  # [R, K, D], exact
    qf = q.reshape(rows, n_heads, dim).float()

    acc = torch.zeros(rows, n_heads, topk)
    for d in range(dim):
        acc = fma32(qf[:, :, None, d], kg[:, None, :, d], acc)
    logits = torch.where(valid[:, None, :], acc * _c(_fp32(scale)), -math.inf)

    m = torch.full((rows, n_heads), M_INIT, dtype=torch.float32)
    l = torch.zeros(rows, n_heads)
    o = torch.zeros(rows, n_heads, dim)
    for j0 in range(0, topk, BLOCK_KEYS):
        s = logits[..., j0:j0 + BLOCK_KEYS]
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = exp_ref(m - m_new)
        p = exp_ref(s - m_new.unsqueeze(-1))
        psum = torch.zeros(rows, n_heads)
        for j in range(s.shape[-1]):
            psum = psum + p[..., j]
        l = l * alpha + psum
        p16 = p.to(torch.bfloat16).float()
        pv = torch.zeros(rows, n_heads, dim)
        for j in range(s.shape[-1]):
            pv = fma32(p16[:, :, j, None], kg[:, None, j0 + j, :], pv)
        o = o * alpha.unsqueeze(-1) + pv
        m = m_new
    den = l + exp_ref(sink.view(1, n_heads) - m)
    out = torch.where((l == 0).unsqueeze(-1), 0.0, o / den.unsqueeze(-1))
    return out.to(torch.bfloat16).view(bsz, seqlen, n_heads, dim)
