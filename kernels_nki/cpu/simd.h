// The two ISA layers of gemm.cpp: an 8-lane fp32 vector V and one exact weight decoder per format.
//
// One SIMD lane = one output column n (a 16-row weight panel is two V's); nothing ever reduces
// across lanes, so every lane runs the same scalar sequence of fp32 fma/add whatever the vector
// width. The AVX2 layer (built with -mavx2 -mfma -mf16c) and the portable layer (plain C++,
// std::fma) therefore give identical bits; -ffp-contract=off keeps the compiler from fusing
// anything written as a separate multiply and add.
//
// Decoders view one prepared panel (layouts in cpu_gemm.py) and yield its weights, R consecutive
// k rows at a time, as 2R vectors: w[2r] = lanes 0-7 and w[2r+1] = lanes 8-15 of row k+r
// (row_ptr(k) is where row k's bytes are, k <= K, for prefetching). Each
// value is the exact dequantised weight (code value times its power-of-two scale: one product,
// exact unless it overflows), so the kernels see the same fp32 numbers on every ISA.
//
// Scale folding (gemm.cpp `tile_direct`): a decoder with kFold also yields the raw values
// (rows_raw: the code value times a fixed power of two, kRawLsb the smallest nonzero magnitude
// step and kRawMax the largest magnitude) and, per block, the power-of-two factor f that turns a
// raw value into the weight (fold_lane / fold_ok: every lane's f within [lo, hi]). The kernel then
// multiplies the block's partial by f once instead of every weight; gemm.cpp says when that is
// exact.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bits.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DSN_AVX2 1
#endif

namespace dsn {
namespace {  // internal linkage: the AVX2 and the portable build can share a process without clashes

// hint that the 64-byte line `ahead` bytes past p is read soon (integer arithmetic: the address may
// lie past the weight's end, which a prefetch never faults on). Into L2 only (locality 1): the
// kernels prefetch a whole panel ahead (16-32 KB), which into the 32 KB L1 evicts itself before its
// use; measured on the bf16 head (129280 x 1024) at M = 1, 2 threads: 16.8 -> 6.3 ms a call
inline void prefetch(const void* p, int64_t ahead) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + uintptr_t(ahead)), 0, 1);
}

#if DSN_AVX2

struct V { __m256 v; };
inline V vzero() { return {_mm256_setzero_ps()}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x.v); }
inline V vbcast(const float* p) { return {_mm256_broadcast_ss(p)}; }
inline V vset(float x) { return {_mm256_set1_ps(x)}; }
inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline V vadd(V a, V b) { return {_mm256_add_ps(a.v, b.v)}; }
inline V vmul(V a, V b) { return {_mm256_mul_ps(a.v, b.v)}; }

// e4m3fn s.eeee.mmm -> the f16 s.0eeee.mmm0000000 (sign-extend, shift, clear bit 14), whose value is
// the e4m3 value * 2^-8 for normals and subnormals alike (F16C converts f16 subnormals exactly), times
// 256 * scale, one multiply. kExact serves the panels where `fp8_needs_exact` finds what that
// breaks: NaN codes (magnitude 0x7F) get bit 14, an f16 NaN, and scales above 2^119 (where 256 *
// scale overflows) or NaN are applied as * 256 then * scale, both exact.
template <bool kExact>
struct Fp8T {
  static constexpr int R = 1;
  // raw value = the f16 e4m3 * 2^-8, f = 256 * scale (one factor for all 16 lanes)
  static constexpr bool kFold = !kExact;
  static constexpr float kRawLsb = 0x1p-17f, kRawMax = 1.75f;
  const uint8_t* code;  // [K][16]
  const float* scale;   // [K/32]
  struct Blk { V f1, f2; };
  Blk block(int64_t b) const {
    const float s = scale[b];
    return kExact ? Blk{vset(256.0f), vset(s)} : Blk{vset(256.0f * s), vset(1.0f)};
  }
  const void* row_ptr(int64_t k) const { return code + k * 16; }
  void rows(const Blk& st, int64_t k, V* w) const {
    const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code + k * 16)));
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(int16_t(0xBFFF)));
    if (kExact) {
      const __m256i ones = _mm256_set1_epi16(0x3F80);
      const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, ones), ones);
      h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x4000)));
    }
    w[0] = vmul({_mm256_cvtph_ps(_mm256_castsi256_si128(h))}, st.f1);
    w[1] = vmul({_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))}, st.f1);
    if (kExact) { w[0] = vmul(w[0], st.f2); w[1] = vmul(w[1], st.f2); }
  }
  void rows_raw(int64_t k, V* w) const {
    const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code + k * 16)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(int16_t(0xBFFF)));
    w[0] = {_mm256_cvtph_ps(_mm256_castsi256_si128(h))};
    w[1] = {_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
  }
  V fold_lane(const Blk& st, int) const { return st.f1; }
  bool fold_ok(int64_t b, float lo, float hi) const {
    const float f = 256.0f * scale[b];
    return f >= lo && f <= hi;
  }
};

