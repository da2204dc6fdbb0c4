"""Storage codecs shared by the kernels and the model: FP4 e2m1 codes, nibble packing, UE8M0 scales.

These are pure bit-level encodings with no rounding decision in them; the quantizers that choose
codes and scales live in `dsneuron.graphs.quant`. They sit here because `kernels_nki` may not import
`graphs` (the dependency rule in DESIGN.md), while both sides must read the same bytes.

Sources: DeepGEMM deep_gemm/utils/math.py (nibble order, UE8M0 bytes), DeepSeek-V4-Flash
inference/convert.py cast_e2m1fn_to_e4m3fn (e2m1 code table); see reference/kernel_numerics.md B.5.
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
    """How graphs spell the ops that the neuron target's XLA bridge cannot run on the device:
    torch's float8 casts, bit views (`view(dtype)`) and copysign (`xla` False: the cpu target and
    the eager golden), or integer and fp32 arithmetic on the bytes (`xla` True, inside
    `xla_spelling`: the neuron target). torch-xla 2.9 has no float8 types and runs
    `view_copy.dtype`, `signbit` and `copysign` on the host, which executes the graph so far and
    cuts it; trn1/trn2 have no OCP e4m3fn either. Both spellings give the same values
    (tests/test_quant.py checks every byte and every bf16 pattern)."""

    xla: bool = False


SPELLING = _Spelling()


@contextlib.contextmanager
def xla_spelling() -> Iterator[None]:
    """Within this context `e4m3_to_float`, `e4m3_round`, `ue8m0_to_float`, `as_uint8`, `pow2` users,
    `signbit` and `copysign` use integer/fp32 arithmetic and take FP8 data as uint8 bytes, so a traced graph
    holds no float8 dtype and no bit view."""
    prev = SPELLING.xla
    SPELLING.xla = True
    try:
        yield
    finally:
        SPELLING.xla = prev


_E4M3_SUBNORMAL_STEP = 2.0**-9
#: 2^e for e = -126..127 (all fp32 normals), indexed by e + 126 (`pow2`)
_POW2 = tuple(2.0**e for e in range(-126, 128))


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """One-byte data [...] (uint8, int8 or a float8/float4 dtype) as its uint8 bytes [...]. Under
    `xla_spelling` an int8 tensor is masked (`& 0xFF`) instead of bit-viewed: torch-xla 2.9 runs
    `view(dtype)` on the host (aten::view_copy.dtype is a CPU fallback, which cuts the graph)."""
    if t.dtype == torch.uint8:
        return t
    if SPELLING.xla and t.dtype == torch.int8:
        return (t.to(torch.int32) & 0xFF).to(torch.uint8)
    return t.view(torch.uint8)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 [...] for integer e in [-126, 127] (int32 [...]), exactly: one gather from the
    table of the 254 normal powers of two (no bit view, see `as_uint8`; no pow, whose device
    implementation need not be exact)."""
    table = torch.tensor(_POW2, dtype=torch.float32, device=e.device)
    return table[(e + 126).long()]


def signbit(x: torch.Tensor) -> torch.Tensor:
    """torch.signbit(x) (bool [...]); under `xla_spelling` as x < 0 or x == -0.0 (1/x = -inf),
    which XLA runs on the device. NaN signs are not distinguished there."""
    if not SPELLING.xla:
        return torch.signbit(x)
    return (x < 0) | ((x == 0) & (1.0 / x < 0))


