"""FP8 e4m3fn, FP4 e2m1 and UE8M0 number formats of DeepSeek-V4.1: quantizers, quantize-dequantize
(QDQ) ops, checkpoint weight codecs and the block-scaled GEMM reference.

Numerics follow the official V4.1 inference code. Its `model.py` shows where each op is used
(deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py `linear`, `Attention._window_kv`,
`Attention._compress_kv`, `Indexer.forward`). Its `kernel.py` is not public, so the kernel bodies come
from docs/numerics.md "Number formats" and "The forward pass", cross-checked against the TileLang kernels
of deepseek-ai/DeepSeek-V4-Pro:inference/kernel.py (`fast_round_scale`, `act_quant_kernel`,
`fp4_quant_kernel`). The DeepGEMM conventions come from docs/numerics.md "Kernel tests: edge cases and tolerances". All
arithmetic is fp32, as in the kernels. The storage codecs (nibble packing, e2m1 table, UE8M0
bytes) live in `dsneuron.kernels_nki.formats`.

Decisions the sources leave open, and why:
- UE8M0 ratio: the ratio is the product `amax * fp32(1/448)` (or `* fp32(1/6)`), because
  the kernels multiply by the reciprocal constant (`fast_round_scale(amax, fp8_max_inv)`). An
  exhaustive check over one binade, pinned by a test, shows that the power-of-two ceiling of this
  product never differs from the ceiling of `amax/448` or `amax/6`.
- E4M3 scale of the compressed KV: `e4m3_rne(amax / 6)` uses a true division, as the arch doc
  writes. Here the choice matters. For one amax mantissa per binade (amax = 7.1249995 * 2^k) the
  product would round to the tie 1.1875 and then up to 1.25, while the quotient rounds to 1.125.
- UE8M0 clamp: the exponent byte is clamped to [1, 254] as DeepGEMM `ceil_to_ue8m0` clamps it.
  The amax floors of every caller keep the ratio in [2^-126, 2^126], so the clamp never changes a
  number of the model. It only makes `ue8m0_scale` total: 0, subnormal, inf and NaN ratios give a
  finite normal power of two that e8m0 can store. The TileLang kernel has no clamp, so there such
  ratios give 0 or inf.
- -0 in e2m1: a negative value that rounds to zero keeps its sign and is stored as code 8. The
  reference casts with the hardware fp32 -> e2m1 conversion (`T.Cast(FP4, ...)`, as does
  ml_dtypes), which keeps the sign, so the reference QDQ yields -0.0. Code 8 reproduces that bit
  for bit. DeepGEMM's packer writes 0x0 instead; see `fp4_quantize_rtz`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsneuron.kernels_nki.formats import (
    E2M1_MAX,
    E4M3_MAX,
    as_uint8,
    e4m3_round,
    e4m3_to_bytes,
    e4m3_to_float,
    float_to_ue8m0,
    fp4_codes_to_float,
    pack_fp4,
    pack_fp4_bytes,
    ue8m0_to_bytes,
    ue8m0_to_float,
    unpack_fp4,
)

#: FP4 expert weights carry one UE8M0 scale per 32 consecutive K elements (V4 and V4.1).
FP4_WEIGHT_BLOCK = 32

# Activation amax floor (act_quant_kernel): keeps the FP8 scale away from 0 for all-zero blocks.
_FP8_AMAX_FLOOR = 1e-4
# FP4 amax floors (fp4_quant_kernel; arch doc section 2). 6 * 2^-126 puts the UE8M0 ratio at
# 2^-126, the smallest normal fp32 (byte 1). 6 * 2^-9 puts the E4M3 scale at 2^-9, the smallest
# e4m3 subnormal, so that scale is never 0.
_FP4_UE8M0_AMAX_FLOOR = 6 * 2.0**-126
_FP4_E4M3_AMAX_FLOOR = 6 * 2.0**-9
# Multiplying an fp32 tensor by a Python float rounds the float to fp32 first, so these are the
# kernels' fp32 constants `fp8_max_inv` and `fp4_max_inv`.
_INV_E4M3_MAX = 1.0 / E4M3_MAX
_INV_E2M1_MAX = 1.0 / E2M1_MAX
# DeepGEMM per_token_cast_to_fp4 picks a code by counting the thresholds that |v| exceeds.
_RTZ_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_SCALE_FMTS = ("ue8m0", "e4m3")
_PACKED_FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)

# fp32 holds these dtypes exactly. A wider input (fp64) would be rounded twice: once to fp32 and
# again to the 8- or 4-bit grid.
_EXACT_IN_FP32 = (torch.float32, torch.bfloat16, torch.float16)


def _as_fp32(x: torch.Tensor, fn: str, name: str = "x") -> torch.Tensor:
    if x.dtype not in _EXACT_IN_FP32:
        raise ValueError(f"{fn}: {name} must be float32, bfloat16 or float16, got {x.dtype}")
    return x.float()


def _check_blocks(x: torch.Tensor, block: int, fn: str) -> None:
    if block <= 0:
        raise ValueError(f"{fn}: block size must be positive, got {block}")
    if x.dim() == 0 or x.shape[-1] % block:
        last = x.shape[-1] if x.dim() else "none (0-d tensor)"
        raise ValueError(f"{fn}: last dim must be a multiple of the block size {block}, got {last}")


def _scale_blocks(values: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """values [..., K] * scale [..., K/block], one scale per contiguous block -> [..., K]."""
    return (values.unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2)


def e4m3_rne(x: torch.Tensor) -> torch.Tensor:
    """Round to the FP8 e4m3fn grid: round to nearest, ties to even, saturating at +-448.

    x: [...] float32/bfloat16/float16. Returns fp32 [...] holding e4m3fn values. The clamp runs
    before the cast, like the kernels' `T.clamp(..., fp8_min, fp8_max)` before `T.Cast(FP8, ...)`.
    So +-inf become +-448, -0.0 stays -0.0, and NaN stays NaN.
    Raises ValueError for any other dtype.
    Source: docs/numerics.md "The forward pass" ("e4m3_rne(clamp(x/s, -448, 448))").
    """
    xf = _as_fp32(x, "e4m3_rne")
    # torch's CPU cast happens to saturate as well. ml_dtypes, and casts on other backends, give NaN
    # above 464, so the clamp is what pins the reference semantics.
    return e4m3_round(xf.clamp(-E4M3_MAX, E4M3_MAX))


def _ue8m0_exponent(ratio: torch.Tensor) -> torch.Tensor:
    """Biased exponent of the power-of-two ceiling of fp32 `ratio`, clamped to [1, 254]; int32."""
    bits = ratio.view(torch.int32)
    ceil = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ceil.clamp(1, 254)


def ue8m0_scale(ratio: torch.Tensor) -> torch.Tensor:
    """Round a positive fp32 ratio up to a power of two (a UE8M0 scale), using only its exponent bits.

    ratio: fp32 [...]. Returns fp32 [...]: 2^(b - 127) with b = exponent byte + (mantissa != 0),
    clamped to [1, 254] (DeepGEMM `ceil_to_ue8m0`; the module docstring says why). An exact power
    of two maps to itself; one ulp above maps to the next power of two. The sign bit is ignored.
    The clamp sends 0 and fp32 subnormals to 2^-126, and inf and NaN to 2^127.
    Raises ValueError unless ratio is float32, since a rounded ratio would round up differently.
    Source: DeepSeek-V4-Pro:inference/kernel.py `fast_log2_ceil`/`fast_pow2`; docs/numerics.md "Kernel tests: edge cases and tolerances".
    """
    if ratio.dtype != torch.float32:
        raise ValueError(f"ue8m0_scale: ratio must be float32, got {ratio.dtype}")
    return (_ue8m0_exponent(ratio) << 23).view(torch.float32)


def _fp8_block_scale(amax: torch.Tensor) -> torch.Tensor:
    return ue8m0_scale(amax.clamp_min(_FP8_AMAX_FLOOR) * _INV_E4M3_MAX)


def act_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 activation quantization with one UE8M0 scale per `block` contiguous elements of the last dim.

    Per block: amax = max(|x|) floored at 1e-4, s = ue8m0_scale(amax * fp32(1/448)) and
    q = e4m3 RNE of clamp(x / s, -448, 448). V4.1 uses block 32; V4 uses block 128.
    x: [..., K] float32/bfloat16/float16. Returns (q float8_e4m3fn [..., K], s fp32 [..., K/block]).
    Raises ValueError if K % block != 0 or the dtype is not one of those three.
    Source: DeepSeek-V4.1-Flash:inference/model.py `linear` (act_quant with fp8_block_size and ue8m0);
    the kernel per docs/numerics.md "The forward pass" and DeepSeek-V4-Pro:inference/kernel.py
    `act_quant_kernel`.
    """
    q, s = act_quant_values(x, block, "act_quant")
    return q.to(torch.float8_e4m3fn), s


