"""Storage codecs shared by the kernels and the model: FP4 e2m1 codes, nibble packing, UE8M0 scales.

These are pure bit-level encodings with no rounding decision in them; the quantizers that choose
codes and scales live in `dsneuron.graphs.quant`. They sit here because `kernels_nki` may not import
`graphs` (the dependency rule in docs/architecture.md), while both sides must read the same bytes.

Sources: DeepGEMM deep_gemm/utils/math.py (nibble order, UE8M0 bytes), DeepSeek-V4-Flash
inference/convert.py cast_e2m1fn_to_e4m3fn (e2m1 code table); see docs/numerics.md "Kernel tests: edge cases and tolerances".
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

#: e2m1 value of each 4-bit code; bit 3 is the sign, so code 8 is -0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0


class _Spelling:
    """How graphs spell the ops that the neuron target cannot take: torch's float8 casts and float64
    arithmetic (`neuron` False: the cpu target and the eager golden), or integer, bit-view and fp32
    arithmetic on the bytes (`neuron` True, inside `neuron_spelling`: the neuron target's StableHLO).
    trn1/trn2 have no OCP e4m3fn (neuronx-cc NCC_EVRF051) and Trainium's engines no fp64, so a
    neuron graph holds neither; bit views are plain `stablehlo.bitcast_convert`s. Both spellings
    give the same codec and rounding values (tests/test_quant.py checks every byte and every bf16
    pattern); where a float64 sum becomes an fp32 one (the indexer's bf16 scores, the sparse
    attention reference) the deviation is named at that function."""

    neuron: bool = False


SPELLING = _Spelling()


@contextlib.contextmanager
def neuron_spelling() -> Iterator[None]:
    """Within this context `e4m3_to_float`, `e4m3_round` and `e4m3_to_bytes` take FP8 data as uint8
    bytes and work on integer and fp32 bit patterns, and the references that sum in float64 sum in
    fp32, so a traced graph holds no float8 and no float64 dtype."""
    prev = SPELLING.neuron
    SPELLING.neuron = True
    try:
        yield
    finally:
        SPELLING.neuron = prev


_E4M3_SUBNORMAL_STEP = 2.0**-9
#: smallest normal e4m3 magnitude: below it the quantum is the fixed subnormal step
_E4M3_MIN_NORMAL = 2.0**-6


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """One-byte data [...] (uint8, int8 or a float8/float4 dtype) as its uint8 bytes [...] (a bit
    view, no copy)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 [...] for integer e in [-126, 127] (int32 [...]), exactly: the fp32 bit pattern
    with biased exponent e + 127 and a zero mantissa (no table, no pow, whose device implementation
    need not be exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def e4m3_to_float(x: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3fn data [...] (float8_e4m3fn, or its bytes as uint8) -> fp32 [...], exact.

    Under `neuron_spelling` the bytes are decoded from their bit fields with integer ops and one
    exact int -> fp32 conversion: sign, 4-bit exponent e (bias 7), 3-bit mantissa m; the value is
    (8 + m) * 2^(e - 10) for e > 0 and m * 2^-9 for e = 0 (subnormal); S.1111.111 is NaN.
    Raises ValueError for another dtype. Source: OCP 8-bit floating point spec v1.0 (E4M3).
    """
    if x.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"e4m3_to_float: expected float8_e4m3fn or uint8 bytes, got {x.dtype}")
    if not SPELLING.neuron:
        return (x.view(torch.float8_e4m3fn) if x.dtype == torch.uint8 else x).float()
    b = as_uint8(x).to(torch.int32)
    exp, mant = (b >> 3) & 0xF, b & 0x7
    normal = exp > 0
    # (8 [e > 0] + m) * 2^(max(e, 1) - 1) is an integer below 2^18, then one exact scaling by 2^-9
    units = (torch.where(normal, mant + 8, mant) << torch.where(normal, exp - 1, 0)).float()
    mag = units * _E4M3_SUBNORMAL_STEP
    mag = torch.where((exp == 15) & (mant == 7), math.nan, mag)
    return torch.where(b >= 0x80, -mag, mag)


def e4m3_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values on the e4m3fn grid [...] (|x| <= 448, or NaN) -> their e4m3fn bytes uint8 [...].

    A codec, not a quantizer: the values are already rounded (`e4m3_round`). Under
    `neuron_spelling` the fields come from the fp32 bit pattern: from 2^-6 up, exponent field =
    fp32 biased exponent - 120 and mantissa = the top 3 fp32 mantissa bits; below it the subnormal
    code |x| * 2^9 (exact); bit 7 is the sign (-0.0 gives 0x80), NaN gives 0x7F.
    Raises ValueError unless x is fp32. Source: OCP 8-bit floating point spec v1.0 (E4M3).
    """
    if x.dtype != torch.float32:
        raise ValueError(f"e4m3_to_bytes: expected float32, got {x.dtype}")
    if not SPELLING.neuron:
        return x.to(torch.float8_e4m3fn).view(torch.uint8)
    bits = x.view(torch.int32)
    mag = x.abs()
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 0x7)
    code = torch.where(mag < _E4M3_MIN_NORMAL, (mag * 512.0).to(torch.int32), normal)
    code = torch.where(mag.isnan(), 0x7F, code)
    return (code | ((bits >> 24) & 0x80)).to(torch.uint8)


def ue8m0_to_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Exact powers of two fp32 [...] in [2^-126, 2^127] -> their UE8M0 exponent bytes uint8 [...]
    (the fp32 biased exponent field)."""
    return ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 [...] with |x| <= 448 (or NaN) -> fp32 [...] on the e4m3fn grid, round to nearest, ties
    to even: `x.to(float8_e4m3fn).float()`.

    Under `neuron_spelling`, on the fp32 bit pattern: from 2^-6 up, the 20 mantissa bits e4m3 does
    not keep are rounded half to even by adding 0x7FFFF plus the lowest kept bit and masking them
    off (a carry moves into the exponent, as it should); below 2^-6 the fixed quantum 2^-9:
    round-half-even(x * 2^9) * 2^-9, both scalings exact. The sign is kept (-0.0 stays -0.0); NaN
    stays NaN. Callers clamp first (`graphs.quant.e4m3_rne`), so no overflow rule is needed.
    Raises ValueError unless x is fp32.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"e4m3_round: expected float32, got {x.dtype}")
    if not SPELLING.neuron:
        return x.to(torch.float8_e4m3fn).float()
    bits = x.view(torch.int32)
    kept = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & -0x100000).view(torch.float32)
    sub = torch.round(x * 512.0) * _E4M3_SUBNORMAL_STEP
    out = torch.where(x.abs() < _E4M3_MIN_NORMAL, sub, kept)
    return torch.where(x.isnan(), x, out)


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 e2m1 values as fp32 [16], indexed by code."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def pack_fp4_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Pack e2m1 codes [..., K] (integer dtype, values 0..15, K even) into uint8 [..., K/2].

    Byte i holds code 2i in its low nibble and code 2i+1 in its high nibble. No bit view, so it
    runs in both spellings. Raises ValueError when K is odd.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.int32) & 0xF
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """`pack_fp4_bytes` as int8 [..., K/2], the dtype DeepGEMM passes packed e2m1 pairs in."""
    return pack_fp4_bytes(codes).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int8/uint8 [..., K/2] into e2m1 codes uint8 [..., K] (even element from the low nibble)."""
    b = as_uint8(packed).to(torch.int32)
    codes = torch.stack([b & 0xF, (b >> 4) & 0xF], dim=-1).flatten(-2)
    return codes.to(torch.uint8)


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes uint8 [...] -> their fp32 values [...] (exact)."""
    return e2m1_table(codes.device)[codes.long()]


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales -> fp32 powers of two. Accepts float8_e8m0fnu tensors or raw exponent bytes
    (uint8: value 2^(byte-127)); byte 255 is NaN, as in e8m0.

    No data-dependent check here: this runs inside exported graphs. Loaders that want to refuse
    NaN scales check with `has_ue8m0_nan` first. Raises ValueError for any other dtype.
    """
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"ue8m0_to_float: expected float8_e8m0fnu or uint8, got {scale.dtype}")
    scale = as_uint8(scale)
    out = (scale.to(torch.int32) << 23).view(torch.float32)
    # byte 0 would be the denormal 2^-127, which a zero mantissa cannot spell; 255 is e8m0's NaN
    out = torch.where(scale == 0, torch.full_like(out, 2.0 ** -127), out)
    return torch.where(scale == 255, torch.full_like(out, math.nan), out)


def has_ue8m0_nan(scale: torch.Tensor) -> bool:
    """True when a float8_e8m0fnu / uint8 scale tensor holds the NaN byte 255."""
    raw = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
    return bool((raw == 255).any())


def float_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Exact powers of two (fp32, in [2^-127, 2^127]) -> float8_e8m0fnu with the same value.

    Raises ValueError if a value is not an exact power of two in range; rounding a scale to a
    power of two is the quantizer's job (`graphs.quant.ue8m0_scale`), not this codec's.
    """
    s = scale.float()
    m, e = torch.frexp(s)  # s = m * 2^e with m in [0.5, 1)
    if not bool(((m == 0.5) & (e - 1 >= -127) & (e - 1 <= 127)).all()):
        raise ValueError("float_to_ue8m0: every scale must be an exact power of two in [2^-127, 2^127]")
    return (e - 1 + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


#: Elements per UE8M0 scale in the indexer operands (DeepGEMM gran_k; V4.1 fp4_block_size).
SCALE_BLOCK = 32

#: Dtypes that carry packed e2m1 pairs (DeepGEMM passes int8; the V4.1 checkpoint uses float4_e2m1fn_x2).
PACKED_FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)


def _apply_block_scales(values: torch.Tensor, scales: torch.Tensor, block: int, what: str) -> torch.Tensor:
    """values fp32 [..., D] times one UE8M0 scale [..., D/block] per `block` consecutive elements."""
    groups = values.shape[-1] // block
    if values.shape[-1] % block or tuple(scales.shape) != (*values.shape[:-1], groups):
        raise ValueError(
            f"{what}: expected scales of shape {(*values.shape[:-1], groups)} for values of shape "
            f"{tuple(values.shape)} and block {block}, got {tuple(scales.shape)}"
        )
    scale = ue8m0_to_float(scales)
    return (values.unflatten(-1, (groups, block)) * scale.unsqueeze(-1)).flatten(-2)


def dequantize_e4m3(values: torch.Tensor, scales: torch.Tensor, block: int = SCALE_BLOCK) -> torch.Tensor:
    """FP8 e4m3 values float8_e4m3fn [..., D] with UE8M0 scales [..., D/block] (float8_e8m0fnu or
    exponent bytes uint8) -> fp32 [..., D].

    Exact: an e4m3 value times a power of two is representable in fp32 while it stays inside fp32's
    range; scale byte 255 (e8m0 NaN) gives NaN. Raises ValueError on a wrong dtype or scale shape.
    """
    if values.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequantize_e4m3: expected float8_e4m3fn values, got {values.dtype}")
    return _apply_block_scales(values.float(), scales, block, "dequantize_e4m3")


def dequantize_e2m1(packed: torch.Tensor, scales: torch.Tensor, block: int = SCALE_BLOCK) -> torch.Tensor:
    """Packed FP4 e2m1 pairs [..., D/2] (int8, uint8 or float4_e2m1fn_x2; even element in the low
    nibble) with UE8M0 scales [..., D/block] -> fp32 [..., D].

    Exact while the result stays inside fp32's range; scale byte 255 (e8m0 NaN) gives NaN. Raises
    ValueError on a wrong dtype or scale shape.
    """
    if packed.dtype not in PACKED_FP4_DTYPES:
        raise ValueError(f"dequantize_e2m1: expected packed e2m1 bytes {PACKED_FP4_DTYPES}, got {packed.dtype}")
    if packed.dtype == torch.float4_e2m1fn_x2:
        packed = packed.view(torch.uint8)
    # the 16-entry table is computed, not a tensor literal: a tensor constant cannot appear inside a
    # decomposition that the cpu lowering traces
    table = _e2m1_decode(torch.arange(16, device=packed.device))
    values = table[unpack_fp4(packed).long()]
    return _apply_block_scales(values, scales, block, "dequantize_e2m1")


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (integer dtype, 0..15) -> fp32 from the bit fields (exponent bias 1, one mantissa
    bit); equal to `fp4_codes_to_float`, -0 included."""
    c = codes.to(torch.int32)
    exp, mant = (c >> 1) & 0x3, (c & 0x1).float()
    normal = torch.pow(2.0, (exp - 1).float()) * (1.0 + 0.5 * mant)
    magnitude = torch.where(exp > 0, normal, 0.5 * mant)
    return torch.where((c & 0x8) != 0, -magnitude, magnitude)
