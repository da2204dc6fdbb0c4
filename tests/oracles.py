"""Float64 oracles, test-input quantizers and comparators for the kernel tests.

Written independently of dsneuron.kernels_nki: NumPy float64 (or float32 where a test needs the
kernel's own rounding points), ml_dtypes for fp8/bf16 bit patterns, and hand-written tables for e2m1
and UE8M0. Nothing here imports the package. Sources of the rules: deepseek-ai/FlashMLA's test reference
and comparator (tests/), deepseek-ai/DeepGEMM's FP4/UE8M0 packing and calc_diff, and the V4.1 Indexer.forward expression (deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

# ------------------------------------------------------------------------------------ number codecs

#: e2m1 magnitudes by 3-bit code (OCP MX spec table); bit 3 of a nibble is the sign.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def f64(t: torch.Tensor) -> np.ndarray:
    """bf16/fp32/int tensor -> float64 ndarray (exact: every bf16 and fp32 value is a float64)."""
    return t.detach().double().numpy()


def bf16_rne(x: np.ndarray) -> np.ndarray:
    """Round float64 values to the nearest bf16 value, ties to even, without a float32 detour.

    A bf16 normal number has 8 significant bits: with x = m * 2^e, m in [0.5, 1), the rounded
    value is round_half_even(m * 2^8) * 2^(e - 8). Values below bf16's normal range are not needed
    by these tests and raise ValueError; beyond bf16's max they become inf.
    """
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x) & (x != 0)
    if np.any(finite & (np.abs(x) < 2.0 ** -126)):
        raise ValueError("bf16_rne: subnormal bf16 results are outside this oracle's scope")
    m, e = np.frexp(np.where(finite, x, 1.0))
    r = np.ldexp(np.round(m * 256.0), e - 8)
    r = np.where(np.abs(r) > BF16_MAX, np.copysign(np.inf, r), r)
    return np.where(finite, r, x)


def bf16_order_key(values: np.ndarray) -> np.ndarray:
    """Monotone integer key of bf16 values (given as float32/float64 holding bf16 values):
    adjacent bf16 numbers differ by 1, and -0 == +0."""
    bits = np.asarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.int64)
    return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)


def ulp_distance_bf16(actual: torch.Tensor, ref: np.ndarray) -> np.ndarray:
    """Distance in bf16 steps between a bf16 tensor and bf16-valued reference values."""
    return np.abs(bf16_order_key(actual.float().numpy()) - bf16_order_key(ref))


def decode_e4m3(t: torch.Tensor) -> np.ndarray:
    """float8_e4m3fn tensor -> float64 through ml_dtypes' own e4m3 decoder."""
    return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def decode_ue8m0(t: torch.Tensor) -> np.ndarray:
    """UE8M0 exponent bytes (uint8 or float8_e8m0fnu) -> float64 2^(byte - 127)."""
    b = t.view(torch.uint8).numpy().astype(np.int64)
    return np.ldexp(1.0, b - 127)


def decode_e2m1_packed(t: torch.Tensor) -> np.ndarray:
    """Packed e2m1 [..., D/2] (any 1-byte dtype) -> float64 [..., D]; even element in the low nibble."""
    b = t.view(torch.uint8).numpy().astype(np.int64)
    nib = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    mag = E2M1_MAGNITUDES[nib & 0x7]
    return np.where(nib & 0x8, -mag, mag)


def dequantize(x: torch.Tensor, sf: torch.Tensor, block: int = 32) -> np.ndarray:
    """FP8 or packed FP4 operand [..., D or D/2] with UE8M0 scales [..., D/block] -> float64 [..., D]."""
    vals = decode_e4m3(x) if x.dtype == torch.float8_e4m3fn else decode_e2m1_packed(x)
    scale = np.repeat(decode_ue8m0(sf), block, axis=-1)
    return vals * scale


# --------------------------------------------------------------------------- test-input quantizers

