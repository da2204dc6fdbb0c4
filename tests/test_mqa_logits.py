"""dsneuron::mqa_logits_bf16 / mqa_logits / mqa_logits_sparse against float64 oracles, with the
docs/numerics.md "Kernel tests: edge cases and tolerances" edge cases B1-B4 and B7-B10 (B4's compressed columns are this op's dense
layout). Not here: B5-B6 (paged cache, next_n rules: tests/test_mqa_logits_paged.py), B11 (the sm100
bf16 reduce is not a dsneuron op), B12 (Hadamard, V3.2/V4 only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import dsneuron.kernels_nki  # noqa: F401  (registers torch.ops.dsneuron)
from dsneuron.kernels_nki.mqa_logits_ref import mqa_logits_bf16_ref, mqa_logits_ref, mqa_logits_sparse_ref
from oracles import (
    E2M1_MAGNITUDES,
    assert_calc_diff,
    bf16_rne,
    ceil_ue8m0_byte,
    dequantize,
    e2m1_code,
    mqa_logits_bf16_oracle,
    mqa_logits_oracle,
    mqa_logits_sparse_oracle,
    pack_nibbles,
    quantize_fp4,
    quantize_fp8,
    ulp_distance_bf16,
)

INT_MIN, INT_MAX = -(2**31), 2**31 - 1

# DeepGEMM kernel vs the simulated reference on dequantised operands, bf16 logits (docs/numerics.md "Kernel tests: edge cases and tolerances").
SIM_DIFF_BF16 = 3e-5


def bf16_ref(ref: np.ndarray) -> np.ndarray:
    """Round the finite entries of a float64 reference to bf16, keeping -inf."""
    finite = np.isfinite(ref)
    return np.where(finite, bf16_rne(np.where(finite, ref, 0.0)), ref)


# ------------------------------------------------------------------------------- bf16 (model) form

def _model_expression(q, index_k, weights):
    """deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py Indexer.forward, the two score lines."""
    index_score = torch.einsum("bshd,btd->bsht", q, index_k)
    return (index_score.relu_() * weights.unsqueeze(-1)).sum(dim=2)


def _bf16_inputs(seed: int, shape: tuple[int, int, int, int, int] | None = None, qdq: bool = True):
    """Random shapes (or `shape` = (B, S, H, D, T)); q and k FP4 quantize-dequantized as the model
    does (or plain randn when not `qdq`), k a slice of a cache buffer, weights a bf16 projection
    times the model's python-float scale."""
    rng = np.random.default_rng(seed)
    b, s, h = int(rng.integers(1, 3)), int(rng.integers(1, 40)), int(rng.choice([1, 2, 4, 32]))
    d, t = int(rng.choice([64, 128])), int(rng.integers(1, 120))
    if shape is not None:
        b, s, h, d, t = shape
    x, y = rng.standard_normal((b, s, h, d)), rng.standard_normal((b + 1, t + 7, d))
    if qdq:
        x, y = dequantize(*quantize_fp4(x)), dequantize(*quantize_fp4(y))
    q, cache = torch.from_numpy(x).bfloat16(), torch.from_numpy(y).bfloat16()
    w = torch.from_numpy(rng.standard_normal((b, s, h))).bfloat16() * (d ** -0.5 * h ** -0.5)
    return q, cache[:b, :t], w


@pytest.mark.parametrize("seed, shape", [(seed, None) for seed in range(8)] + [(8, (1, 715, 4, 128, 357))])
def test_bf16_form_is_bitwise_the_model_expression_on_fp4_values(seed, shape):
    """Random shapes and the tiny prefill shape, FP4-QDQ'd as the model feeds them: every fp32 sum
    of the model's bf16 einsum is exact there, so it and the exact form agree bit for bit."""
    q, k, w = _bf16_inputs(seed, shape)
    out = torch.ops.dsneuron.mqa_logits_bf16(q, k, w)
    assert out.dtype == torch.bfloat16 and out.shape == (q.shape[0], q.shape[1], k.shape[1])
    assert torch.equal(out, _model_expression(q.clone(), k, w))