// true when the panel (K*16 codes, K/32 scales) holds a NaN code or a scale above 2^119 (or NaN)
inline bool fp8_needs_exact(const uint8_t* code, const float* scale, int64_t K) {
  for (int64_t b = 0; b < K / 32; ++b)
    if (!(scale[b] <= 0x1p119f)) return true;
  const __m256i mag = _mm256_set1_epi8(0x7F);
  __m256i hi = _mm256_setzero_si256();
  for (int64_t i = 0; i < K * 16; i += 32)
    hi = _mm256_max_epu8(hi, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(code + i)), mag));
  const __m256i nan = _mm256_cmpeq_epi8(hi, mag);
  return !_mm256_testz_si256(nan, nan);
}

// e2m1 nibble -> high byte of its f16 bit pattern (the low byte is 0 for all 16 values, -0 included)
// by one byte shuffle, then F16C; times the per-lane scale.
struct Fp4 {
  static constexpr int R = 2;
  // raw value = the e2m1 value, f = the lane's scale
  static constexpr bool kFold = true;
  static constexpr float kRawLsb = 0.5f, kRawMax = 6.0f;
  const uint8_t* code;  // [K/2][16]: low nibble = even k, high nibble = odd k
  const float* scale;   // [K/32][16]
  struct Blk { V s0, s1; };
  Blk block(int64_t b) const { return {vload(scale + b * 16), vload(scale + b * 16 + 8)}; }
  const void* row_ptr(int64_t k) const { return code + (k / 2) * 16; }
  void rows(const Blk& st, int64_t k, V* w) const {
    rows_raw(k, w);
    w[0] = vmul(w[0], st.s0);
    w[1] = vmul(w[1], st.s1);
    w[2] = vmul(w[2], st.s0);
    w[3] = vmul(w[3], st.s1);
  }
  void rows_raw(int64_t k, V* w) const {
    const __m128i tab = _mm_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, char(0x80), char(0xB8),
                                      char(0xBC), char(0xBE), char(0xC0), char(0xC2), char(0xC4), char(0xC6));
    const __m128i nib = _mm_set1_epi8(0x0F), z = _mm_setzero_si128();
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(code + (k / 2) * 16));
    const __m128i lo = _mm_shuffle_epi8(tab, _mm_and_si128(b, nib));
    const __m128i hi = _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(b, 4), nib));
    w[0] = {_mm256_cvtph_ps(_mm_unpacklo_epi8(z, lo))};
    w[1] = {_mm256_cvtph_ps(_mm_unpackhi_epi8(z, lo))};
    w[2] = {_mm256_cvtph_ps(_mm_unpacklo_epi8(z, hi))};
    w[3] = {_mm256_cvtph_ps(_mm_unpackhi_epi8(z, hi))};
  }
  V fold_lane(const Blk& st, int h) const { return h ? st.s1 : st.s0; }
  bool fold_ok(int64_t b, float lo, float hi) const {
    const __m256 l = _mm256_set1_ps(lo), u = _mm256_set1_ps(hi);
    const __m256 s0 = _mm256_loadu_ps(scale + b * 16), s1 = _mm256_loadu_ps(scale + b * 16 + 8);
    const __m256 in = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(s0, l, _CMP_GE_OQ), _mm256_cmp_ps(s0, u, _CMP_LE_OQ)),
                                    _mm256_and_ps(_mm256_cmp_ps(s1, l, _CMP_GE_OQ), _mm256_cmp_ps(s1, u, _CMP_LE_OQ)));
    return _mm256_movemask_ps(in) == 0xFF;
  }
};

struct Bf16 {
  static constexpr int R = 1;
  static constexpr bool kFold = false;
  const uint16_t* val;  // [K][16]
  struct Blk {};
  Blk block(int64_t) const { return {}; }
  const void* row_ptr(int64_t k) const { return val + k * 16; }
  void rows(const Blk&, int64_t k, V* w) const {
    const __m128i* p = reinterpret_cast<const __m128i*>(val + k * 16);
    w[0] = {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16))};
    w[1] = {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + 1)), 16))};
  }
};

#else  // portable layer