def ceil_ue8m0_byte(x: np.ndarray) -> np.ndarray:
    """Exponent byte of the smallest power of two >= fp32(x) (DeepGEMM ceil_to_ue8m0): the fp32
    exponent field, plus one when the mantissa is non-zero, clamped to [1, 254]."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.int64)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
    return np.clip(exp, 1, 254)


def _group_amax(x: np.ndarray, block: int) -> np.ndarray:
    g = np.abs(x).reshape(*x.shape[:-1], x.shape[-1] // block, block).max(axis=-1)
    return np.maximum(g, 1e-4)


def quantize_fp8(x: np.ndarray, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [..., D] -> (float8_e4m3fn [..., D], UE8M0 bytes uint8 [..., D/block]).

    scale = 2^ceil(log2(amax/448)) per group (amax floored at 1e-4); value = e4m3_rne(x / scale)."""
    byte = ceil_ue8m0_byte(_group_amax(x, block) / 448.0)
    scaled = x / np.repeat(np.ldexp(1.0, byte - 127), block, axis=-1)
    q8 = np.clip(scaled, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return torch.from_numpy(q8.view(np.uint8).copy()).view(torch.float8_e4m3fn), torch.from_numpy(byte.astype(np.uint8))


def e2m1_code(v: np.ndarray, ties: str) -> np.ndarray:
    """Nearest e2m1 code (0..15) of already-scaled values; |v| > 6 saturates to 6, and -0 is 0x0.

    ties="to_zero": DeepGEMM per_token_cast_to_fp4, counting |v| > {.25,.75,1.25,1.75,2.5,3.5,5};
    ties="even": round half to even code (V4.1 fp4_act_quant), so .75, 1.75, 3.5 round up.
    """
    a = np.abs(v)
    if ties == "to_zero":
        mag = sum((a > t).astype(np.int64) for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))
    elif ties == "even":
        dist = np.abs(a[..., None] - E2M1_MAGNITUDES)
        best = dist.min(axis=-1, keepdims=True)
        cand = dist == best
        # among equally near codes take the even one; a single nearest code is always taken
        mag = np.where(cand.sum(-1) > 1, np.argmax(cand & (np.arange(8) % 2 == 0), axis=-1), np.argmax(cand, axis=-1))
    else:
        raise ValueError(ties)
    return np.where((v < 0) & (mag > 0), mag | 0x8, mag)


def pack_nibbles(codes: np.ndarray) -> torch.Tensor:
    """codes [..., D] (0..15) -> int8 [..., D/2], even element in the low nibble."""
    c = codes.astype(np.uint8)
    return torch.from_numpy((c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)).view(torch.int8)