def test_bf16_form_rounds_the_exact_dot_on_plain_values():
    """On plain bf16 values (the tiny prefill shape) an fp32 accumulation rounds, in an order the
    host's bf16 GEMM kernel picks (torch's bf16 matmul and an fp32 matmul rounded to bf16 disagree
    on ~60 of the 1M dots here): the op instead rounds the exact dot to fp32 and then to bf16,
    the same on every host."""
    q, k, w = _bf16_inputs(8, (1, 715, 4, 128, 357), qdq=False)
    out = torch.ops.dsneuron.mqa_logits_bf16(q, k, w)
    dots = np.einsum("bshd,btd->bsht", q.double().numpy(), k.double().numpy())
    dots = torch.from_numpy(dots.astype(np.float32)).bfloat16()  # exact -> fp32 -> bf16
    assert torch.equal(out, (dots.relu() * w.unsqueeze(-1)).sum(dim=2))


@pytest.mark.parametrize("seed", range(4))
def test_bf16_form_rounding_points_match_float64_oracle(seed):
    """bf16(dot), relu, bf16(x*w), fp32 head sum, bf16: the oracle rounds the same places from exact
    float64 values. Only an fp32 accumulation that lands on the other side of a bf16 rounding
    boundary can differ, so nearly every element is equal; implementations that skip a rounding
    point agree on only ~75-85% (measured while writing this test)."""
    q, k, w = _bf16_inputs(100 + seed)
    out = torch.ops.dsneuron.mqa_logits_bf16(q, k, w)
    ref = mqa_logits_bf16_oracle(q, k, w)
    assert (ulp_distance_bf16(out, ref) == 0).mean() >= 0.999
    assert_calc_diff(out, ref, SIM_DIFF_BF16, "bf16 form")


def test_bf16_form_twenty_reruns_and_bad_inputs():
    q, k, w = _bf16_inputs(7)
    first = torch.ops.dsneuron.mqa_logits_bf16(q, k, w)
    for _ in range(19):
        assert torch.equal(torch.ops.dsneuron.mqa_logits_bf16(q, k, w), first)
    for args, match in (((q.float(), k, w), "q must be bf16"), ((q, k[..., :32], w), "k must be bf16"),
                        ((q, k, w.float()), "w must be bf16"), ((q, k, w[:, :1]), "w must be bf16"),
                        ((q[0], k, w), "q must be bf16")):
        with pytest.raises(ValueError, match=match):
            torch.ops.dsneuron.mqa_logits_bf16(*args)


# ------------------------------------------------------------------------------ FP8 / FP4 operands

@dataclass(frozen=True)
class MqaCase:
    """q [s,h,d], kv [t,d]; `ranges` picks the per-row [ks, ke) pattern."""
    id: str
    fmt: str  # "fp8" | "fp4"
    s: int
    h: int
    d: int
    t: int
    ranges: str  # full | causal | disable_cp | cp | random
    weights: str = "positive"  # positive | mixed | bf16
    extra_cols: int = 0  # max_seqlen_k = max(ke - ks) + extra_cols (negative truncates)
    seed: int = 0