def act_quant_values(x: torch.Tensor, block: int = 32, fn: str = "act_quant_values") -> tuple[torch.Tensor, torch.Tensor]:
    """`act_quant` with q as its fp32 values (the e4m3 grid), which is what every GEMM input and
    QDQ uses: under kernels_nki.formats.neuron_spelling the rounding is int32/fp32 arithmetic, so
    the graph holds no float8 dtype. Returns (q fp32 [..., K], s fp32 [..., K/block])."""
    _check_blocks(x, block, fn)
    xb = _as_fp32(x, fn).unflatten(-1, (-1, block))
    s = _fp8_block_scale(xb.abs().amax(-1, keepdim=True))
    q = e4m3_round((xb / s).clamp(-E4M3_MAX, E4M3_MAX))
    return q.flatten(-2), s.squeeze(-1)


def act_quant_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 quantize-dequantize in place of x: float(q) * s cast back to x.dtype.

    This is `act_quant(..., inplace=True)` of the reference, which QDQs the V4.1 window KV.
    The values do go through FP8. The first public V4 kernel skipped that rounding, a bug.
    x: [..., K] float32/bfloat16/float16. Returns x.dtype [..., K]. Raises ValueError as `act_quant`.
    Source: DeepSeek-V4.1-Flash:inference/model.py `Attention._window_kv`; docs/numerics.md
    section 2 (the inplace caveat).
    """
    q, s = act_quant_values(x, block, "act_quant_qdq")
    return _scale_blocks(q, s, block).to(x.dtype)


def _fp4_block_scale(amax: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    if scale_fmt == "ue8m0":
        return ue8m0_scale(amax.clamp_min(_FP4_UE8M0_AMAX_FLOOR) * _INV_E2M1_MAX)
    return e4m3_rne(amax.clamp_min(_FP4_E4M3_AMAX_FLOOR) / E2M1_MAX)


def _fp4_scaled(x: torch.Tensor, block: int, scale_fmt: str, fn: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (clamp(x/s, -6, 6) fp32 [..., K/block, block], s fp32 [..., K/block, 1])."""
    if scale_fmt not in _FP4_SCALE_FMTS:
        raise ValueError(f"{fn}: scale_fmt must be one of {_FP4_SCALE_FMTS}, got {scale_fmt!r}")
    _check_blocks(x, block, fn)
    xb = _as_fp32(x, fn).unflatten(-1, (-1, block))
    s = _fp4_block_scale(xb.abs().amax(-1, keepdim=True), scale_fmt)
    return (xb / s).clamp(-E2M1_MAX, E2M1_MAX), s