struct V { float v[8]; };
inline V vzero() { return V{}; }
inline V vload(const float* p) { V r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void vstore(float* p, V x) { std::memcpy(p, x.v, sizeof x.v); }
inline V vset(float x) { V r; for (float& e : r.v) e = x; return r; }
inline V vbcast(const float* p) { return vset(*p); }
inline V vfma(V a, V b, V c) { V r; for (int i = 0; i < 8; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return r; }
inline V vadd(V a, V b) { V r; for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
inline V vmul(V a, V b) { V r; for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }

// e4m3fn byte -> value: normal (1 + m/8) * 2^(e-7), subnormal m * 2^-9, s.1111.111 NaN
inline const float* e4m3_table() {
  static const auto tab = [] {
    struct T { float v[256]; } t;
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 15, m = c & 7;
      const float mag = (e == 15 && m == 7) ? NAN : e ? std::ldexp(float(8 + m), e - 10) : std::ldexp(float(m), -9);
      t.v[c] = (c & 0x80) ? -mag : mag;
    }
    return t;
  }();
  return tab.v;
}

// one exact product per weight (the table holds the subnormals and NaNs): no special cases here
template <bool kExact>
struct Fp8T {
  static constexpr int R = 1;
  // raw value = the e4m3 value, f = the scale
  static constexpr bool kFold = !kExact;
  static constexpr float kRawLsb = 0x1p-9f, kRawMax = 448.0f;
  const uint8_t* code;
  const float* scale;
  struct Blk { float s; };
  Blk block(int64_t b) const { return {scale[b]}; }
  const void* row_ptr(int64_t k) const { return code + k * 16; }
  void rows(const Blk& st, int64_t k, V* w) const {
    const float* tab = e4m3_table();
    for (int l = 0; l < 16; ++l) w[l / 8].v[l % 8] = tab[code[k * 16 + l]] * st.s;
  }
  void rows_raw(int64_t k, V* w) const {
    const float* tab = e4m3_table();
    for (int l = 0; l < 16; ++l) w[l / 8].v[l % 8] = tab[code[k * 16 + l]];
  }
  V fold_lane(const Blk& st, int) const { return vset(st.s); }
  bool fold_ok(int64_t b, float lo, float hi) const { return scale[b] >= lo && scale[b] <= hi; }
};
inline bool fp8_needs_exact(const uint8_t*, const float*, int64_t) { return false; }

struct Fp4 {
  static constexpr int R = 2;
  const uint8_t* code;
  const float* scale;
  struct Blk { const float* s; };
  Blk block(int64_t b) const { return {scale + b * 16}; }
  const void* row_ptr(int64_t k) const { return code + (k / 2) * 16; }
  static constexpr bool kFold = true;
  static constexpr float kRawLsb = 0.5f, kRawMax = 6.0f;
  void rows(const Blk& st, int64_t k, V* w) const {
    rows_raw(k, w);
    for (int l = 0; l < 16; ++l) {
      w[l / 8].v[l % 8] *= st.s[l];
      w[2 + l / 8].v[l % 8] *= st.s[l];
    }
  }
  void rows_raw(int64_t k, V* w) const {
    for (int l = 0; l < 16; ++l) {
      const uint8_t b = code[(k / 2) * 16 + l];
      w[l / 8].v[l % 8] = kE2m1Values[b & 15];
      w[2 + l / 8].v[l % 8] = kE2m1Values[b >> 4];
    }
  }
  V fold_lane(const Blk& st, int h) const { return vload(st.s + 8 * h); }
  bool fold_ok(int64_t b, float lo, float hi) const {
    for (int l = 0; l < 16; ++l)
      if (!(scale[b * 16 + l] >= lo && scale[b * 16 + l] <= hi)) return false;
    return true;
  }
};

struct Bf16 {
  static constexpr int R = 1;
  static constexpr bool kFold = false;
  const uint16_t* val;
  struct Blk {};
  Blk block(int64_t) const { return {}; }
  const void* row_ptr(int64_t k) const { return val + k * 16; }
  void rows(const Blk&, int64_t k, V* w) const {
    for (int l = 0; l < 16; ++l) {
      const uint32_t bits = uint32_t(val[k * 16 + l]) << 16;
      std::memcpy(&w[l / 8].v[l % 8], &bits, 4);
    }
  }
};

#endif

struct Fp32 {
  static constexpr int R = 1;
  static constexpr bool kFold = false;
  const float* val;  // [K][16]
  struct Blk {};
  Blk block(int64_t) const { return {}; }
  const void* row_ptr(int64_t k) const { return val + k * 16; }
  void rows(const Blk&, int64_t k, V* w) const { w[0] = vload(val + k * 16); w[1] = vload(val + k * 16 + 8); }
};

}  // namespace
}  // namespace dsn