def make_ranges(kind: str, s: int, t: int, rng) -> tuple[torch.Tensor, torch.Tensor]:
    i = np.arange(s)
    if kind == "full":
        ks, ke = np.zeros(s), np.full(s, t)
    elif kind == "causal":  # diagonal included; the last row ends exactly at T
        ks, ke = np.zeros(s), i + 1 + (t - s)
    elif kind == "disable_cp":  # DeepGEMM tests: ke = i + (T - S), so row 0 is empty when S == T
        ks, ke = np.zeros(s), i + (t - s)
    elif kind == "cp":  # two context-parallel chunks with their own starts and unequal lengths
        half = s // 2
        ks = np.where(i < half, 0, t // 3)
        first = (i + 1) * (t // 3) // max(half, 1)
        second = t // 3 + (i - half) * (t - t // 3) // max(s - half - 1, 1)
        ke = np.where(i < half, first, second)
        ke[-1] = t
    elif kind == "random":
        ks = rng.integers(0, t, s)
        ke = ks + rng.integers(0, t - ks + 1)
        ke[0] = ks[0]  # one empty row
    else:
        raise ValueError(kind)
    ks, ke = np.minimum(ks, ke), np.clip(ke, 0, t)
    return torch.from_numpy(ks.astype(np.int32)), torch.from_numpy(ke.astype(np.int32))


def make_mqa_inputs(c: MqaCase):
    rng = np.random.default_rng(500 + c.seed)
    quant = quantize_fp8 if c.fmt == "fp8" else quantize_fp4
    q, q_sf = quant(rng.standard_normal((c.s, c.h, c.d)))
    kv, kv_sf = quant(rng.standard_normal((c.t, c.d)))
    if c.weights == "mixed":
        w = torch.from_numpy(rng.standard_normal((c.s, c.h))).float()
    else:
        w = torch.from_numpy(rng.random((c.s, c.h)) + 0.01).float()
    if c.weights == "bf16":
        w = w.bfloat16()
    ks, ke = make_ranges(c.ranges, c.s, c.t, rng)
    return q, q_sf, kv, kv_sf, w, ks, ke


DENSE_CASES = [
    MqaCase("fp8-full", "fp8", 24, 4, 128, 100, "full"),
    MqaCase("fp4-full", "fp4", 24, 4, 128, 100, "full", seed=1),
    MqaCase("fp8-causal-t257", "fp8", 40, 8, 128, 257, "causal", seed=2),
    MqaCase("fp4-causal-t63-d64", "fp4", 30, 8, 64, 63, "causal", seed=3),
    MqaCase("fp8-disable-cp-empty-row0", "fp8", 33, 4, 64, 33, "disable_cp", seed=4),
    MqaCase("fp4-cp-ranges", "fp4", 20, 32, 128, 150, "cp", seed=5),
    MqaCase("fp8-random-mixed-w", "fp8", 32, 4, 128, 90, "random", weights="mixed", seed=6),
    MqaCase("fp4-random-bf16-w", "fp4", 32, 16, 64, 301, "random", weights="bf16", seed=7),
    MqaCase("fp8-extra-cols", "fp8", 16, 4, 128, 70, "cp", extra_cols=9, seed=8),
    MqaCase("fp4-truncated-cols", "fp4", 16, 4, 128, 70, "random", extra_cols=-20, seed=9),
    MqaCase("fp4-h1", "fp4", 10, 1, 32, 1021, "causal", seed=10),
]


def _max_cols(c: MqaCase, ks, ke) -> int:
    return max(0, int((ke - ks).max()) + c.extra_cols)


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: c.id)
def test_dense_matches_float64_oracle(case: MqaCase):
    """B1-B4, B9, B10: -inf exactly outside each row's range; calc_diff < 3e-5 (B.6); and with
    positive weights (no cancellation) within one bf16 step of bf16(float64 score): the op's fp32
    sums may fall on the other side of one bf16 rounding boundary, nothing more."""
    args = make_mqa_inputs(case)
    cols = _max_cols(case, args[5], args[6])
    out = torch.ops.dsneuron.mqa_logits(*args, cols)
    ref = mqa_logits_oracle(*args, cols)
    assert out.dtype == torch.bfloat16 and out.shape == (case.s, cols) and out.stride(0) % 256 == 0
    assert_calc_diff(out, ref, SIM_DIFF_BF16, case.id)
    if case.weights != "mixed":
        assert ulp_distance_bf16(out, bf16_ref(ref)).max() <= 1


def make_blocks(ks, ke, t: int, nb: int, bs: int, rng) -> torch.Tensor:
    """Per row: some blocks reaching into [ks, ke) (sorted), duplicates, -1 padding, other negatives
    and blocks past the end of kv."""
    rows = []
    for lo, hi in zip(ks.tolist(), ke.tolist()):
        first, last = lo // bs, max(lo // bs, (hi - 1 - lo % bs) // bs)
        reach = rng.permutation(np.arange(first, last + 1))[: nb // 2]
        junk = rng.choice([-1, -1, -7, INT_MIN, t // bs + 3, 10**6, INT_MAX // bs], size=nb)
        row = np.concatenate([np.sort(reach), reach[:1], junk])[:nb]
        rows.append(np.where(rng.random(nb) < 0.1, -1, row))
    return torch.from_numpy(np.stack(rows).astype(np.int32))


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("case", [DENSE_CASES[3], DENSE_CASES[5], DENSE_CASES[6], DENSE_CASES[7]], ids=lambda c: c.id)
def test_sparse_matches_float64_oracle_and_dense(case: MqaCase, block_size: int):
    """Candidate-block path: column b*B+o is key block_idx*B + ks%B + o; -inf for empty blocks
    (-1 and other negatives), blocks past kv, and keys outside the row's range."""
    args = make_mqa_inputs(case)
    ks, ke = args[5], args[6]
    blocks = make_blocks(ks, ke, case.t, 12, block_size, np.random.default_rng(case.seed))
    out = torch.ops.dsneuron.mqa_logits_sparse(*args, blocks, block_size)
    ref = mqa_logits_sparse_oracle(*args, blocks, block_size)
    assert out.shape == (case.s, 12 * block_size) and out.stride(0) % 256 == 0
    assert np.isfinite(ref).any() and np.isneginf(ref).any()
    assert_calc_diff(out, ref, SIM_DIFF_BF16, case.id)
    if case.weights != "mixed":
        assert ulp_distance_bf16(out, bf16_ref(ref)).max() <= 1
    # the same key gives the same bits through the dense op (full-width, ks-relative columns)
    dense = torch.ops.dsneuron.mqa_logits(*args, case.t).float()
    for s in range(case.s):
        for col in np.flatnonzero(np.isfinite(ref[s])):
            key = int(blocks[s, col // block_size]) * block_size + int(ks[s]) % block_size + col % block_size
            assert out[s, col].float() == dense[s, key - int(ks[s])]


def test_empty_rows_and_zero_columns():
    """B1: ks == ke gives a row of -inf, including ks == ke == 0 and ks == ke == T; zero columns work."""
    q, q_sf, kv, kv_sf, w, ks, ke = make_mqa_inputs(MqaCase("b1", "fp8", 4, 4, 64, 20, "full"))
    ks = torch.tensor([0, 20, 5, 0], dtype=torch.int32)
    ke = torch.tensor([0, 20, 5, 20], dtype=torch.int32)
    out = torch.ops.dsneuron.mqa_logits(q, q_sf, kv, kv_sf, w, ks, ke, 20)
    assert torch.isneginf(out[:3]).all() and torch.isfinite(out[3]).all()
    assert torch.ops.dsneuron.mqa_logits(q, q_sf, kv, kv_sf, w, ks, ke, 0).shape == (4, 0)


def test_all_negative_dots_give_zero_and_mixed_weights_negative():
    """B10: when every q.k < 0 the relu leaves 0 for every head (compare by value, -0 allowed);
    with mixed-sign weights and positive dots, logits can be negative."""
    rng = np.random.default_rng(3)
    q, q_sf = quantize_fp8(np.abs(rng.standard_normal((6, 4, 64))) + 0.1)
    kv, kv_sf = quantize_fp8(-np.abs(rng.standard_normal((9, 64))) - 0.1)
    w = torch.from_numpy(rng.standard_normal((6, 4))).float()
    ks, ke = torch.zeros(6, dtype=torch.int32), torch.full((6,), 9, dtype=torch.int32)
    assert (torch.ops.dsneuron.mqa_logits(q, q_sf, kv, kv_sf, w, ks, ke, 9) == 0).all()
    kv_pos, kv_pos_sf = quantize_fp8(np.abs(rng.standard_normal((9, 64))) + 0.1)
    out = torch.ops.dsneuron.mqa_logits(q, q_sf, kv_pos, kv_pos_sf, w, ks, ke, 9)
    ref = mqa_logits_oracle(q, q_sf, kv_pos, kv_pos_sf, w, ks, ke, 9)
    assert (ref < 0).any() and (out < 0).any()
    assert_calc_diff(out, ref, SIM_DIFF_BF16, "mixed weights")


# ------------------------------------------------------------------------------ number-format edges

def _one_hot_fp8(d: int = 32):
    """q [1,1,d] and kv [1,d] in e4m3, each 1.0 at element 0 and 0 elsewhere."""
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    kv = torch.zeros(1, d)
    kv[0, 0] = 1.0
    return q.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn)


@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e8m0fnu])
@pytest.mark.parametrize("q_byte, kv_byte",
                         [(127, 127), (254, 0), (0, 254), (1, 253), (200, 100), (126, 128), (150, 60)])
def test_ue8m0_scale_bytes_decode_exactly(q_byte, kv_byte, scale_dtype):
    """B7 on the decode side: 1.0 * 2^(qb-127) times 1.0 * 2^(kb-127), hand-computed, including the
    extreme bytes 0 (2^-127, an fp32 subnormal), 1, 253 and 254."""
    q, kv = _one_hot_fp8()
    q_sf = torch.tensor([[[q_byte]]], dtype=torch.uint8)
    kv_sf = torch.tensor([[kv_byte]], dtype=torch.uint8)
    if scale_dtype != torch.uint8:
        q_sf, kv_sf = q_sf.view(scale_dtype), kv_sf.view(scale_dtype)
    one = torch.ones(1, dtype=torch.int32)
    out = torch.ops.dsneuron.mqa_logits(q, q_sf, kv, kv_sf, torch.ones(1, 1), one - 1, one, 1)
    assert out.item() == 2.0 ** (q_byte + kv_byte - 254)


def test_ue8m0_byte_255_is_nan_not_a_number():
    """Byte 255 is e8m0's NaN: the logits that use it are NaN (no data-dependent check, as in
    formats.ue8m0_to_float); positions outside the range stay -inf."""
    q, kv = _one_hot_fp8()
    q, q_sf = q.expand(2, 1, 32).contiguous(), torch.tensor([[[255]], [[127]]], dtype=torch.uint8)
    out = torch.ops.dsneuron.mqa_logits(q, q_sf, kv, torch.full((1, 1), 127, dtype=torch.uint8), torch.ones(2, 1),
                                        torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 2)
    assert out[0, 0].isnan() and out[1, 0] == 1.0 and torch.isneginf(out[:, 1]).all()


def test_ue8m0_quantizer_boundaries_feed_the_op():
    """B7 on the quantizer side (the test-input quantizer): amax/448 exactly a power of two keeps its
    exponent, one fp32 ulp above bumps it, amax = 0 clamps to 1e-4 (byte 105 = ceil(log2(1e-4/448)) + 127).
    Groups built that way then go through the op and match the oracle."""
    exact = np.float32(448.0 * 2.0 ** -3)
    above = np.nextafter(exact, np.float32(np.inf))
    assert ceil_ue8m0_byte(np.array([exact / np.float32(448)])).tolist() == [124]
    assert ceil_ue8m0_byte(np.array([above / np.float32(448)])).tolist() == [125]
    assert ceil_ue8m0_byte(np.array([6.0 * 2.0 ** 5]) / 6.0).tolist() == [132]
    rng = np.random.default_rng(4)
    x = rng.uniform(-1, 1, (8, 2, 64)) * 0.01
    x[:, :, 0], x[:, :, 32] = float(exact), float(above)  # group 0 exact, group 1 just above
    x[1] = 0.0  # all-zero groups
    q, q_sf = quantize_fp8(x)
    assert q_sf[0, 0].tolist() == [124, 125] and q_sf[1, 0].tolist() == [105, 105]
    assert float(q[0, 0, 0].float()) == 448.0 and float(q[0, 0, 32].float()) < 448.0
    kv, kv_sf = quantize_fp8(rng.standard_normal((40, 64)))
    w = torch.ones(8, 2)
    ks, ke = torch.zeros(8, dtype=torch.int32), torch.full((8,), 40, dtype=torch.int32)
    out = torch.ops.dsneuron.mqa_logits(q, q_sf, kv, kv_sf, w, ks, ke, 40)
    ref = mqa_logits_oracle(q, q_sf, kv, kv_sf, w, ks, ke, 40)
    assert (out[1] == 0).all() and ulp_distance_bf16(out, bf16_ref(ref)).max() <= 1


def test_fp4_tie_rules_and_saturation():
    """B8 for the input quantizer: DeepGEMM rounds ties toward zero, V4.1 fp4_act_quant to the even
    code; |v| > 6 saturates; -0 encodes as 0x0 (hand-made tables)."""
    v = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.0, -0.75, -3.5, -0.1])
    assert e2m1_code(v, "to_zero").tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7, 0, 9, 13, 0]
    assert e2m1_code(v, "even").tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 0, 10, 14, 0]