def _e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """v fp32 in [-6, 6] -> nearest e2m1 value. Ties go to the even code, and the sign is kept, so
    negatives that round to zero give -0.0.

    The e2m1 grid has step 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]. torch.round breaks ties to even,
    so within each step the tie lands on an even multiple of the step, that is on an even code.
    """
    a = v.abs()
    r = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(r, v)


def _e2m1_encode(r: torch.Tensor) -> torch.Tensor:
    """Exact e2m1 values (signed, -0.0 included) -> codes uint8 (bit 3 = sign)."""
    a = r.abs()
    magnitude = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a / 2 + 4))
    return (magnitude + 8 * torch.signbit(r)).to(torch.uint8)


def fp4_quantize(x: torch.Tensor, block: int = 32, scale_fmt: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 e2m1 quantization with one scale per `block` contiguous elements of the last dim.

    scale_fmt "ue8m0" (indexer q/k and FP4 expert weights, block 32): amax floored at 6 * 2^-126,
    s = ue8m0_scale(amax * fp32(1/6)). scale_fmt "e4m3" (V4.1 compressed KV, block 16): amax
    floored at 6 * 2^-9, s = e4m3_rne(amax / 6). That s is not a power of two, and it can round
    below amax/6, so clamping at +-6 can saturate.
    Values: v = clamp(x / s, -6, 6), rounded to the nearest e2m1 value, ties to the even code:
    .25 -> 0, .75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    Codes: bit 3 is the sign. A negative value that rounds to 0, and -0.0 itself, give code 8
    (see the module docstring).
    x: [..., K] float32/bfloat16/float16. Returns (codes uint8 [..., K] in 0..15, s fp32 [..., K/block]).
    Raises ValueError if K % block != 0, the dtype is wrong or scale_fmt is unknown.
    Source: DeepSeek-V4.1-Flash:inference/model.py `Indexer.forward` and `Attention._compress_kv`
    (fp4_act_quant); the kernel per docs/numerics.md "The forward pass" and
    DeepSeek-V4-Pro:inference/kernel.py `fp4_quant_kernel`.
    """
    v, s = _fp4_scaled(x, block, scale_fmt, "fp4_quantize")
    return _e2m1_encode(_e2m1_round(v)).flatten(-2), s.squeeze(-1)


def fp4_act_quant_qdq(x: torch.Tensor, block: int = 32, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """FP4 quantize-dequantize in place of x: e2m1 value * s cast back to x.dtype.

    This is `fp4_act_quant(..., inplace=True)` of the reference. V4.1 uses block 32 with "ue8m0"
    scales for the indexer q and k, and block 16 with "e4m3" scales for the compressed KV.
    The quantizer is `fp4_quantize`.
    x: [..., K] float32/bfloat16/float16. Returns x.dtype [..., K]. Raises ValueError as `fp4_quantize`.
    Source: DeepSeek-V4.1-Flash:inference/model.py `Indexer.forward`, `Attention._compress_kv`.
    """
    v, s = _fp4_scaled(x, block, scale_fmt, "fp4_act_quant_qdq")
    return (_e2m1_round(v) * s).flatten(-2).to(x.dtype)


def fp4_operand_bytes(v: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4-QDQ'd values as the operand bytes of the FP4 MQA-logits op.

    v: [..., K] fp32/bf16, the output of `fp4_act_quant_qdq(x, block, "ue8m0")` (every block of
    `block` elements is e2m1 values times one power of two). Returns (packed e2m1 uint8 [..., K/2],
    even element in the low nibble; UE8M0 exponent bytes uint8 [..., K/block]) that decode to v
    exactly, -0.0 included: `fp4_quantize` is idempotent on its own output, since amax * fp32(1/6)
    of a QDQ'd block rounds to the block's own power of two (tests/test_indexer_kernel.py checks
    every code at every scale). The byte is the scale's biased exponent field.
    Raises ValueError as `fp4_quantize`.
    Source: the operand format of DeepGEMM fp8_fp4_mqa_logits (csrc/apis/attention.hpp).
    """
    codes, s = fp4_quantize(v, block, "ue8m0")
    return pack_fp4_bytes(codes), ue8m0_to_bytes(s)


@dataclass(frozen=True)
class StateFormat:
    """How a decode-state cache stores one row of K values: `elem` codes ("e4m3": one byte each;
    "e2m1": two per byte, even element in the low nibble), then one `scale` byte per `block`
    elements ("ue8m0": the exponent byte; "e4m3": the e4m3fn byte), so a row is
    `row_bytes(K)` uint8 [codes | scales], the per-token layout of FlashMLA's FP8 KV cache and
    of DeepGEMM's paged MQA-logits cache (DeepGEMM csrc/apis/attention.hpp). The quantizer is the reference's QDQ of
    that cache, so decoding a row gives exactly the QDQ'd values the bf16 state held.
    Source: DeepSeek-V4.1-Flash:inference/model.py `Attention._window_kv` (FP8, UE8M0 per
    fp8_block_size), `Attention._compress_kv` (FP4, e4m3 per 16), `Indexer.forward` (FP4, UE8M0
    per 32)."""

    elem: str
    block: int
    scale: str

    def code_bytes(self, K: int) -> int:
        """Bytes of a row's codes."""
        return K if self.elem == "e4m3" else K // 2

    def row_bytes(self, K: int) -> int:
        """Bytes of a row of K values: codes, then K / block scale bytes."""
        return self.code_bytes(K) + K // self.block


#: the compressed KV and the indexer keys (model.py `Attention._compress_kv`, `Indexer.forward`);
#: the window KV's block is the config's fp8_block_size (`window_format`)
COMPRESS_KV_FORMAT = StateFormat("e2m1", 16, "e4m3")
INDEX_K_FORMAT = StateFormat("e2m1", 32, "ue8m0")


def window_format(fp8_block_size: int) -> StateFormat:
    """The window KV's format: FP8 e4m3 with one UE8M0 scale per fp8_block_size (model.py `_window_kv`)."""
    return StateFormat("e4m3", fp8_block_size, "ue8m0")


def quantize_state(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """x [..., K] float32/bfloat16 (before its QDQ) -> uint8 [..., fmt.row_bytes(K)]: the codes and
    scales that `act_quant_qdq(x, block)` ("e4m3") or `fp4_act_quant_qdq(x, block, scale)`
    ("e2m1") round x to, so `dequantize_state` of the result equals that QDQ bit for bit.
    Raises ValueError as those quantizers do."""
    if fmt.elem == "e4m3":
        q, s = act_quant_values(x, fmt.block, "quantize_state")
        codes = e4m3_to_bytes(q)
    else:
        codes, s = fp4_quantize(x, fmt.block, fmt.scale)
        codes = pack_fp4_bytes(codes)
    scales = ue8m0_to_bytes(s) if fmt.scale == "ue8m0" else e4m3_to_bytes(s)
    return torch.cat([codes, scales], dim=-1)


def dequantize_state(b: torch.Tensor, K: int, fmt: StateFormat) -> torch.Tensor:
    """uint8 [..., fmt.row_bytes(K)] (`quantize_state`) -> fp32 [..., K], exact. A fresh (all-zero)
    row decodes to +0.0. Raises ValueError when the last dim is not fmt.row_bytes(K)."""
    if b.dtype != torch.uint8 or b.shape[-1] != fmt.row_bytes(K):
        raise ValueError(f"dequantize_state: expected uint8 rows of {fmt.row_bytes(K)} bytes for K = {K}, "
                         f"got {b.dtype} {tuple(b.shape)}")
    n = fmt.code_bytes(K)
    codes, scales = b[..., :n], b[..., n:]
    # e2m1: one gather through the byte -> (low, high) value table, as `dequant_fp4_weight`
    values = e4m3_to_float(codes) if fmt.elem == "e4m3" else _fp4_byte_table(b.device)[codes.long()].flatten(-2)
    s = ue8m0_to_float(scales) if fmt.scale == "ue8m0" else e4m3_to_float(scales)
    return _scale_blocks(values, s, fmt.block)


def fp4_quantize_rtz(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's FP4 quantizer (`per_token_cast_to_fp4`), whose ties round toward zero. A named
    variant for kernels that must match DeepGEMM bytes. It is NOT the V4.1 reference rounding,
    which is `fp4_quantize`.

    Per block: amax floored at 1e-4, s = ue8m0_scale(amax / 6). The code of v = x / s counts how
    many of {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5} |v| exceeds: .75 -> .5, 1.75 -> 1.5, 2.5 -> 2,
    3.5 -> 3, 5 -> 4, and above 6 saturates at code 7. The sign bit is set only for a nonzero
    code, so -0 and small negatives give code 0.
    x: [..., K] float32/bfloat16/float16. Returns (codes uint8 [..., K], s fp32 [..., K/block]).
    Raises ValueError if K % block != 0 or the dtype is wrong.
    Source: docs/numerics.md "Kernel tests: edge cases and tolerances" (DeepGEMM deep_gemm/utils/math.py).
    """
    _check_blocks(x, block, "fp4_quantize_rtz")
    xb = _as_fp32(x, "fp4_quantize_rtz").unflatten(-1, (-1, block))
    s = ue8m0_scale(xb.abs().amax(-1, keepdim=True).clamp_min(_FP8_AMAX_FLOOR) / E2M1_MAX)
    v = xb / s
    thresholds = torch.tensor(_RTZ_THRESHOLDS, dtype=torch.float32, device=x.device)
    magnitude = (v.abs().unsqueeze(-1) > thresholds).sum(-1)
    codes = magnitude + 8 * ((v < 0) & (magnitude > 0))
    return codes.to(torch.uint8).flatten(-2), s.squeeze(-1)


def quantize_fp8_weight(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to FP8 e4m3fn with one UE8M0 scale per block x block tile (the checkpoint layout).

    Per tile: amax floored at 1e-4, s = ue8m0_scale(amax * fp32(1/448)), q = e4m3 RNE of clamp(w / s).
    A ragged last tile (N or K not a multiple of block) uses only its real elements.
    w: [N, K] float32/bfloat16/float16. Returns (float8_e4m3fn [N, K],
    float8_e8m0fnu [ceil(N/block), ceil(K/block)]).
    Raises ValueError for a non-2-D weight, a wrong dtype or a non-positive block.
    Source: docs/numerics.md "Number formats" (F8_E4M3 weights with F8_E8M0 32x32 scales in
    V4.1); the quantizer of DeepSeek-V4-Pro:inference/kernel.py `fp8_weight_quant_kernel` with
    round_scale.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_weight: weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    if block <= 0:
        raise ValueError(f"quantize_fp8_weight: block size must be positive, got {block}")
    wf = _as_fp32(w, "quantize_fp8_weight", "w")
    n, k = wf.shape
    nb, kb = -(-n // block), -(-k // block)
    # zero padding cannot raise a tile's amax, so ragged tiles see only their real elements
    tiles = torch.nn.functional.pad(wf, (0, kb * block - k, 0, nb * block - n)).view(nb, block, kb, block)
    s = _fp8_block_scale(tiles.abs().amax(dim=(1, 3), keepdim=True))
    q = (tiles / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(nb * block, kb * block)[:n, :k].contiguous(), float_to_ue8m0(s.reshape(nb, kb))


def dequant_fp8_weight(w: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 block-scaled weight -> fp32: W[n, k] = float(w[n, k]) * scale[n // block, k // block].

    w: float8_e4m3fn [N, K]; scale: float8_e8m0fnu [ceil(N/block), ceil(K/block)] (either may be
    given as its uint8 bytes, as the neuron lowering passes them). Returns fp32
    [N, K]. The result is exact: an e4m3 value times a power of two is an fp32 value. The one
    exception is overflow, which needs weights within 7% of the fp32 maximum.
    Raises ValueError for a wrong dtype or shape. An e8m0 NaN byte (255) dequantises to NaN; no
    data-dependent check happens here, so loaders that must refuse NaN scales check the bytes first.
    Source: docs/numerics.md "Number formats" (FP8 weight dequant).
    """
    if w.dtype not in (torch.float8_e4m3fn, torch.uint8) or w.dim() != 2:
        raise ValueError(f"dequant_fp8_weight: w must be 2-D float8_e4m3fn (or its uint8 bytes), got {w.dtype} {tuple(w.shape)}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"dequant_fp8_weight: scale must be float8_e8m0fnu (or its uint8 bytes), got {scale.dtype}")
    n, k = w.shape
    expected = (-(-n // block), -(-k // block))
    if tuple(scale.shape) != expected:
        raise ValueError(f"dequant_fp8_weight: scale shape must be {expected} for w {(n, k)} and block {block}, "
                         f"got {tuple(scale.shape)}")
    s = ue8m0_to_float(scale)
    if n % block == 0 and k % block == 0:  # broadcast instead of materialising the expanded scales
        return (e4m3_to_float(w).view(n // block, block, k // block, block) * s[:, None, :, None]).view(n, k)
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return e4m3_to_float(w) * s


def quantize_fp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize an expert weight to packed FP4 e2m1 with one UE8M0 scale per 32 K elements (the
    checkpoint layout).

    The quantizer is `fp4_quantize(w, 32, "ue8m0")`. The codes are packed two per byte, the even
    element in the low nibble (`kernels_nki.formats.pack_fp4`).
    w: [N, K] float32/bfloat16/float16 with K % 32 == 0. Returns (int8 [N, K/2], float8_e8m0fnu [N, K/32]).
    Raises ValueError for a non-2-D weight, K % 32 != 0 or a wrong dtype.
    Source: docs/numerics.md "Number formats" (FP4 expert weight layout);
    DeepSeek-V4.1-Flash:inference/model.py `Linear` (scale [out, in // fp4_block_size]).
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp4_weight: weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    codes, s = fp4_quantize(w, FP4_WEIGHT_BLOCK, "ue8m0")
    return pack_fp4(codes), float_to_ue8m0(s)


def dequant_fp4_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed FP4 expert weight -> fp32: W[n, k] = e2m1(code[n, k]) * scale[n, k // 32].

    w: int8, uint8 or float4_e2m1fn_x2 [N, K/2], or a stack of experts [E, N, K/2] (even element in
    the low nibble). The checkpoint
    stores int8; the reference model holds float4_e2m1fn_x2. scale: float8_e8m0fnu [N, K/32].
    Returns fp32 [N, K]. The result is exact, since an e2m1 value times a power of two is an fp32
    value. Raises ValueError for a wrong dtype or shape. An e8m0 NaN byte (255) gives NaN, as in
    `dequant_fp8_weight`.
    Source: docs/numerics.md "Number formats"; DeepSeek-V4-Flash inference/convert.py
    cast_e2m1fn_to_e4m3fn (code table).
    """
    if w.dtype not in _PACKED_FP4_DTYPES or w.dim() not in (2, 3):
        raise ValueError(f"dequant_fp4_weight: w must be [N, K/2] or stacked [E, N, K/2] int8, uint8 or "
                         f"float4_e2m1fn_x2, got {w.dtype} {tuple(w.shape)}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"dequant_fp4_weight: scale must be float8_e8m0fnu (or its uint8 bytes), got {scale.dtype}")
    lead, k = tuple(w.shape[:-1]), 2 * w.shape[-1]
    if k % FP4_WEIGHT_BLOCK or tuple(scale.shape) != (*lead, k // FP4_WEIGHT_BLOCK):
        raise ValueError(f"dequant_fp4_weight: for w {tuple(w.shape)} (K = {k}, a multiple of "
                         f"{FP4_WEIGHT_BLOCK}) scale must be {(*lead, k // FP4_WEIGHT_BLOCK)}, got {tuple(scale.shape)}")
    # one gather through a byte -> (low, high) value table instead of nibble arithmetic: the
    # decode step dequantises every routed expert, so this is on the hot path
    values = _fp4_byte_table(w.device)[as_uint8(w).long()].flatten(-2)
    return _scale_blocks(values, ue8m0_to_float(scale), FP4_WEIGHT_BLOCK)


def _fp4_byte_table(device: torch.device) -> torch.Tensor:
    """fp32 [256, 2]: the e2m1 values of a packed byte's low (even) and high (odd) nibble."""
    codes = unpack_fp4(torch.arange(256, dtype=torch.int32).to(torch.uint8)).view(256, 2)
    return fp4_codes_to_float(codes).to(device)


#: How a block-scaled GEMM sums its K blocks (see `block_scaled_matmul`).
GEMM_ORDERS = ("ascending", "descending", "fused")

#: Working-set budget of one chunk of rows of a float64 GEMM (the golden's exact partials).
_EXACT_CHUNK_BYTES = 256 << 20


def _check_order(order: str, fn: str) -> None:
    if order not in GEMM_ORDERS:
        raise ValueError(f"{fn}: order must be one of {GEMM_ORDERS}, got {order!r}")


def _chunk_rows(bytes_per_row: int) -> int:
    """Rows per chunk so that one chunk's float64 working set stays within _EXACT_CHUNK_BYTES
    (callers loop over range(0, max(rows, 1), step), so zero rows still make one empty chunk)."""
    return max(1, _EXACT_CHUNK_BYTES // max(bytes_per_row, 1))


def _sum_blocks(partials: torch.Tensor, order: str) -> torch.Tensor:
    """fp32 partials [KB, ...] -> fp32 [...]: 0 + p_0 + p_1 + ... (ascending) or from the last
    block down (descending), one rounding per add; an explicit loop pins the order."""
    blocks = partials.unbind(0)  # views: no copy of the partials for either order
    return add_blocks(partials.new_zeros(partials.shape[1:]), blocks[::-1] if order == "descending" else blocks)


def exact_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x [..., K], w [N, K]) -> fp32 [..., N], summed in float64 and rounded once to fp32.

    For the golden model's plain linears, whose operands are bf16 values (held in bf16, fp32 or
    fp64): every product is exact in fp32 (8 x 8 significant bits), so the float64 sum is exact as
    long as the products of one row span at most 53 - 16 - log2(K) binades, and the result is the
    correctly rounded dot product whatever order the BLAS sums in. That is what makes a row's
    result independent of how many rows share the call, of the ISA and of the BLAS's kernel
    choice. The one linear with an fp32 weight (the mHC `hc_*_fn`) has 32-bit products; there the
    float64 sum can round, and only a row whose exact dot product lies within K float64 ulps of an
    fp32 rounding boundary can come out differently (about one row in 2^26).
    Raises ValueError for other dtypes.
    """
    if x.dtype not in (torch.float32, torch.float64) or w.dtype not in (torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"exact_linear: x must be float32 or float64 and w bfloat16, float32 or float64, "
                         f"got {x.dtype} and {w.dtype}")
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    n = w.shape[0]
    # a weight whose float64 copy exceeds the chunk budget (V4.1's head: 5.3 GB) is taken a slice of
    # its output rows at a time; its values are bf16 ones, so each output is the correctly rounded
    # dot product whatever the slicing (above), and the smaller weights are not sliced at all
    w_step = max(n, 1) if w.dtype == torch.float64 or 8 * n * k <= _EXACT_CHUNK_BYTES else max(1, _EXACT_CHUNK_BYTES // (8 * k))
    cols = []
    for c in range(0, max(n, 1), w_step):
        wd = w[c:c + w_step].double()
        step = _chunk_rows(8 * (k + wd.shape[0]))
        parts = [torch.nn.functional.linear(rows[r:r + step].double(), wd).float() for r in range(0, max(rows.shape[0], 1), step)]
        cols.append(torch.cat(parts) if len(parts) != 1 else parts[0])
    return (torch.cat(cols, dim=-1) if len(cols) != 1 else cols[0]).reshape(*lead, n)


def block_scaled_matmul(a: torch.Tensor, w: torch.Tensor, block: int = 32, order: str = "ascending") -> torch.Tensor:
    """Block-scaled GEMM reference: y = a @ w.T as an fp32 sum of per-K-block partial products.

    a: fp32 [..., K], already dequantised (e4m3 value * its power-of-two scale). w: fp32 or fp64
    [N, K], dequantised (the golden holds float64 copies). Returns fp32 [..., N].
    Each K block's partial (a_blk @ w_blk.T) is computed in float64, where it is exact: within one
    block the scales of a row and of a weight tile are constant, so the products are integers
    times one power of two, below 2^36 in units of the smallest (e4m3 x e4m3), and 32 of them sum
    below 2^41 < 2^53. So the partial is the exact block sum rounded once to fp32, the same
    whatever order the BLAS adds in, which makes every row's result independent of the row count
    and of the host (ISA, BLAS kernel). The partials are added, starting from 0, in ascending block
    order ("ascending", the kernels' order and the golden's) or descending ("descending", which
    measures the numeric floor), one fp32 rounding per add. This equals the kernels'
    `C += (A_k W_k^T) * a_s * w_s` accumulation except for the rounding inside one block, which
    the kernels leave to their tensor cores. Every scale is a power of two, so scaling before the
    per-block product is exact.
    Order "fused" is one fp32 GEMM over the whole K in the library's order (what the compiled
    steps trace): the same exact products summed in another order, a difference of the floor's kind.
    Memory: rows are processed in chunks whose float64 partials take at most 256 MiB.
    Raises ValueError for a non-fp32 `a`, mismatched K, K % block != 0 or an unknown order.
    Source: docs/numerics.md "The forward pass" (fp8_gemm, fp4_gemm); DeepSeek-V4-Pro:inference/
    kernel.py `fp8_gemm_kernel` (per-block C_local, then scaled accumulation into C_local_accum).
    """
    if a.dtype != torch.float32 or w.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"block_scaled_matmul: a must be float32 and w float32 or float64, got {a.dtype} and {w.dtype}")
    if w.dim() != 2 or a.dim() == 0 or a.shape[-1] != w.shape[1]:
        raise ValueError(
            f"block_scaled_matmul: need a [..., K] and w [N, K], got {tuple(a.shape)} and {tuple(w.shape)}"
        )
    _check_blocks(w, block, "block_scaled_matmul")
    _check_order(order, "block_scaled_matmul")
    lead, (n, k) = a.shape[:-1], w.shape
    a_rows = a.reshape(-1, k)
    if order == "fused":
        return rows_stable_linear(a_rows, w.float()).reshape(*lead, n)
    out = [_sum_blocks(partials, order) for partials in _block_partials(a_rows, w, block)]
    return (torch.cat(out) if len(out) != 1 else out[0]).reshape(*lead, n)


def _block_partials(a_rows: torch.Tensor, w: torch.Tensor, block: int):
    """a fp32 [M, K], w [N, K] -> the fp32 block partials [KB, M', N] of successive row chunks
    (`block_scaled_matmul`: each exact in float64, rounded once), chunks of at most 256 MiB."""
    n, k = w.shape
    kb = k // block
    w_blocks = w.double().reshape(n, kb, block).permute(1, 2, 0)  # [KB, block, N]
    step = _chunk_rows(8 * kb * n)
    for r0 in range(0, max(a_rows.shape[0], 1), step):
        a_blocks = a_rows[r0:r0 + step].double().reshape(-1, kb, block).transpose(0, 1)  # [KB, M', block]
        yield torch.bmm(a_blocks, w_blocks).float()


def block_partials(a: torch.Tensor, w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The block partials `block_scaled_matmul` adds up: a fp32 [..., K], w fp32/fp64 [N, K] ->
    fp32 [KB, ..., N], partial b = a[..., block b] @ w[:, block b].T, exact in float64 and rounded
    once. Adding them to 0 in ascending b, one rounding per add, is block_scaled_matmul's
    "ascending" result; a row-parallel shard adds its blocks onto the previous rank's sum
    (compiler/parallel.py Comm.chain), which is the same sequence of adds."""
    if a.dtype != torch.float32 or w.dim() != 2 or a.dim() == 0 or a.shape[-1] != w.shape[1]:
        raise ValueError(f"block_partials: need a fp32 [..., K] and w [N, K], got {a.dtype} {tuple(a.shape)} and "
                         f"{tuple(w.shape)}")
    _check_blocks(w, block, "block_partials")
    lead = a.shape[:-1]
    parts = torch.cat(list(_block_partials(a.reshape(-1, a.shape[-1]), w, block)), dim=1)
    return parts.reshape(parts.shape[0], *lead, w.shape[0])


def add_blocks(acc: torch.Tensor, partials) -> torch.Tensor:
    """acc fp32 [...] + partials[0] + partials[1] + ... (partials [KB, ...] or a sequence of [...]),
    one rounding per add in this order: `_sum_blocks` "ascending" continued from acc instead of 0."""
    for p in partials:
        acc = acc + p
    return acc


#: fp32 GEMMs on some CPUs (MKL) take another kernel, with another summation order, below 8 rows
MIN_GEMM_ROWS = 8


def pad_rows(x2d: torch.Tensor) -> torch.Tensor:
    """x [M, K] zero-padded to at least MIN_GEMM_ROWS rows (order "fused" only; see rows_stable_linear)."""
    m = x2d.shape[0]
    if m >= MIN_GEMM_ROWS:
        return x2d
    return torch.cat([x2d, x2d.new_zeros(MIN_GEMM_ROWS - m, x2d.shape[1])], dim=0)


def rows_stable_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x [..., K], w [N, K]) in fp32 with at least MIN_GEMM_ROWS rows per call: order
    "fused", which the compiled steps trace. MKL on the host where this was measured sums rows
    of 1..7-row calls in another order than 8 or more rows; nothing promises that elsewhere, which
    is why the golden uses `exact_linear` and float64 block partials instead."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    return torch.nn.functional.linear(pad_rows(rows), w)[:m].reshape(*lead, w.shape[0])


def linear_fp32(x: torch.Tensor, w: torch.Tensor, order: str = "ascending") -> torch.Tensor:
    """The model's plain fp32 linear (x fp32 [..., K], w fp32/fp64 [N, K] -> fp32 [..., N]):
    `exact_linear` for the golden's orders, one fp32 GEMM for "fused"."""
    _check_order(order, "linear_fp32")
    return rows_stable_linear(x, w.float()) if order == "fused" else exact_linear(x, w)


def fp8_activation(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The FP8 GEMM input: act_quant(x, block) dequantised, float(q) * s in fp32 [..., K] (exact,
    without the bf16 rounding of `act_quant_qdq`). Raises ValueError as `act_quant`."""
    q, s = act_quant_values(x, block, "fp8_activation")
    return _scale_blocks(q, s, block)


def fp8_linear(x: torch.Tensor, w_deq: torch.Tensor, block: int = 32, order: str = "ascending") -> torch.Tensor:
    """The model's `linear()` for FP8 and FP4 weights: FP8 activation QDQ, block-scaled GEMM, bf16 out.

    x: [..., K] bfloat16 (float32/float16 accepted). w_deq: fp32 or fp64 [N, K], the dequantised
    weight (`dequant_fp8_weight` or `dequant_fp4_weight`). The activation becomes float(q) * s in
    fp32 through `act_quant(x, block)`, without an intermediate bf16 rounding. It then goes through
    `block_scaled_matmul(..., block, order)`, and the fp32 result is cast to bf16, the
    reference's default dtype. Returns bfloat16 [..., N].
    V4.1 uses block 32 for both FP8 weights and FP4 experts, so the activation blocks and the
    weight K blocks coincide. For V4 FP4 experts (activation block 128, weight scales per 32), call
    `act_quant_qdq(x, 128)` and `block_scaled_matmul(..., 32)` instead.
    Raises ValueError as `act_quant` and `block_scaled_matmul`.
    Source: DeepSeek-V4.1-Flash:inference/model.py `linear`; docs/numerics.md "The forward pass".
    """
    return block_scaled_matmul(fp8_activation(x, block), w_deq, block, order).to(torch.bfloat16)


def experts_linear(x: torch.Tensor, w_deq: torch.Tensor, block: int = 32, order: str = "ascending") -> torch.Tensor:
    """`fp8_linear` for a stack of experts at once: x bf16 [M, K] (shared input) or [E, M, K], w_deq
    fp32 [E, N, K] -> bf16 [E, M, N].

    Bit-identical to `fp8_linear(x[e], w_deq[e])` per expert: the same 1x32 activation QDQ, the same
    float64-exact per-K-block partials, accumulated over blocks in the same order. One batched GEMM
    over (expert, K block) keeps the exported graph small (a per-expert loop multiplies the node
    count by E); order "fused" is one batched fp32 GEMM over the whole K (see `block_scaled_matmul`).
    """
    if w_deq.dim() != 3 or w_deq.dtype not in (torch.float32, torch.float64) or x.shape[-1] != w_deq.shape[-1]:
        raise ValueError(f"experts_linear: need x [..., K] and fp32 w [E, N, K], got {tuple(x.shape)} {w_deq.dtype} {tuple(w_deq.shape)}")
    e, n, k = w_deq.shape
    _check_blocks(w_deq, block, "experts_linear")
    _check_order(order, "experts_linear")
    q, s = act_quant_values(x, block, "experts_linear")
    a = _scale_blocks(q, s, block)
    m = a.shape[-2]
    if order == "fused":
        a = pad_rows(a) if a.dim() == 2 else torch.cat([a, a.new_zeros(e, max(0, MIN_GEMM_ROWS - m), k)], dim=1)
        return torch.matmul(a, w_deq.float().transpose(1, 2))[:, :m].to(torch.bfloat16)
    kb = k // block
    w_blocks = w_deq.double().view(e, n, kb, block).permute(0, 2, 3, 1)  # [E, KB, block, N]
    step = _chunk_rows(8 * e * kb * n)
    out = []
    for r0 in range(0, max(m, 1), step):
        ab = a[..., r0:r0 + step, :].double()
        ab = ab.unflatten(-1, (kb, block)).transpose(-3, -2)  # [(E,) KB, M', block]
        if ab.dim() == 3:
            ab = ab.unsqueeze(0)
        partials = torch.matmul(ab, w_blocks).float()  # [E, KB, M', N]
        out.append(_sum_blocks(partials.transpose(0, 1), order))  # [E, M', N]
    return (torch.cat(out, dim=1) if len(out) != 1 else out[0]).to(torch.bfloat16)
