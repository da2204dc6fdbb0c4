"""Tests of graphs/quant.py: FP8 e4m3fn, FP4 e2m1, UE8M0 quantizers, weight codecs, block-scaled GEMM.

Expected values come from two independent sources. Hand-computed tables cover the edge cases of
docs/numerics.md "Kernel tests: edge cases and tolerances" (B.7, B.8) and issue 2: ties, saturation, -0, UE8M0 at and one
ulp above a power of two, amax = 0, subnormals. Oracles built from numpy, math.frexp and
ml_dtypes (RNE casts) check the rest. Every hand value carries its derivation in a comment.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dsneuron.graphs.quant import (
    act_quant,
    act_quant_qdq,
    block_scaled_matmul,
    dequant_fp4_weight,
    dequant_fp8_weight,
    e4m3_rne,
    fp4_act_quant_qdq,
    fp4_quantize,
    experts_linear,
    fp4_quantize_rtz,
    fp8_linear,
    quantize_fp4_weight,
    quantize_fp8_weight,
    ue8m0_scale,
)
from dsneuron.kernels_nki.formats import (e4m3_round, e4m3_to_bytes, e4m3_to_float, neuron_spelling, pack_fp4, pow2,
                                          ue8m0_to_float, unpack_fp4)

FAST = settings(max_examples=60, deadline=None, derandomize=True)
INF = float("inf")
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn


def f32(v: float) -> float:
    """The fp32 value nearest to v, as a Python float."""
    return float(np.float32(v))


def up(v: float) -> float:
    """The next fp32 value above v."""
    return float(np.nextafter(np.float32(v), np.float32(INF)))


def down(v: float) -> float:
    """The next fp32 value below v."""
    return float(np.nextafter(np.float32(v), np.float32(-INF)))


def assert_bits(actual: torch.Tensor, expected) -> None:
    """Bit-exact fp32 comparison, so -0.0 differs from 0.0 (NaNs are not compared here)."""
    a = actual.detach().float().numpy()
    e = np.asarray(expected, dtype=np.float32).reshape(a.shape)
    bad = a.view(np.uint32) != e.view(np.uint32)
    assert not bad.any(), f"at {np.argwhere(bad)[:8].tolist()}: got {a[bad][:8]}, expected {e[bad][:8]}"


# ---------------------------------------------------------------------------------------------
# independent oracles: numpy float32 arithmetic, math.frexp and ml_dtypes casts

def pow2_ceil_oracle(r: float) -> float:
    """2^ceil(log2 r) for a positive normal r, exact (math.frexp is exact on floats)."""
    m, e = math.frexp(r)  # r = m * 2^e with m in [0.5, 1)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


def act_quant_oracle(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [M, K] -> (e4m3 uint8 bit patterns [M, K], scales float32 [M, K/block]), plain loops."""
    m, k = x.shape
    codes = np.zeros((m, k), np.uint8)
    scales = np.zeros((m, k // block), np.float32)
    for i in range(m):
        for j in range(k // block):
            blk = x[i, j * block:(j + 1) * block]
            amax = max(np.float32(np.abs(blk).max()), np.float32(1e-4))
            s = np.float32(pow2_ceil_oracle(float(np.float32(amax) * np.float32(1 / 448))))
            codes[i, j * block:(j + 1) * block] = np.clip(blk / s, -448, 448).astype(E4M3).view(np.uint8)
            scales[i, j] = s
    return codes, scales


def fp4_oracle(x: np.ndarray, block: int, scale_fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [M, K] -> (e2m1 codes uint8 [M, K] from the ml_dtypes RNE cast, scales [M, K/block])."""
    m, k = x.shape
    codes = np.zeros((m, k), np.uint8)
    scales = np.zeros((m, k // block), np.float32)
    for i in range(m):
        for j in range(k // block):
            blk = x[i, j * block:(j + 1) * block]
            amax = np.float32(np.abs(blk).max())
            if scale_fmt == "ue8m0":
                amax = max(amax, np.float32(6 * 2.0**-126))
                s = np.float32(pow2_ceil_oracle(float(amax * np.float32(1 / 6))))
            else:
                amax = max(amax, np.float32(6 * 2.0**-9))
                s = np.clip(amax / np.float32(6), -448, 448).astype(E4M3).astype(np.float32)
            codes[i, j * block:(j + 1) * block] = np.clip(blk / s, -6, 6).astype(E2M1).view(np.uint8)
            scales[i, j] = s
    return codes, scales


def block_gemm_oracle(a: np.ndarray, w: np.ndarray, block: int, reverse: bool = False) -> np.ndarray:
    """Per K block: the partial sum exactly in float64, rounded once to float32; then a float32
    accumulation over blocks in a plain loop (ascending, or descending when reverse)."""
    m, k = a.shape
    n = w.shape[0]
    out = np.zeros((m, n), np.float32)
    blocks = range(k // block)
    for i in range(m):
        for j in range(n):
            acc = np.float32(0.0)
            for b in (reversed(blocks) if reverse else blocks):
                sl = slice(b * block, (b + 1) * block)
                partial = np.float32(np.dot(a[i, sl].astype(np.float64), w[j, sl].astype(np.float64)))
                acc = np.float32(acc + partial)
            out[i, j] = acc
    return out


# ---------------------------------------------------------------------------------------------
# e4m3 RNE with saturation

E4M3_TABLE = [
    (0.0, 0.0),
    (-0.0, -0.0),                      # the sign of zero survives clamp and cast
    (1.0625, 1.0),                     # tie of 1.0 (mantissa 000) and 1.125 (001) -> even 1.0
    (1.1875, 1.25),                    # tie of 1.125 (001) and 1.25 (010) -> even 1.25
    (1.0625 + 2.0**-20, 1.125),        # just above the tie
    (272.0, 256.0),                    # step 32 in [256, 512): tie of 256 (000) and 288 (001)
    (304.0, 320.0),                    # tie of 288 (001) and 320 (010)
    (432.0, 448.0),                    # tie of 416 (101) and 448 (110)
    (448.0, 448.0),
    (449.0, 448.0),                    # saturation
    (464.0, 448.0),                    # the tie with the (absent) 480: the clamp runs first
    (1e6, 448.0),
    (-1e6, -448.0),
    (INF, 448.0),
    (-INF, -448.0),
    (2.0**-9, 2.0**-9),                # smallest subnormal
    (2.0**-10, 0.0),                   # tie of 0 and 2^-9 -> 0
    (-(2.0**-10), -0.0),
    (2.0**-10 + 2.0**-30, 2.0**-9),    # just above that tie
    (3 * 2.0**-10, 2.0**-8),           # tie of 1*2^-9 (001) and 2*2^-9 (010)
    (7.5 * 2.0**-9, 2.0**-6),          # tie of the largest subnormal 7*2^-9 and the smallest normal 2^-6
    (1e-40, 0.0),                      # fp32 subnormal input
    (-1e-40, -0.0),
]


def test_e4m3_rne_table():
    x = torch.tensor([v for v, _ in E4M3_TABLE], dtype=torch.float32)
    out = e4m3_rne(x)
    assert out.dtype == torch.float32
    assert_bits(out, [e for _, e in E4M3_TABLE])


def test_e4m3_rne_keeps_nan_and_takes_bf16():
    assert torch.isnan(e4m3_rne(torch.tensor([float("nan")]))).all()
    assert_bits(e4m3_rne(torch.tensor([1.0625, -300.0], dtype=torch.bfloat16)), [1.0, -288.0])  # 300: 288 nearer than 320


@FAST
@given(hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(width=32, allow_nan=False)))
def test_e4m3_rne_matches_ml_dtypes(x):
    expected = np.clip(x, -448, 448).astype(E4M3).astype(np.float32)
    assert_bits(e4m3_rne(torch.from_numpy(x)), expected)


# ---------------------------------------------------------------------------------------------
# UE8M0 power-of-two ceiling

UE8M0_TABLE = [
    (1.0, 1.0),                        # exactly a power of two -> itself
    (up(1.0), 2.0),                    # one ulp above -> the next power of two
    (0.75, 1.0),
    (3.0, 4.0),
    (0.5, 0.5),
    (up(0.5), 1.0),
    (2.0**-126, 2.0**-126),            # smallest normal
    (up(2.0**-126), 2.0**-125),
    (2.0**127, 2.0**127),
    (0.0, 2.0**-126),                  # clamp: byte 0 -> 1
    (2.0**-130, 2.0**-126),            # fp32 subnormal: byte 0 + 1 -> 2^-126, not 2^-130
    (up(2.0**127), 2.0**127),          # clamp: byte 254 + 1 -> 254
    (3e38, 2.0**127),
    (INF, 2.0**127),
]


def test_ue8m0_scale_table():
    r = torch.tensor([v for v, _ in UE8M0_TABLE], dtype=torch.float32)
    assert_bits(ue8m0_scale(r), [e for _, e in UE8M0_TABLE])


@pytest.mark.parametrize("divisor, low", [(448.0, 256.0), (6.0, 4.0)])
def test_ue8m0_of_product_equals_ue8m0_of_quotient(divisor, low):
    """The design note in graphs/quant.py: over every fp32 amax of one binade, the power-of-two
    ceiling of amax * fp32(1/d), as the kernels compute it, equals the ceiling of amax / d.
    (Scaling amax by 2^k scales both exactly, so one binade covers every normal amax.)"""
    base = torch.tensor(low, dtype=torch.float32).view(torch.int32)
    amax = (base + torch.arange(2**23, dtype=torch.int32)).view(torch.float32)
    product = amax * (1.0 / divisor)
    assert torch.equal(product, amax * torch.tensor(1.0 / divisor, dtype=torch.float32))  # the scalar is fp32
    assert torch.equal(ue8m0_scale(product), ue8m0_scale(amax / divisor))


@FAST
@given(st.floats(min_value=2.0**-126, max_value=2.0**127, width=32))
def test_ue8m0_scale_matches_frexp_oracle(r):
    assert_bits(ue8m0_scale(torch.tensor([r], dtype=torch.float32)), [pow2_ceil_oracle(r)])


# ---------------------------------------------------------------------------------------------
# act_quant / act_quant_qdq (FP8 activations)

def test_act_quant_table_block32():
    x = torch.zeros(2, 64)
    # row 0, block 0: amax 448 -> ratio exactly 1 -> s = 1
    x[0, :7] = torch.tensor([448.0, 1.0625, 1.1875, -0.0, -304.0, 2.0**-10, 3 * 2.0**-10])
    # row 0, block 1: all zero -> amax floor 1e-4 -> ratio 2.232e-7 in (2^-23, 2^-22] -> s = 2^-22
    # row 1, block 0: amax one ulp above 448 -> ratio just above 1 -> s = 2
    x[1, :3] = torch.tensor([up(448.0), 2.125, -9.0])
    # row 1, block 1: 1e-6 everywhere -> s = 2^-22; 1e-6 * 2^22 = 4.19 -> step 0.5 in [4, 8) -> 4
    x[1, 32:] = 1e-6
    q, s = act_quant(x, 32)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == (2, 64) and s.shape == (2, 2)
    assert_bits(s, [[1.0, 2.0**-22], [2.0, 2.0**-22]])
    expected = np.zeros((2, 64), np.float32)
    # 2^-10: tie with 0 -> 0; 3*2^-10: tie -> 2^-8
    expected[0, :7] = [448.0, 1.0, 1.25, -0.0, -320.0, 0.0, 2.0**-8]
    # 448.00003/2 -> 224; 2.125/2 = 1.0625 -> tie -> 1.0; -9/2 = -4.5: step 0.5 in [4, 8) -> exact
    expected[1, :3] = [224.0, 1.0, -4.5]
    expected[1, 32:] = 4.0
    assert_bits(q.float(), expected)


def test_act_quant_table_block128_v4():
    x = torch.zeros(1, 256)
    # block 0: amax 56 = 448 / 8 -> s = 2^-3 exactly; 1/2^-3 = 8
    x[0, :3] = torch.tensor([56.0, 1.0, 0.1328125])  # 0.1328125 * 8 = 1.0625 -> tie -> 1.0
    # block 1: amax one ulp above 56 -> s = 2^-2; 56.000004 * 4 = 224.00002 -> 224
    x[0, 128] = up(56.0)
    q, s = act_quant(x, 128)
    assert s.shape == (1, 2)
    assert_bits(s, [[0.125, 0.25]])
    expected = np.zeros((1, 256), np.float32)
    expected[0, :3] = [448.0, 8.0, 1.0]
    expected[0, 128] = 224.0
    assert_bits(q.float(), expected)


@pytest.mark.parametrize("block", [32, 128])
def test_act_quant_qdq_rounds_through_fp8(block):
    """The QDQ result is float(q) * s in the input dtype. 1.0625 is exact in bf16, so the early-V4
    bug, which skipped the FP8 rounding, would return it unchanged. The FP8 path gives 1.0."""
    x = torch.zeros(1, 2 * block, dtype=torch.bfloat16)
    x[0, :4] = torch.tensor([448.0, 1.0625, -0.0, 1.1875])
    x[0, block:block + 2] = torch.tensor([449.0, 17.0])  # s = 2; 224.5 -> 224; 8.5 -> tie of 8 and 9 -> 8
    y = act_quant_qdq(x, block)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    expected = np.zeros((1, 2 * block), np.float32)
    expected[0, :4] = [448.0, 1.0, -0.0, 1.25]
    expected[0, block:block + 2] = [448.0, 16.0]
    assert_bits(y.float(), expected)


def test_act_quant_qdq_fp32_stays_fp32():
    y = act_quant_qdq(torch.tensor([[448.0, 1.0625] + [0.0] * 30]))
    assert y.dtype == torch.float32
    assert_bits(y[0, :2], [448.0, 1.0])


_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1.0625, 1.1875, 272.0, 304.0, 432.0, 448.0]
_TIE_ELEMENTS = st.builds(lambda t, e, sign: sign * t * 2.0**e, st.sampled_from(_TIES),
                          st.integers(-12, 12), st.sampled_from([1.0, -1.0]))
_ELEMENTS = st.one_of(st.floats(width=32, allow_nan=False, allow_infinity=False), _TIE_ELEMENTS)


@st.composite
def _blocks_array(draw, block: int) -> np.ndarray:
    """float32 [M, K] with K a multiple of block: normal values whose magnitude varies per block
    over 16 decades (drawn from a seeded numpy generator, which is fast), overwritten in up to 12
    places by hypothesis-chosen values (ties, extremes, zeros, subnormals)."""
    m, k = draw(st.integers(1, 3)), draw(st.integers(1, 3)) * block
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    magnitude = np.repeat(10.0 ** rng.uniform(-8, 8, (m, k // block)), block, 1)
    x = (rng.standard_normal((m, k)) * magnitude).astype(np.float32)
    for i, v in draw(st.lists(st.tuples(st.integers(0, m * k - 1), _ELEMENTS), max_size=12)):
        x.flat[i] = v
    return x


@FAST
@given(st.data(), st.sampled_from([32, 128]))
def test_act_quant_matches_oracle(data, block):
    x = data.draw(_blocks_array(block))
    q, s = act_quant(torch.from_numpy(x), block)
    codes, scales = act_quant_oracle(x, block)
    assert np.array_equal(q.view(torch.uint8).numpy(), codes)
    assert_bits(s, scales)


# ---------------------------------------------------------------------------------------------
# FP4 e2m1 (V4.1 reference rounding: RNE, ties to the even code)

# scaled value -> code, for a block whose amax is 6 (s = 1)
FP4_CODE_TABLE = [
    (6.0, 7), (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),  # ties -> even code
    (-0.25, 8), (-0.75, 10), (-1.25, 10), (-1.75, 12), (-2.5, 12), (-3.5, 14), (-5.0, 14), (-6.0, 15),
    (0.0, 0), (-0.0, 8), (-1e-3, 8), (1e-40, 0), (-1e-40, 8),   # negatives that round to 0 keep the sign
    (up(0.25), 1), (down(0.75), 1), (4.9, 6), (5.1, 7), (2.9, 5), (1.4, 3),
    (0.5, 1), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6),
]
E2M1_VALUE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_fp4_quantize_code_table():
    x = torch.tensor([[v for v, _ in FP4_CODE_TABLE]], dtype=torch.float32)
    assert x.shape == (1, 32)
    codes, s = fp4_quantize(x)
    assert codes.dtype == torch.uint8 and s.dtype == torch.float32
    assert_bits(s, [[1.0]])
    assert codes[0].tolist() == [c for _, c in FP4_CODE_TABLE]


def test_fp4_quantize_ue8m0_scales_and_subnormals():
    x = torch.zeros(4, 32)
    # row 0: amax one ulp above 6 -> ratio just above 1 -> s = 2; 3.0000002 -> 3 (code 5); 1/2 = 0.5 (code 1);
    # 0.25 -> tie of 0 and 0.5 -> 0
    x[0, :4] = torch.tensor([up(6.0), 1.0, 0.5, -0.0])
    # row 1: amax 0 -> floor 6*2^-126 -> ratio 2^-126 (the fp32 product rounds to it) -> s = 2^-126
    # row 2: amax exactly at the floor 6*2^-126 -> s = 2^-126; the subnormal 2^-127 -> 0.5 (code 1);
    # -2^-128 -> -0.25 -> -0 (code 8); 2^-149 -> 2^-23 -> 0
    x[2, :4] = torch.tensor([6 * 2.0**-126, 2.0**-127, -(2.0**-128), 2.0**-149])
    # row 3: fp32 subnormals only -> amax below the floor -> s = 2^-126; 1e-40 / 2^-126 = 0.0085 -> 0
    x[3] = 1e-40
    codes, s = fp4_quantize(x, 32, "ue8m0")
    assert_bits(s, [[2.0], [2.0**-126], [2.0**-126], [2.0**-126]])
    assert codes[0, :4].tolist() == [5, 1, 0, 8]
    assert codes[1].tolist() == [0] * 32
    assert codes[2, :4].tolist() == [7, 1, 8, 0]
    assert codes[3].tolist() == [0] * 32


def test_fp4_quantize_e4m3_scales():
    """V4.1 compressed KV: block 16, s = e4m3_rne(amax / 6), not a power of two."""
    x = torch.zeros(6, 16)
    x[0, :2] = torch.tensor([6.0, 0.75])          # 6/6 = 1 -> s = 1
    # 6.375/6 = 1.0625 -> e4m3 tie -> 1.0: s is below amax/6, so 6.375 saturates at 6 (code 7)
    x[1, :2] = torch.tensor([6.375, -6.375])
    # 7.1249995/6 = 1.1874999, just below the e4m3 tie 1.1875 -> 1.125 (amax * fp32(1/6) would
    # round to 1.1875 and give 1.25). 7.1249995/1.125 = 6.33 -> 6; 2.8125/1.125 = 2.5 -> tie -> 2;
    # 0.84375/1.125 = 0.75 -> tie -> 1.0
    x[2, :3] = torch.tensor([down(7.125), 2.8125, 0.84375])
    # amax 0 -> floor 6*2^-9 -> s = 2^-9, the smallest e4m3 subnormal
    # amax 6000 -> 1000 -> e4m3 saturates at 448; 6000/448 = 13.4 -> 6 (code 7)
    x[4, 0] = 6000.0
    # 6.5/6 = 1.0833 -> nearest e4m3 is 1.125 (distance 0.042 vs 0.083 to 1.0)
    x[5, 0] = 6.5
    codes, s = fp4_quantize(x, 16, "e4m3")
    assert_bits(s, [[1.0], [1.0], [1.125], [2.0**-9], [448.0], [1.125]])
    assert codes[0, :2].tolist() == [7, 2]
    assert codes[1, :2].tolist() == [7, 15]
    assert codes[2, :3].tolist() == [7, 4, 2]
    assert codes[3].tolist() == [0] * 16
    assert codes[4, 0].item() == 7


def test_fp4_act_quant_qdq_values():
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, :6] = torch.tensor([6.0, 0.75, -0.25, 2.5, 5.0, -1.75])
    x[0, 32:34] = torch.tensor([12.0, 5.0])       # s = 2: 6 -> 12; 2.5 -> tie -> 2 -> 4
    y = fp4_act_quant_qdq(x)
    assert y.dtype == torch.bfloat16
    expected = np.zeros((1, 64), np.float32)
    expected[0, :6] = [6.0, 1.0, -0.0, 2.0, 4.0, -2.0]
    expected[0, 32:34] = [12.0, 4.0]
    assert_bits(y.float(), expected)


def test_fp4_act_quant_qdq_e4m3_block16():
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, :2] = torch.tensor([6.375, 1.0])         # s = 1 (see above): 6.375 saturates at 6
    x[0, 16:18] = torch.tensor([6.5, 2.8125])     # s = 1.125: 6.5/1.125 -> 6 -> 6.75; 2.5 -> 2 -> 2.25
    y = fp4_act_quant_qdq(x, 16, "e4m3")
    expected = np.zeros((1, 32), np.float32)
    expected[0, :2] = [6.0, 1.0]
    expected[0, 16:18] = [6.75, 2.25]
    assert_bits(y.float(), expected)


@FAST
@given(hnp.arrays(np.float32, 31, elements=st.one_of(
    st.floats(-6, 6, width=32), st.sampled_from([s * t for t in [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] for s in (1, -1)]))))
def test_e2m1_rounding_matches_ml_dtypes(v):
    """With amax 6 the scale is 1, so the codes are the e2m1 RNE cast of v itself."""
    x = np.concatenate([np.float32([6.0]), v])
    codes, _ = fp4_quantize(torch.from_numpy(x)[None])
    assert np.array_equal(codes[0].numpy(), x.astype(E2M1).view(np.uint8))


@FAST
@given(st.data(), st.sampled_from([(32, "ue8m0"), (16, "e4m3"), (32, "e4m3")]))
def test_fp4_quantize_matches_oracle(data, mode):
    block, scale_fmt = mode
    x = data.draw(_blocks_array(block))
    codes, s = fp4_quantize(torch.from_numpy(x), block, scale_fmt)
    expected_codes, expected_scales = fp4_oracle(x, block, scale_fmt)
    assert np.array_equal(codes.numpy(), expected_codes)
    assert_bits(s, expected_scales)
    values = np.asarray(E2M1_VALUE, np.float32)[expected_codes]
    deq = np.repeat(expected_scales, block, axis=1) * values
    assert_bits(fp4_act_quant_qdq(torch.from_numpy(x), block, scale_fmt), deq)


def test_fp4_quantize_rtz_deepgemm_table():
    """docs/numerics.md "Kernel tests: edge cases and tolerances" B.8: DeepGEMM rounds ties toward zero, and -0 is 0x0."""
    x = torch.zeros(2, 32)
    x[0, :14] = torch.tensor([6.0, 0.75, 1.75, 3.5, 2.5, 5.0, 0.25, 1.25, -0.0, -0.1, -0.75, up(0.75), 4.0, -6.0])
    x[1, :2] = torch.tensor([7.0, 3.0])           # amax 7 -> 7/6 -> s = 2; 3.5 -> 3 (code 5); 1.5 -> 3
    codes, s = fp4_quantize_rtz(x)
    assert_bits(s, [[1.0], [2.0]])
    assert codes[0, :14].tolist() == [7, 1, 3, 5, 4, 6, 0, 2, 0, 0, 9, 2, 6, 15]
    assert codes[1, :2].tolist() == [5, 3]
    assert codes[1, 2:].tolist() == [0] * 30


# ---------------------------------------------------------------------------------------------
# packing and checkpoint weight codecs

def test_pack_nibble_order_hand_made_bytes():
    codes = torch.tensor([[3, 10, 0, 15, 7, 8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8)[0].tolist() == [0xA3, 0xF0, 0x87]   # even element in the low nibble
    assert unpack_fp4(torch.tensor([[0xA3 - 256]], dtype=torch.int8))[0].tolist() == [3, 10]


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)


def test_quantize_fp4_weight_hand_made():
    w = torch.zeros(2, 64)
    w[0, :3] = torch.tensor([1.5, -1.0, 6.0])     # s = 1: codes 3, 10, 7; block 1 all zero -> s = 2^-126
    w[1, :3] = torch.tensor([-0.0, 3.0, 0.75])    # amax 3 -> ratio 0.5 -> s = 0.5: codes 8, 7 (6), 3 (1.5)
    w[1, 32:34] = torch.tensor([12.0, 5.0])       # s = 2: 6 -> 7; 2.5 -> tie -> 2 -> code 4
    packed, scale = quantize_fp4_weight(w)
    assert packed.dtype == torch.int8 and packed.shape == (2, 32)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 2)
    expected_bytes = np.zeros((2, 32), np.uint8)
    expected_bytes[0, :2] = [0xA3, 0x07]          # 3 | 10 << 4, then 7 | 0 << 4
    expected_bytes[1, :2] = [0x78, 0x03]          # 8 | 7 << 4, then 3 | 0 << 4
    expected_bytes[1, 16] = 0x47                  # 7 | 4 << 4
    assert np.array_equal(packed.view(torch.uint8).numpy(), expected_bytes)
    assert scale.view(torch.uint8).tolist() == [[127, 1], [126, 128]]  # 2^0, 2^-126 | 2^-1, 2^1
    expected = np.zeros((2, 64), np.float32)
    expected[0, :3] = [1.5, -1.0, 6.0]
    expected[1, :3] = [-0.0, 3.0, 0.75]
    expected[1, 32:34] = [12.0, 4.0]
    assert_bits(dequant_fp4_weight(packed, scale), expected)
    assert_bits(dequant_fp4_weight(packed.view(torch.float4_e2m1fn_x2), scale), expected)  # the model's dtype


def test_quantize_fp8_weight_hand_made_ragged():
    """33 x 33 with 32 x 32 tiles: a 2 x 2 scale grid whose last row and column are ragged."""
    w = torch.zeros(33, 33)
    w[0, 0], w[0, 1] = 448.0, 1.0625               # tile (0, 0): s = 1; 1.0625 -> 1.0
    w[0, 32], w[1, 32] = 449.0, 17.0               # tile (0, 1): s = 2; 224.5 -> 224; 8.5 -> 8
    w[32, 32] = -1e-6                              # tile (1, 1): s = 2^-22; -4.19 -> -4
    q, scale = quantize_fp8_weight(w)              # tile (1, 0): all zero -> s = 2^-22
    assert q.dtype == torch.float8_e4m3fn and q.shape == (33, 33)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 2)
    assert scale.view(torch.uint8).tolist() == [[127, 128], [105, 105]]
    expected_q = np.zeros((33, 33), np.float32)
    expected_q[0, :2] = [448.0, 1.0]
    expected_q[0, 32], expected_q[1, 32], expected_q[32, 32] = 224.0, 8.0, -4.0
    assert_bits(q.float(), expected_q)
    expected = np.zeros((33, 33), np.float32)
    expected[0, :2] = [448.0, 1.0]
    expected[0, 32], expected[1, 32], expected[32, 32] = 448.0, 16.0, -(2.0**-20)
    assert_bits(dequant_fp8_weight(q, scale), expected)


def _varied_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Normal weights whose magnitude varies over 6 decades, with exact zeros mixed in."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 10.0 ** (torch.rand(n, k, generator=g) * 6 - 3)
    return w * (torch.rand(n, k, generator=g) > 0.1)


@pytest.mark.parametrize("n, k, block", [(70, 45, 32), (64, 96, 32), (130, 257, 128), (5, 3, 32)])
def test_quantize_fp8_weight_matches_oracle(n, k, block):
    w = _varied_weight(n, k, seed=n * k)
    q, scale = quantize_fp8_weight(w, block)
    wn = w.numpy()
    nb, kb = -(-n // block), -(-k // block)
    expected_codes = np.zeros((n, k), np.uint8)
    expected_bytes = np.zeros((nb, kb), np.uint8)
    for i in range(nb):
        for j in range(kb):
            tile = wn[i * block:(i + 1) * block, j * block:(j + 1) * block]
            amax = max(np.float32(np.abs(tile).max()), np.float32(1e-4))
            s = pow2_ceil_oracle(float(amax * np.float32(1 / 448)))
            expected_bytes[i, j] = math.frexp(s)[1] - 1 + 127
            codes = np.clip(tile / np.float32(s), -448, 448).astype(E4M3).view(np.uint8)
            expected_codes[i * block:(i + 1) * block, j * block:(j + 1) * block] = codes
    assert np.array_equal(q.view(torch.uint8).numpy(), expected_codes)
    assert np.array_equal(scale.view(torch.uint8).numpy(), expected_bytes)
    # dequantisation is exact: e4m3 value (float64) times 2^(byte - 127)
    byte = np.repeat(np.repeat(expected_bytes.astype(np.int64), block, 0), block, 1)[:n, :k]
    exact = expected_codes.view(E4M3).astype(np.float64) * np.exp2(byte - 127.0)
    deq = dequant_fp8_weight(q, scale, block)
    assert deq.dtype == torch.float32
    assert np.array_equal(deq.numpy().astype(np.float64), exact)
    # error bound: half an e4m3 ulp, |w| * 2^-4 for normals and s * 2^-10 in the subnormal range
    s_full = np.exp2(byte - 127.0)
    assert (np.abs(exact - wn) <= np.maximum(np.abs(wn) * 2.0**-4, s_full * 2.0**-10)).all()


@pytest.mark.parametrize("n, k", [(8, 64), (3, 256)])
def test_quantize_fp4_weight_matches_oracle(n, k):
    w = _varied_weight(n, k, seed=7 * n + k)
    packed, scale = quantize_fp4_weight(w)
    codes, scales = fp4_oracle(w.numpy(), 32, "ue8m0")
    expected_bytes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    assert np.array_equal(packed.view(torch.uint8).numpy(), expected_bytes)
    assert np.array_equal(scale.view(torch.uint8).numpy(),
                          np.vectorize(lambda s: math.frexp(s)[1] - 1 + 127)(scales.astype(np.float64)))
    exact = np.repeat(scales.astype(np.float64), 32, 1) * np.asarray(E2M1_VALUE, np.float64)[codes]
    deq = dequant_fp4_weight(packed, scale)
    assert np.array_equal(deq.numpy().astype(np.float64), exact)
    # error bound: half an e2m1 step, i.e. s/4 below 2*s and |w|/4 above it
    wn = w.numpy().astype(np.float64)
    s_full = np.repeat(scales.astype(np.float64), 32, 1)
    assert (np.abs(exact - wn) <= np.maximum(s_full, np.abs(wn)) / 4).all()


# ---------------------------------------------------------------------------------------------
# block-scaled GEMM

def test_block_scaled_matmul_accumulation_order_hand_made():
    """Partials 2^24, 1, 1 (blocks 0, 1, 2). Ascending: 2^24 + 1 is a tie -> 2^24 (even), and again
    -> 2^24. Descending: 1 + 1 = 2, then 2 + 2^24 = 2^24 + 2, which is exact."""
    a = torch.zeros(1, 96)
    w = torch.zeros(1, 96)
    a[0, 0] = w[0, 0] = 2.0**12
    a[0, 32] = w[0, 32] = 1.0
    a[0, 64] = w[0, 64] = 1.0
    assert_bits(block_scaled_matmul(a, w), [[2.0**24]])
    assert_bits(block_scaled_matmul(a, w, order="descending"), [[2.0**24 + 2]])


@FAST
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.integers(1, 3), st.integers(1, 6), st.booleans())
def test_block_scaled_matmul_bit_exact_when_partials_exact(seed, m, n, kb, reverse):
    """Integers in [-16, 16] times one power of two per (row, block): every block partial is
    exact in fp32 (|sum| <= 32 * 256 < 2^24), so only the across-block order can round, and
    the result must match the oracle loop bit for bit."""
    rng = np.random.default_rng(seed)
    block = 32
    a = rng.integers(-16, 17, (m, kb * block)).astype(np.float32)
    w = rng.integers(-16, 17, (n, kb * block)).astype(np.float32)
    a *= np.repeat(np.exp2(rng.integers(-30, 31, (m, kb))), block, 1).astype(np.float32)
    w *= np.repeat(np.exp2(rng.integers(-30, 31, (n, kb))), block, 1).astype(np.float32)
    out = block_scaled_matmul(torch.from_numpy(a)[None], torch.from_numpy(w), block, "descending" if reverse else "ascending")
    assert out.shape == (1, m, n)
    assert_bits(out[0], block_gemm_oracle(a, w, block, reverse))


@FAST
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(1, 4), st.integers(1, 5), st.sampled_from([16, 32]))
def test_block_scaled_matmul_against_float64_oracle(seed, m, n, kb, block):
    """General dequantised operands (e4m3 values times powers of two, one scale per row and block):
    every block partial is exact in float64, so ours is the oracle bit for bit, and both stay
    within (KB + 1) * 2^-24 * sum |a w| of the exact product."""
    rng = np.random.default_rng(seed)
    k = kb * block
    a = np.clip(rng.standard_normal((m, k)) * 50, -448, 448).astype(E4M3).astype(np.float32)
    w = np.clip(rng.standard_normal((n, k)) * 50, -448, 448).astype(E4M3).astype(np.float32)
    a *= np.repeat(np.exp2(rng.integers(-8, 9, (m, kb))), block, 1).astype(np.float32)
    w *= np.repeat(np.exp2(rng.integers(-8, 9, (n, kb))), block, 1).astype(np.float32)
    out = block_scaled_matmul(torch.from_numpy(a), torch.from_numpy(w), block)
    assert_bits(out, block_gemm_oracle(a, w, block))
    out = out.numpy()
    bound = (kb + 1) * 2.0**-24 * (np.abs(a).astype(np.float64) @ np.abs(w).astype(np.float64).T)
    assert (np.abs(out.astype(np.float64) - a.astype(np.float64) @ w.astype(np.float64).T) <= bound).all()


def test_fp8_linear_hand_made():
    """Block 0: amax 17 -> s = 2^-4; 17 * 16 = 272 -> tie -> 256 -> 16; 1 stays 1; y0 = 16 + 1 = 17.
    Block 1: amax 100 -> ratio 0.223 -> s = 0.25; 400 -> tie of 384 and 416 -> 384 -> 96;
    2.125 * 4 = 8.5 -> tie -> 8 -> 2; y1 = 96 + 2 = 98."""
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, :2] = torch.tensor([17.0, 1.0])
    x[0, 32:34] = torch.tensor([2.125, 100.0])
    w = torch.zeros(2, 64)
    w[0, :2] = 1.0
    w[1, 32:34] = 1.0
    y = fp8_linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (1, 2)
    assert_bits(y.float(), [[17.0, 98.0]])


@FAST
@given(st.integers(0, 2**31 - 1), st.integers(1, 9), st.integers(1, 4), st.sampled_from([16, 32]))
def test_fused_order_within_fp32_summation_bound(seed, m, kb, block):
    """Order "fused" (one GEMM over the whole K, the compiled steps' choice) sums the same exact
    products in the library's order: within K * 2^-24 * sum |a w| of the float64 oracle, and bit
    for bit the blocked result when every partial sum is exact (small integers)."""
    rng = np.random.default_rng(seed)
    k = kb * block
    a = np.clip(rng.standard_normal((m, k)) * 50, -448, 448).astype(E4M3).astype(np.float32)
    w = np.clip(rng.standard_normal((5, k)) * 50, -448, 448).astype(E4M3).astype(np.float32)
    out = block_scaled_matmul(torch.from_numpy(a), torch.from_numpy(w), block, "fused").numpy()
    exact = a.astype(np.float64) @ w.astype(np.float64).T
    assert (np.abs(out - exact) <= k * 2.0**-24 * (np.abs(a).astype(np.float64) @ np.abs(w).astype(np.float64).T)).all()
    ai, wi = torch.from_numpy(np.rint(a / 64)), torch.from_numpy(np.rint(w / 64))
    assert torch.equal(block_scaled_matmul(ai, wi, block, "fused"), block_scaled_matmul(ai, wi, block))
    w3 = torch.from_numpy(np.stack([np.rint(w / 64)] * 2))
    got = experts_linear(ai.bfloat16(), w3, block, "fused")
    assert torch.equal(got[1], fp8_linear(ai.bfloat16(), w3[1], block))


@pytest.mark.parametrize("reverse", [False, True])
def test_fp8_linear_matches_oracle_activation(reverse):
    """The activation path, checked against the oracle's quantised activation: float(q) * s,
    in fp32, through the same GEMM, then cast to bf16."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 3, 96, generator=g) * 10.0 ** (torch.rand(2, 3, 96, generator=g) * 4 - 2)).bfloat16()
    w = dequant_fp8_weight(*quantize_fp8_weight(torch.randn(40, 96, generator=g) / 10))
    codes, scales = act_quant_oracle(x.float().reshape(6, 96).numpy(), 32)
    a = codes.view(E4M3).astype(np.float32) * np.repeat(scales, 32, 1)
    order = "descending" if reverse else "ascending"
    expected = block_scaled_matmul(torch.from_numpy(a), w, 32, order).to(torch.bfloat16).reshape(2, 3, 40)
    y = fp8_linear(x, w, 32, order)
    assert y.shape == (2, 3, 40)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


# ---------------------------------------------------------------------------------------------
# bad inputs

_Q8, _S8 = quantize_fp8_weight(torch.ones(40, 40))
_P4, _S4 = quantize_fp4_weight(torch.ones(4, 64))

BAD_INPUTS = [
    ("GEMM order", lambda: block_scaled_matmul(torch.zeros(1, 32), torch.zeros(1, 32), 32, "random"), "order must be one of"),
    ("experts GEMM order", lambda: experts_linear(torch.zeros(1, 32), torch.zeros(1, 1, 32), 32, "reverse"), "order must be one of"),
    ("act_quant K % block", lambda: act_quant(torch.zeros(2, 33)), "multiple of the block size 32, got 33"),
    ("act_quant V4 K % 128", lambda: act_quant_qdq(torch.zeros(1, 96), 128), "block size 128, got 96"),
    ("act_quant float64", lambda: act_quant(torch.zeros(2, 32, dtype=torch.float64)), "torch.float64"),
    ("act_quant int", lambda: act_quant(torch.zeros(2, 32, dtype=torch.int32)), "torch.int32"),
    ("act_quant 0-d", lambda: act_quant(torch.tensor(1.0)), "0-d"),
    ("act_quant block 0", lambda: act_quant(torch.zeros(2, 32), 0), "positive"),
    ("fp4 K % block", lambda: fp4_quantize(torch.zeros(1, 48)), "got 48"),
    ("fp4 scale_fmt", lambda: fp4_quantize(torch.zeros(1, 32), 32, "e8m0"), "'e8m0'"),
    ("fp4 qdq e4m3 K % 16", lambda: fp4_act_quant_qdq(torch.zeros(1, 24), 16, "e4m3"), "got 24"),
    ("fp4 rtz K % block", lambda: fp4_quantize_rtz(torch.zeros(1, 40)), "got 40"),
    ("fp4 fp8 input", lambda: fp4_quantize(torch.zeros(1, 32, dtype=torch.float8_e4m3fn)), "float8_e4m3fn"),
    ("e4m3 int", lambda: e4m3_rne(torch.zeros(3, dtype=torch.int64)), "torch.int64"),
    ("ue8m0 bf16", lambda: ue8m0_scale(torch.ones(3, dtype=torch.bfloat16)), "torch.bfloat16"),
    ("fp8 weight 1-D", lambda: quantize_fp8_weight(torch.zeros(4)), "2-D"),
    ("fp8 weight float64", lambda: quantize_fp8_weight(torch.zeros(4, 4, dtype=torch.float64)), "torch.float64"),
    ("fp8 dequant fp32 w", lambda: dequant_fp8_weight(_Q8.float(), _S8), "float8_e4m3fn"),
    ("fp8 dequant fp32 scale", lambda: dequant_fp8_weight(_Q8, torch.ones(2, 2)), "float8_e8m0fnu"),
    ("fp8 dequant scale shape", lambda: dequant_fp8_weight(_Q8, _S8[:1]), "(2, 2)"),
    ("fp4 weight K % 32", lambda: quantize_fp4_weight(torch.zeros(4, 48)), "got 48"),
    ("fp4 weight 1-D", lambda: quantize_fp4_weight(torch.zeros(64)), "2-D"),
    ("fp4 dequant float w", lambda: dequant_fp4_weight(_P4.float(), _S4), "int8"),
    ("fp4 dequant scale shape", lambda: dequant_fp4_weight(_P4, _S4[:, :1]), "(4, 2)"),
    ("fp4 dequant ragged K", lambda: dequant_fp4_weight(_P4[:, :24], _S4), "K = 48"),
    ("gemm K mismatch", lambda: block_scaled_matmul(torch.zeros(2, 64), torch.zeros(3, 32)), "(2, 64) and (3, 32)"),
    ("gemm bf16", lambda: block_scaled_matmul(torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(3, 32)), "bfloat16"),
    ("gemm K % block", lambda: block_scaled_matmul(torch.zeros(2, 48), torch.zeros(3, 48)), "got 48"),
    ("linear K % block", lambda: fp8_linear(torch.zeros(2, 48, dtype=torch.bfloat16), torch.zeros(3, 48)), "got 48"),
]


@pytest.mark.parametrize("call, match", [(c, m) for _, c, m in BAD_INPUTS], ids=[i for i, _, _ in BAD_INPUTS])
def test_bad_inputs_raise_value_error(call, match):
    with pytest.raises(ValueError) as info:
        call()
    assert match in str(info.value)


def test_experts_linear_equals_fp8_linear_per_expert():
    """The stacked-experts GEMM is bit-identical to one fp8_linear per expert, for a shared input
    and for per-expert inputs, at 1 row and at many rows, in both K-block orders."""
    g = torch.Generator().manual_seed(7)
    E, N, K = 3, 40, 96
    w, s = quantize_fp4_weight(torch.randn(E * N, K, generator=g) / 10)
    w_deq = dequant_fp4_weight(w.view(E, N, K // 2), s.view(torch.uint8).view(E, N, K // 32))
    for M in (1, 13):
        x = torch.randn(M, K, generator=g).bfloat16()
        xe = torch.randn(E, M, K, generator=g).bfloat16()
        for order in ("ascending", "descending"):
            got = experts_linear(x, w_deq, order=order)
            got_e = experts_linear(xe, w_deq, order=order)
            for e in range(E):
                assert torch.equal(got[e], fp8_linear(x, w_deq[e], order=order))
                assert torch.equal(got_e[e], fp8_linear(xe[e], w_deq[e], order=order))


# ------------------------------------------------------------------ the neuron target's spelling
# kernels_nki/formats.py `neuron_spelling`: the same codecs and roundings on integer and fp32 bit
# patterns, without float8 dtypes. The oracle is torch's own casts (and ml_dtypes for the e4m3
# bytes); equality is bit for bit, NaN equal to NaN whatever its payload.
def _bits_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    width = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[want.element_size()]
    same = got.contiguous().view(width) == want.contiguous().view(width)
    if want.dtype.is_floating_point:
        same = same | (got.isnan() & want.isnan())
    return bool(same.all())


_EVERY_BYTE = torch.arange(256, dtype=torch.int32).to(torch.uint8)
_EVERY_BF16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def test_neuron_spelling_decodes_every_e4m3_and_e8m0_byte_as_torch_does():
    want_e4m3 = _EVERY_BYTE.view(torch.float8_e4m3fn).float()
    want_e8m0 = _EVERY_BYTE.view(torch.float8_e8m0fnu).float()
    with neuron_spelling():
        got_e4m3, got_e8m0 = e4m3_to_float(_EVERY_BYTE), ue8m0_to_float(_EVERY_BYTE)
    assert _bits_equal(got_e4m3, want_e4m3)
    assert _bits_equal(got_e4m3, torch.from_numpy(_EVERY_BYTE.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)))
    assert _bits_equal(got_e8m0, want_e8m0)


def test_neuron_spelling_encodes_every_e4m3_value_to_its_byte():
    values = _EVERY_BYTE.view(torch.float8_e4m3fn).float()
    finite = ~values.isnan()
    with neuron_spelling():
        got = e4m3_to_bytes(values)
    assert torch.equal(got[finite], _EVERY_BYTE[finite])  # -0.0 included (byte 0x80)
    assert set(got[~finite].tolist()) <= {0x7F, 0xFF}  # NaN: the canonical code, either sign


def test_neuron_spelling_pow2_is_exact_over_the_normal_range():
    e = torch.arange(-126, 128, dtype=torch.int32)
    assert _bits_equal(pow2(e), torch.ldexp(torch.ones(254), e))


def test_neuron_spelling_decodes_every_fp4_byte_as_the_default_spelling():
    w = _EVERY_BYTE.view(torch.int8).view(8, 32)  # 8 rows of K = 64, one scale per 32
    scale = torch.tensor([120, 127, 130, 1, 254, 127, 126, 128], dtype=torch.uint8).view(8, 1).expand(8, 2).contiguous()
    want = dequant_fp4_weight(w, scale.view(torch.float8_e8m0fnu))
    with neuron_spelling():
        got = dequant_fp4_weight(w, scale)
    assert _bits_equal(got, want)


def test_neuron_spelling_rounds_every_bf16_pattern_to_e4m3_as_the_cast_does():
    x = _EVERY_BF16.clamp(-448, 448)  # the callers' clamp (e4m3_rne): inf -> 448, NaN stays
    want = x.to(torch.float8_e4m3fn).float()
    with neuron_spelling():
        assert _bits_equal(e4m3_round(x), want)
        assert _bits_equal(e4m3_rne(_EVERY_BF16), want)


@pytest.mark.parametrize("seed", [0, 1])
def test_neuron_spelling_rounds_random_fp32_to_e4m3_as_the_cast_does(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-40, 12, (200_000,), generator=g).float())
    # the ties and their neighbours of every binade: the half-way points of the e4m3 grid
    grid = _EVERY_BYTE.view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].sort().values
    half = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([x, half, torch.nextafter(half, grid[1:]), torch.nextafter(half, grid[:-1])]).clamp(-448, 448)
    with neuron_spelling():
        assert _bits_equal(e4m3_round(x), x.to(torch.float8_e4m3fn).float())


def test_neuron_spelling_quantizers_equal_the_default_spelling():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(32, 256, generator=g) * 4).to(torch.bfloat16)
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 448.0, -600.0, 3.0, -3.0])
    want = [act_quant_qdq(x, 32), fp4_act_quant_qdq(x, 32, "ue8m0"), fp4_act_quant_qdq(x, 16, "e4m3"), *fp4_quantize(x.float(), 32)]
    with neuron_spelling():
        got = [act_quant_qdq(x, 32), fp4_act_quant_qdq(x, 32, "ue8m0"), fp4_act_quant_qdq(x, 16, "e4m3"), *fp4_quantize(x.float(), 32)]
    for a, b in zip(got, want):
        assert _bits_equal(a, b)


class _Fp8Projection(torch.nn.Module):
    """One FP8 linear as the model holds it (float8_e4m3fn weight, e8m0 scales)."""

    def __init__(self):
        super().__init__()
        from dsneuron.graphs.model import Linear

        self.lin = Linear(64, 32, "fp8")
        w, s = quantize_fp8_weight(torch.randn(32, 64, generator=torch.Generator().manual_seed(5)))
        self.lin.weight.data, self.lin.scale.data = w, s

    def forward(self, x):
        return self.lin(x)


def test_export_with_neuron_spelling_holds_no_float8_and_computes_the_same():
    from dsneuron.compiler.backend_neuron import INPUT_VIEWS
    from dsneuron.compiler.export import StepGraph, export_step, float8_nodes

    module = _Fp8Projection()
    weights = {"lin.weight": module.lin.weight, "lin.scale": module.lin.scale}
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    graph = StepGraph(module, (("x", x),), ("y",))
    from dsneuron.graphs.numerics import gemm_order

    plain = export_step(graph, weights, "plain", INPUT_VIEWS)
    with gemm_order("fused"):  # the neuron target's order: one fp32 GEMM (the golden's exact one sums in float64)
        neuron = export_step(graph, weights, "neuron", INPUT_VIEWS, neuron_spelling=True)
    assert float8_nodes(plain.program), "the default spelling views the bytes back to float8"
    assert float8_nodes(neuron.program) == [] and float8_nodes(neuron.program, (torch.float64,)) == []
    args = [weights[n].view(torch.uint8) for n in neuron.weights]
    assert _bits_equal(neuron.program.module()(*args, x)[0], module(x))
    assert _bits_equal(plain.program.module()(*args, x)[0], module(x))


def test_export_with_neuron_spelling_refuses_a_raw_float8_cast_and_float64():
    from dsneuron.compiler.export import CompileError, StepGraph, export_step

    class RawCast(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.float8_e4m3fn).float()

    class Wide(torch.nn.Module):
        def forward(self, x):
            return (x.double() * 3).float()

    with pytest.raises(CompileError, match=r"float8-free lowering left 2 node\(s\) with a float8 dtype, first to \(aten.to.dtype, torch.float8_e4m3fn\).*e4m3_round"):
        export_step(StepGraph(RawCast(), (("x", torch.ones(4)),), ("y",)), {}, "raw", neuron_spelling=True)
    with pytest.raises(CompileError, match=r"left 3 node\(s\) with a float64 dtype, first to \(aten.to.dtype, torch.float64\).*no float64"):
        export_step(StepGraph(Wide(), (("x", torch.ones(4)),), ("y",)), {}, "wide", neuron_spelling=True)


def test_exact_linear_takes_a_large_weight_a_slice_of_rows_at_a_time(monkeypatch):
    """A weight whose float64 copy exceeds the chunk budget is sliced by output rows (so V4.1's
    head never has a whole float64 copy): bf16-valued operands give the float64 F.linear of the whole
    weight rounded once, bit for bit, with a ragged last slice."""
    from dsneuron.graphs import quant as Q

    g = torch.Generator().manual_seed(4)
    w = torch.randn(1000, 96, generator=g).bfloat16().float()
    x = torch.randn(2, 5, 96, generator=g).bfloat16().float()
    want = torch.nn.functional.linear(x.double(), w.double()).float()
    calls = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda a, b: calls.append(b.shape[0]) or real(a, b))
    monkeypatch.setattr(Q, "_EXACT_CHUNK_BYTES", 8 * 96 * 300)
    got = Q.exact_linear(x, w)
    assert calls == [300, 300, 300, 100] and torch.equal(got, want)