@pytest.mark.parametrize("ties", ["to_zero", "even"])
def test_fp4_tie_inputs_through_the_op(ties):
    """B8 through the op: groups made of tie values (times a power of two) quantized by each rule."""
    rng = np.random.default_rng(5)
    tie_values = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x = rng.choice(tie_values, (12, 4, 64)) * rng.choice([-1.0, 1.0], (12, 4, 64)) * 2.0 ** -3
    q, q_sf = quantize_fp4(x, ties=ties)
    kv, kv_sf = quantize_fp4(rng.choice(tie_values, (30, 64)) * rng.choice([-1.0, 1.0], (30, 64)), ties=ties)
    w = torch.from_numpy(rng.random((12, 4))).bfloat16()
    ks, ke = make_ranges("causal", 12, 30, rng)
    out = torch.ops.dsneuron.mqa_logits(q, q_sf, kv, kv_sf, w, ks, ke, 30)
    ref = mqa_logits_oracle(q, q_sf, kv, kv_sf, w, ks, ke, 30)
    assert ulp_distance_bf16(out, bf16_ref(ref)).max() <= 1


def test_fp4_code_table_nibble_order_and_negative_zero():
    """B9 by hand: row s holds e2m1 code s in element 0 (the LOW nibble of byte 0) and code 7 in
    element 1; key 0 is +1 at element 0 only, key 1 is -1 at element 0 only. So logit(s, 0) =
    relu(value(s)) and logit(s, 1) = relu(-value(s)); a swapped nibble order would give 6 or 0."""
    codes = np.zeros((16, 1, 32), dtype=np.int64)
    codes[:, 0, 0], codes[:, 0, 1] = np.arange(16), 7
    q = pack_nibbles(codes)
    kv_codes = np.zeros((2, 32), dtype=np.int64)
    kv_codes[0, 0], kv_codes[1, 0] = 2, 10  # +1.0 and -1.0
    kv = pack_nibbles(kv_codes)
    q_sf = torch.full((16, 1, 1), 127, dtype=torch.uint8)
    kv_sf = torch.full((2, 1), 127, dtype=torch.uint8)
    ks, ke = torch.zeros(16, dtype=torch.int32), torch.full((16,), 2, dtype=torch.int32)
    out = torch.ops.dsneuron.mqa_logits(q, q_sf, kv, kv_sf, torch.ones(16, 1), ks, ke, 2).float()
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    signed = np.array(table + [-x for x in table])
    assert out[:, 0].tolist() == np.maximum(signed, 0).tolist()
    assert out[:, 1].tolist() == np.maximum(-signed, 0).tolist()
    assert out[8].tolist() == [0.0, 0.0]  # code 8 is -0
    assert E2M1_MAGNITUDES.tolist() == table


