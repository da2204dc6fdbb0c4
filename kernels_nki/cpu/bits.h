// Scalar bit views of the cpu kernels: fp32 <-> its bits, bf16 bits -> fp32, and fp32 -> bf16 bits
// rounded to nearest even (NaN kept quiet), as torch's conversion rounds; the value of a UE8M0 scale
// byte and the 16 e2m1 values by code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dsn {
namespace {

inline uint32_t bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float from_bits(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
inline float bf16_value(uint16_t h) { return from_bits(uint32_t(h) << 16); }

// UE8M0: 2^(byte - 127); byte 0 is 2^-127 (an fp32 subnormal), 255 NaN
inline float ue8m0_value(uint8_t b) { return b == 255 ? NAN : b == 0 ? 0x1p-127f : from_bits(uint32_t(b) << 23); }

// e2m1 by its 4-bit code (bit 3 the sign, -0 included)
constexpr float kE2m1Values[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline uint16_t bf16_bits(float x) {
  const uint32_t u = bits(x);
  if (x != x) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace
}  // namespace dsn