def quantize_fp4(x: np.ndarray, block: int = 32, ties: str = "to_zero") -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [..., D] -> (packed e2m1 int8 [..., D/2], UE8M0 bytes uint8 [..., D/block]).

    scale = 2^ceil(log2(amax/6)) per group (amax floored at 1e-4), code = e2m1_code(x / scale)."""
    byte = ceil_ue8m0_byte(_group_amax(x, block) / 6.0)
    scaled = x / np.repeat(np.ldexp(1.0, byte - 127), block, axis=-1)
    return pack_nibbles(e2m1_code(scaled, ties)), torch.from_numpy(byte.astype(np.uint8))


# ------------------------------------------------------------------------------ sparse attention

def _gather_rows(kv: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """kv [B,N,D], idx [B,S,K] -> (rows [B,S,K,D] with empty slots zeroed, valid [B,S,K])."""
    n_kv = kv.shape[1]
    valid = (idx >= 0) & (idx < n_kv)
    safe = np.where(valid, idx, 0)
    rows = np.stack([kv[b][safe[b]] for b in range(kv.shape[0])])
    rows[~valid] = 0.0
    return rows, valid


def sparse_attn_oracle(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                       scale: float) -> np.ndarray:
    """One-pass float64 sparse attention with sink (FlashMLA tests/ref.py semantics, natural log).

    lse = logsumexp over valid slots; lse_o = logaddexp(lse, sink); out = sum_j exp(s_j - lse_o) v_j;
    a row with no valid slot gives 0. Returns float64 [B,S,H,D]."""
    rows, valid = _gather_rows(f64(kv), idx.numpy().astype(np.int64))
    logits = np.einsum("bshd,bskd->bshk", f64(q), rows) * scale
    logits = np.where(valid[:, :, None, :], logits, -np.inf)
    any_valid = valid.any(axis=-1)[:, :, None]
    m = np.where(any_valid, logits.max(axis=-1), 0.0)
    with np.errstate(divide="ignore"):
        lse = m + np.log(np.exp(logits - m[..., None]).sum(axis=-1))
    lse_o = np.logaddexp(lse, f64(sink))
    with np.errstate(invalid="ignore"):
        p = np.exp(logits - lse_o[..., None])
    out = np.einsum("bshk,bskd->bshd", np.nan_to_num(p, nan=0.0), rows)
    return np.where(any_valid[..., None], out, 0.0)


def sparse_attn_online_f32(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                           scale: float, block: int = 64) -> np.ndarray:
    """The kernel's rounding points in NumPy float32 (docs/numerics.md "Kernel tests: edge cases and tolerances", natural exp): 64-key
    blocks in index order, running max from -1e30, bf16 P into PV, fp32 unrounded P into l, sink in
    the denominator only, bf16 output. Returns float32 [B,S,H,D] holding bf16 values."""
    f32 = np.float32
    rows, valid = _gather_rows(kv.float().numpy(), idx.numpy().astype(np.int64))
    rows = rows.astype(f32)
    qf = q.float().numpy()
    logits = np.matmul(qf, np.swapaxes(rows, -1, -2)) * f32(scale)  # [B,S,H,K]
    logits = np.where(valid[:, :, None, :], logits, f32(-np.inf)).astype(f32)
    bsz, seqlen, n_heads, dim = qf.shape
    m = np.full((bsz, seqlen, n_heads), -1e30, dtype=f32)
    den = np.zeros((bsz, seqlen, n_heads), dtype=f32)
    acc = np.zeros((bsz, seqlen, n_heads, dim), dtype=f32)
    for j0 in range(0, logits.shape[-1], block):
        s = logits[..., j0:j0 + block]
        m_new = np.maximum(m, s.max(axis=-1))
        alpha = np.exp(m - m_new)
        p = np.exp(s - m_new[..., None])
        den = den * alpha + p.sum(axis=-1, dtype=f32)
        p16 = p.astype(ml_dtypes.bfloat16).astype(f32)
        acc = acc * alpha[..., None] + np.matmul(p16, rows[:, :, j0:j0 + block])
        m = m_new
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # rows with no valid slot
        total = den + np.exp(sink.numpy() - m)
        out = np.where((den > 0)[..., None], acc / total[..., None], f32(0))
    return out.astype(ml_dtypes.bfloat16).astype(f32)


# --------------------------------------------------------------------------------- indexer logits

def mqa_logits_bf16_oracle(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> np.ndarray:
    """V4.1 Indexer.forward rounding points in float64: bf16(dot) per (s,h,t), relu, bf16(x * w),
    sum over h, one bf16 rounding. Returns float64 [B,S,T] holding bf16 values."""
    dots = bf16_rne(np.einsum("bshd,btd->bsht", f64(q), f64(k)))
    prod = bf16_rne(np.maximum(dots, 0.0) * f64(w)[..., None])
    return bf16_rne(prod.sum(axis=2))


def mqa_scores(qd: np.ndarray, kd: np.ndarray, w: np.ndarray) -> np.ndarray:
    """sum_h relu(q[s,h] . k[t]) * w[s,h] in float64: qd [S,H,D], kd [T,D], w [S,H] -> [S,T]."""
    return (np.maximum(np.einsum("shd,td->sht", qd, kd), 0.0) * w[..., None]).sum(axis=1)


def mqa_logits_oracle(q, q_sf, kv, kv_sf, weights, ks, ke, max_seqlen_k: int) -> np.ndarray:
    """Dense indexer logits, float64 [S, max_seqlen_k]: column j of row s is key ks[s]+j, -inf
    where that key is not below ke[s] (seed module docstring; DeepGEMM ref_mqa_logits)."""
    scores = mqa_scores(dequantize(q, q_sf), dequantize(kv, kv_sf), f64(weights))
    out = np.full((scores.shape[0], max_seqlen_k), -np.inf)
    for s in range(scores.shape[0]):
        lo, hi = int(ks[s]), int(ke[s])
        n = min(hi - lo, max_seqlen_k)
        out[s, :n] = scores[s, lo:lo + n]
    return out


def mqa_logits_sparse_oracle(q, q_sf, kv, kv_sf, weights, ks, ke, block_idx, block_size: int) -> np.ndarray:
    """Sparse indexer logits, float64 [S, NB*B]: column b*B+o of row s is key
    block_idx[s,b]*B + ks[s]%B + o; -inf for a negative block or a key outside [ks[s], ke[s])."""
    scores = mqa_scores(dequantize(q, q_sf), dequantize(kv, kv_sf), f64(weights))
    blocks = block_idx.numpy().astype(np.int64)
    out = np.full((blocks.shape[0], blocks.shape[1] * block_size), -np.inf)
    for s in range(blocks.shape[0]):
        lo, hi = int(ks[s]), int(ke[s])
        for b, blk in enumerate(blocks[s]):
            if blk < 0:
                continue
            for o in range(block_size):
                t = blk * block_size + lo % block_size + o
                if lo <= t < hi:
                    out[s, b * block_size + o] = scores[s, t]
    return out


# ------------------------------------------------------------------------------------ comparators

def cos_diff(a: np.ndarray, r: np.ndarray) -> float:
    """1 - 2*sum(a*r) / sum(a^2 + r^2) in float64 (FlashMLA compare.py; DeepGEMM calc_diff)."""
    denom = float((a * a + r * r).sum())
    return 0.0 if denom == 0.0 else 1.0 - 2.0 * float((a * r).sum()) / denom


def _split_specials(actual: torch.Tensor, ref: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    a = f64(actual)
    r = np.asarray(ref, dtype=np.float64)
    assert a.shape == r.shape, f"{what}: shape {a.shape} vs reference {r.shape}"
    for name, test in (("+inf", np.isposinf), ("-inf", np.isneginf), ("nan", np.isnan)):
        mismatch = test(a) != test(r)
        assert not mismatch.any(), (
            f"{what}: {name} positions differ at {int(mismatch.sum())} elements, "
            f"first {np.argwhere(mismatch)[0].tolist()}"
        )
    special = ~np.isfinite(r)
    return np.where(special, 0.0, a), np.where(special, 0.0, r)


def assert_close(actual: torch.Tensor, ref: np.ndarray, *, abs_tol: float, rel_tol: float, cos_tol: float,
                 what: str = "") -> None:
    """FlashMLA check_is_allclose: same inf/NaN positions; each element within abs_tol OR
    |a-r|/(|r|+1e-6) < rel_tol; cosine diff < cos_tol. Reports the worst element on failure."""
    a, r = _split_specials(actual, ref, what)
    err = np.abs(a - r)
    rel = err / (np.abs(r) + 1e-6)
    bad = ~((err < abs_tol) | (rel < rel_tol))
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, err, -1.0)), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.size} elements out of tolerance (pass rate "
            f"{1 - bad.mean():.6f}); worst at {list(worst)}: actual {a[worst]!r} ref {r[worst]!r} "
            f"abs {err[worst]:.3e} rel {rel[worst]:.3e}"
        )
    cd = cos_diff(a, r)
    assert cd < cos_tol, f"{what}: cosine diff {cd:.3e} >= {cos_tol:.1e}"


def assert_calc_diff(actual: torch.Tensor, ref: np.ndarray, max_diff: float, what: str = "") -> None:
    """DeepGEMM check: -inf (and any inf/NaN) positions equal, then calc_diff < max_diff."""
    a, r = _split_specials(actual, ref, what)
    cd = cos_diff(a, r)
    assert cd < max_diff, f"{what}: calc_diff {cd:.3e} >= {max_diff:.1e}"