# ----------------------------------------------------------------------- determinism, errors, export

def test_twenty_reruns_bitwise_identical():
    case = DENSE_CASES[3]
    args = make_mqa_inputs(case)
    blocks = make_blocks(args[5], args[6], case.t, 8, 16, np.random.default_rng(0))
    dense0 = torch.ops.dsneuron.mqa_logits(*args, 64)
    sparse0 = torch.ops.dsneuron.mqa_logits_sparse(*args, blocks, 16)
    for _ in range(19):
        assert torch.equal(torch.ops.dsneuron.mqa_logits(*args, 64), dense0)
        assert torch.equal(torch.ops.dsneuron.mqa_logits_sparse(*args, blocks, 16), sparse0)


def _small_args():
    c = MqaCase("small", "fp8", 3, 2, 64, 10, "full")
    return list(make_mqa_inputs(c)) + [10]


def _fp4_kv(a):
    a[2], a[3] = quantize_fp4(np.ones((10, 64)))
    return a


def _set(i, value):
    def mutate(a):
        a[i] = value(a) if callable(value) else value
        return a
    return mutate


BAD_DENSE = [
    (_set(0, lambda a: a[0].float()), "q: expected float8_e4m3fn or packed"),
    (_set(0, lambda a: a[0][0]), "q must be"),
    (_set(2, lambda a: a[2][None]), "kv must be"),
    (_fp4_kv, "must use the same format"),
    (_set(2, lambda a: a[2][:, :32]), "kv last dim must equal"),
    (lambda a: [a[0][..., :48], a[1][..., :1], a[2][:, :48], a[3][:, :1], *a[4:]], "multiple of 32"),
    (_set(1, lambda a: a[1][..., :1]), "q_sf must be UE8M0"),
    (_set(1, lambda a: a[1].float()), "q_sf must be UE8M0"),
    (_set(3, lambda a: a[3][:5]), "kv_sf must be UE8M0"),
    (_set(4, lambda a: a[4].half()), "weights must be fp32 or bf16"),
    (_set(4, lambda a: a[4][:, :1]), "weights must be fp32 or bf16"),
    (_set(5, lambda a: a[5].long()), "ks must be int32"),
    (_set(6, lambda a: a[6][:2]), "ke must be int32"),
    (lambda a: [*a[:5], torch.tensor([0, 4, 0], dtype=torch.int32), torch.tensor([10, 3, 10], dtype=torch.int32),
                a[7]], "row 1 has the key range"),
    (_set(6, lambda a: torch.tensor([10, 11, 10], dtype=torch.int32)), "ke <= T=10"),
    (_set(5, lambda a: torch.tensor([0, 0, -1], dtype=torch.int32)), "row 2 has the key range"),
    (_set(7, -1), "max_seqlen_k must be >= 0"),
]


