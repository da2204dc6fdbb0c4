// Scalar bit views of the cpu kernels: fp32 <-> its bits, bf16 bits -> fp32, and fp32 -> bf16 bits
// rounded to nearest even (NaN kept quiet), as torch's conversion rounds.
#pragma once

#include <cstdint>
#include <cstring>

namespace dsn {
namespace {

inline uint32_t bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float from_bits(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
inline float bf16_value(uint16_t h) { return from_bits(uint32_t(h) << 16); }

inline uint16_t bf16_bits(float x) {
  const uint32_t u = bits(x);
  if (x != x) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace
}  // namespace dsn