def copysign(mag: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """torch.copysign(mag, sign) for mag >= 0; under `xla_spelling` a select on `signbit`."""
    if not SPELLING.xla:
        return torch.copysign(mag, sign)
    return torch.where(signbit(sign), -mag, mag)


def e4m3_to_float(x: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3fn data [...] (float8_e4m3fn, or its bytes as uint8) -> fp32 [...], exact.

    Under `xla_spelling` the bytes are decoded from their bit fields with integer ops and one
    exact int -> fp32 conversion: sign, 4-bit exponent e (bias 7), 3-bit mantissa m; the value is
    (8 + m) * 2^(e - 10) for e > 0 and m * 2^-9 for e = 0 (subnormal); S.1111.111 is NaN.
    Raises ValueError for another dtype. Source: OCP 8-bit floating point spec v1.0 (E4M3).
    """
    if x.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"e4m3_to_float: expected float8_e4m3fn or uint8 bytes, got {x.dtype}")
    if not SPELLING.xla:
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

    A codec, not a quantizer: the values are already rounded (`e4m3_round`). Under `xla_spelling`
    the bit fields are built with exact fp32/int arithmetic: below 2^-6 the subnormal code
    |x| * 2^9, above it exponent field k + 7 and mantissa |x| / 2^(k-3) - 8 for the binade
    2^k <= |x| < 2^(k+1); bit 7 is the sign (-0.0 gives 0x80), NaN gives 0x7F.
    Raises ValueError unless x is fp32. Source: OCP 8-bit floating point spec v1.0 (E4M3).
    """
    if x.dtype != torch.float32:
        raise ValueError(f"e4m3_to_bytes: expected float32, got {x.dtype}")
    if not SPELLING.xla:
        return x.to(torch.float8_e4m3fn).view(torch.uint8)
    mag = x.abs()
    k = _e4m3_binade(mag)
    normal = ((k + 7) << 3) + (mag / pow2(k - 3)).to(torch.int32) - 8
    code = torch.where(mag < 2.0**-6, (mag * 512.0).to(torch.int32), normal)
    code = torch.where(mag.isnan(), 0x7F, code)
    return (code + 0x80 * signbit(x).to(torch.int32)).to(torch.uint8)


def ue8m0_to_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Exact powers of two fp32 [...] in [2^-126, 2^127] -> their UE8M0 exponent bytes uint8 [...]
    (log2 of an exact power of two, rounded: no bit view, so the xla spelling runs it too)."""
    return (torch.log2(scale).round().to(torch.int32) + 127).to(torch.uint8)


def _e4m3_binade(mag: torch.Tensor) -> torch.Tensor:
    """int32 k = floor(log2 mag) for mag fp32 >= 0, held in the e4m3 range [-6, 8] (below 2^-6 the
    subnormal quantum 2^-9 applies; NaN gives 8), corrected by exact comparisons with `pow2`
    (log2 may be an ulp off next to a power of two)."""
    k = torch.floor(torch.log2(mag)).clamp(-6, 8)
    k = torch.where(mag.isnan(), 8.0, k).to(torch.int32)
    k = torch.where((k > -6) & (pow2(k) > mag), k - 1, k)
    return torch.where((k < 8) & (pow2(k + 1) <= mag), k + 1, k)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 [...] with |x| <= 448 (or NaN) -> fp32 [...] on the e4m3fn grid, round to nearest, ties
    to even: `x.to(float8_e4m3fn).float()`.

    Under `xla_spelling`, in fp32 arithmetic without bit views: the quantum q of |x|'s binade
    (2^(k-3) in [2^k, 2^(k+1)) for k = -6..8, the subnormal step 2^-9 below 2^-6) comes from
    log2 corrected by exact comparisons with `pow2`, then round-half-even(x / q) * q, where both
    scalings are exact. The sign is kept (-0.0 stays -0.0); NaN stays NaN (its payload may
    differ). Callers clamp first (`graphs.quant.e4m3_rne`), so no overflow rule is needed.
    Raises ValueError unless x is fp32.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"e4m3_round: expected float32, got {x.dtype}")
    if not SPELLING.xla:
        return x.to(torch.float8_e4m3fn).float()
    quantum = pow2(_e4m3_binade(x.abs()) - 3)
    return torch.round(x / quantum) * quantum


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 e2m1 values as fp32 [16], indexed by code."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def pack_fp4_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Pack e2m1 codes [..., K] (integer dtype, values 0..15, K even) into uint8 [..., K/2].

    Byte i holds code 2i in its low nibble and code 2i+1 in its high nibble. No bit view, so it
    runs under the xla spelling too. Raises ValueError when K is odd.
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
    if SPELLING.xla:  # no bit view (see `as_uint8`): 2^(byte - 127) built by `pow2`
        out = pow2((scale.to(torch.int32) - 127).clamp(-126, 127))  # bytes 0 and 255: fixed below
    else:
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
