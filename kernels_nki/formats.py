"""Storage codecs shared by the kernels and the model: FP4 e2m1 codes, nibble packing, UE8M0 scales.

These are pure bit-level encodings with no rounding decision in them; the quantizers that choose
codes and scales live in `dsneuron.graphs.quant`. They sit here because `kernels_nki` may not import
`graphs` (the dependency rule in DESIGN.md), while both sides must read the same bytes.

Sources: DeepGEMM deep_gemm/utils/math.py (nibble order, UE8M0 bytes), DeepSeek-V4-Flash
inference/convert.py cast_e2m1fn_to_e4m3fn (e2m1 code table); see reference/kernel_numerics.md B.5.
"""

from __future__ import annotations

import torch

#: e2m1 value of each 4-bit code; bit 3 is the sign, so code 8 is -0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 e2m1 values as fp32 [16], indexed by code."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack e2m1 codes [..., K] (integer dtype, values 0..15, K even) into int8 [..., K/2].

    Byte i holds code 2i in its low nibble and code 2i+1 in its high nibble.
    Raises ValueError when K is odd.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.int32) & 0xF
    byte = c[..., 0::2] | (c[..., 1::2] << 4)
    return byte.to(torch.uint8).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int8/uint8 [..., K/2] into e2m1 codes uint8 [..., K] (even element from the low nibble)."""
    b = packed.view(torch.uint8).to(torch.int32)
    codes = torch.stack([b & 0xF, (b >> 4) & 0xF], dim=-1).flatten(-2)
    return codes.to(torch.uint8)


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes uint8 [...] -> their fp32 values [...] (exact)."""
    return e2m1_table(codes.device)[codes.long()]


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales -> fp32 powers of two. Accepts float8_e8m0fnu tensors or raw exponent bytes
    (uint8: value 2^(byte-127)). Byte 255 (NaN in e8m0) is rejected with ValueError."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise ValueError(f"ue8m0_to_float: expected float8_e8m0fnu or uint8, got {scale.dtype}")
    if bool((scale == 255).any()):
        raise ValueError("ue8m0_to_float: exponent byte 255 is NaN in UE8M0")
    bits = scale.to(torch.int32) << 23
    # byte 0 would be the denormal 2^-127, not representable with a zero mantissa: spell it out
    out = bits.view(torch.float32)
    return torch.where(scale == 0, torch.full_like(out, 2.0 ** -127), out)


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