@pytest.mark.parametrize("mutate, match", BAD_DENSE)
def test_dense_bad_inputs_raise_value_error(mutate, match):
    args = mutate(_small_args())
    with pytest.raises(ValueError, match=match):
        torch.ops.dsneuron.mqa_logits(*args)


@pytest.mark.parametrize("blocks, block_size, match", [
    (torch.zeros(3, 2, dtype=torch.int32), 12, "block_size must be one of"),
    (torch.zeros(3, 2, dtype=torch.int64), 8, "block_idx must be int32"),
    (torch.zeros(2, 2, dtype=torch.int32), 8, "block_idx must be int32"),
])
def test_sparse_bad_inputs_raise_value_error(blocks, block_size, match):
    args = _small_args()[:-1]
    with pytest.raises(ValueError, match=match):
        torch.ops.dsneuron.mqa_logits_sparse(*args, blocks, block_size)


class _Indexer(torch.nn.Module):
    def forward(self, q, q_sf, kv, kv_sf, w, ks, ke, blocks, qb, kb, wb):
        dense = torch.ops.dsneuron.mqa_logits(q, q_sf, kv, kv_sf, w, ks, ke, 10)
        sparse = torch.ops.dsneuron.mqa_logits_sparse(q, q_sf, kv, kv_sf, w, ks, ke, blocks, 8)
        bf16 = torch.ops.dsneuron.mqa_logits_bf16(qb, kb, wb)
        return dense.float().sum(-1), sparse.float().amax(-1), bf16 + 1


def test_export_keeps_one_node_per_op_and_fake_matches():
    args = _small_args()[:-1]
    blocks = torch.tensor([[0, -1], [1, 0], [-1, -1]], dtype=torch.int32)
    qb, kb, wb = _bf16_inputs(3)
    inputs = (*args, blocks, qb, kb, wb)
    ep = torch.export.export(_Indexer(), inputs)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    for op in (torch.ops.dsneuron.mqa_logits, torch.ops.dsneuron.mqa_logits_sparse, torch.ops.dsneuron.mqa_logits_bf16):
        assert targets.count(op.default) == 1, op
    for got, want in zip(ep.module()(*inputs), _Indexer()(*inputs)):
        assert torch.equal(got, want)
    # opcheck's schema test compares inputs with allclose, which has no fp8 kernel: use FP4 operands
    fp4_args = _fp4_kv(list(args))
    fp4_args[0], fp4_args[1] = quantize_fp4(np.ones((3, 2, 64)))
    torch.library.opcheck(torch.ops.dsneuron.mqa_logits.default, (*fp4_args, 10))
    torch.library.opcheck(torch.ops.dsneuron.mqa_logits_sparse.default, (*fp4_args, blocks, 8))
    torch.library.opcheck(torch.ops.dsneuron.mqa_logits_bf16.default, (qb, kb, wb))


def test_references_trace_for_inlining():
    """The cpu lowering may inline each reference (run_decompositions): they must trace (the range
    check is skipped while tracing) and the traced aten graph must give the same bits."""
    case = DENSE_CASES[5]
    args = make_mqa_inputs(case)
    blocks = make_blocks(args[5], args[6], case.t, 4, 8, np.random.default_rng(1))
    qb, kb, wb = _bf16_inputs(5)
    inputs = (*args, blocks, qb, kb, wb)

    class Module(torch.nn.Module):
        def forward(self, q, q_sf, kv, kv_sf, w, ks, ke, blocks, qb, kb, wb):
            return (torch.ops.dsneuron.mqa_logits(q, q_sf, kv, kv_sf, w, ks, ke, case.t),
                    torch.ops.dsneuron.mqa_logits_sparse(q, q_sf, kv, kv_sf, w, ks, ke, blocks, 8),
                    torch.ops.dsneuron.mqa_logits_bf16(qb, kb, wb))

    table = {torch.ops.dsneuron.mqa_logits.default: mqa_logits_ref,
             torch.ops.dsneuron.mqa_logits_sparse.default: mqa_logits_sparse_ref,
             torch.ops.dsneuron.mqa_logits_bf16.default: mqa_logits_bf16_ref}
    inlined = torch.export.export(Module(), inputs).run_decompositions(table)
    targets = {n.target for n in inlined.graph.nodes if n.op == "call_function"}
    assert not targets & set(table)
    for got, want in zip(inlined.module()(*inputs), Module()(*inputs)):
        assert torch.equal(got, want)
