// The ISA layer of gemm_fast.cpp: 16-lane fp32 accumulators, bf16 pair vectors, the pair dot
// product, and the exact expansion of one prepared panel's FP8 / FP4 / bf16 weights to bf16 pairs.
//
// A pair vector W holds, for the 16 lanes (output columns) of a panel, the weights of two
// consecutive k as bf16 bits: W[2l] = w[k][l], W[2l + 1] = w[k + 1][l] (64 bytes). `dot` adds
// a[k] * W[2l] + a[k + 1] * W[2l + 1] into lane l: one VDPBF16PS (Intel SDM, "VDPBF16PS") where
// the build has AVX512-BF16, else two fp32 fma in k order. Lanes never mix, so a lane's result is
// the same sequence of operations whatever the tile or thread that computes it; the two layers
// may differ from each other (VDPBF16PS flushes denormals), which fast numerics allows: it is
// deterministic on one host, not across hosts.
//
// Every e4m3fn and e2m1 value is a bf16 (<= 3 mantissa bits, exponents inside bf16's range), so
// the expansion is exact, block scales excluded (gemm_fast.cpp applies them to block partials).
//
// Three layers: AVX-512 (VDPBF16PS), AVX2 (two fp32 fma per pair in k order, the weights widened
// to fp32 once per pair vector and shared by the tile's rows) and a portable one (the same
// arithmetic as AVX2 in plain loops, for the "generic" build). AVX2 and portable give the same bits.
// WElem: the element of an expanded panel's pair buffer (32 per pair vector: bf16 bits, or fp32
// on AVX2, where a pair vector is kept widened); AElem: an activation rounded to bf16 (its bits, or
// on AVX2 its fp32 value, which `dot` broadcasts without widening it per row; `to_act` makes
// them); kTileRows: rows per register tile (gemm_fast.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define DSN_BF16DP 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define DSN_AMX 1  // gemm_fast.cpp's AMX layer; the process must hold AMX permission (cpu_gemm_fast.py)
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DSN_AVX2 1
#endif

namespace dsn {
namespace {

// fp32 bits -> bf16 bits, round to nearest even; NaN stays NaN (quiet): the AVX2 and portable
// layers' activation rounding (VCVTNEPS2BF16's on AVX-512)
inline uint16_t bf16_bits(uint32_t b) {
  return (b & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t((b >> 16) | 0x40) : uint16_t((b + 0x7FFFu + ((b >> 16) & 1)) >> 16);
}

// hint that the line `ahead` bytes past p is read soon, into L2 (simd.h `prefetch` says why)
inline void prefetch_l2(const void* p, int64_t ahead) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + uintptr_t(ahead)), 0, 1);
}

#if DSN_BF16DP

struct Acc { __m512 v; };
struct W { __m512i v; };
using WElem = uint16_t;
using AElem = uint16_t;
constexpr int kTileRows = 12;  // 12 partials + 12 accs + weights < 32 zmm
constexpr int kDirectRows = 4;  // measured on tiny
inline Acc azero() { return {_mm512_setzero_ps()}; }
inline Acc aset(float x) { return {_mm512_set1_ps(x)}; }
inline Acc aload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Acc aload_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p)}; }
inline void astore_n(float* p, Acc x, int n) { _mm512_mask_storeu_ps(p, __mmask16((1u << n) - 1), x.v); }
// acc + p * s, one rounding (s a power of two: p * s is exact unless it leaves fp32's range)
inline Acc afma(Acc p, Acc s, Acc acc) { return {_mm512_fmadd_ps(p.v, s.v, acc.v)}; }
inline W wload(const uint16_t* p) { return {_mm512_loadu_si512(p)}; }
inline void wstore(uint16_t* p, W w) { _mm512_storeu_si512(p, w.v); }

// lane l += a[0] * W[2l] + a[1] * W[2l+1] (a: two bf16, k and k + 1)
inline Acc dot(Acc c, W w, const uint16_t* a) {
  int32_t x;
  std::memcpy(&x, a, 4);
  return {_mm512_dpbf16_ps(c.v, (__m512bh)_mm512_set1_epi32(x), (__m512bh)w.v)};
}

// n fp32 -> bf16, round to nearest even (VCVTNEPS2BF16)
inline void to_bf16(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(y + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i)));
  }
}
inline void to_act(const float* x, uint16_t* y, int64_t n) { to_bf16(x, y, n); }

// The 8 subnormal e4m3 magnitudes m * 2^-9 as bf16, by m (lanes 8-31 unused)
inline __m512i fp8_subnormals() {
  return _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                          0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
}

// FP8 rows k, k+1 of a panel (code + k * 16: 32 bytes) -> pair vector, each value times 2^e where
// bias = (120 + e) << 7 and sub = fp8_subnormals() with e << 7 added to its nonzero lanes (e = 0:
// the values themselves; |e| <= 64 keeps every product a normal bf16, exactly). e4m3fn s.eeee.mmm
// is the bf16 s.(e+120).mmm0000 for e > 0; the subnormals come from the table; magnitude 0x7F is NaN
inline W fp8_pair(const uint8_t* code, __m512i bias, __m512i sub) {
  const __m256i rows = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(code));
  const __m128i r0 = _mm256_castsi256_si128(rows), r1 = _mm256_extracti128_si256(rows, 1);
  const __m512i x = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(r0, r1), _mm_unpacklo_epi8(r0, r1)));
  __m512i y = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(x, 4), _mm512_set1_epi16(int16_t(0x87F0))), bias);
  const __mmask32 is_sub = _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x78));  // exponent 0: index = m
  const __m512i t = _mm512_or_si512(_mm512_permutexvar_epi16(x, sub),
                                    _mm512_and_si512(y, _mm512_set1_epi16(int16_t(0x8000))));
  y = _mm512_mask_mov_epi16(y, is_sub, t);
  const __m512i mag = _mm512_set1_epi16(0x7F);
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, mag), mag);
  return {_mm512_mask_mov_epi16(y, nan, _mm512_or_si512(y, _mm512_set1_epi16(0x7FC0)))};
}

#if defined(__AVX512VBMI__)
// e4m3fn magnitude (7 bits) -> the low and the high byte of its bf16 bits, by magnitude: what
// fp8_pair computes (normals (mag << 4) + 0x3C00, subnormals m * 2^-9, and for 0x7F the NaN 0x7FF0,
// its normal formula's 0x43F0 with the quiet-NaN bits set), as tables
struct E4m3Bytes { alignas(64) uint8_t lo[128]; alignas(64) uint8_t hi[128]; };
constexpr E4m3Bytes e4m3_bytes() {
  constexpr uint16_t sub[8] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
  E4m3Bytes t{};
  for (int mag = 0; mag < 128; ++mag) {
    const uint16_t b = mag == 0x7F ? 0x7FF0 : mag < 8 ? sub[mag] : uint16_t((mag << 4) + 0x3C00);
    t.lo[mag] = uint8_t(b & 0xFF);
    t.hi[mag] = uint8_t(b >> 8);
  }
  return t;
}
inline constexpr E4m3Bytes kE4m3Bytes = e4m3_bytes();

// FP8 rows k, k+1 -> pair vector by byte tables (AVX512-VBMI; same bits as the 3-argument
// fp8_pair with e = 0): byte j of the pair vector is the low (j even) or high (j odd) byte of
// lane l = j / 4 of row k + (j / 2) % 2, so one VPERMB puts that code under every byte, two
// VPERMI2B look up both bytes of every code's bf16 (bit 7, the sign, is not an index bit), and the
// sign goes into the high bytes: 5 instructions for 32 weights where the arithmetic takes 12
inline W fp8_pair(const uint8_t* code) {
  alignas(64) static constexpr auto kIdx = [] {
    struct { uint8_t v[64]; } r{};
    for (int j = 0; j < 64; ++j) r.v[j] = uint8_t(16 * ((j >> 1) & 1) + (j >> 2));
    return r;
  }();
  const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(code)));
  const __m512i y = _mm512_permutexvar_epi8(_mm512_load_si512(kIdx.v), x);
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(kE4m3Bytes.lo), y, _mm512_load_si512(kE4m3Bytes.lo + 64));
  const __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(kE4m3Bytes.hi), y, _mm512_load_si512(kE4m3Bytes.hi + 64));
  const __m512i w = _mm512_mask_blend_epi8(__mmask64(0xAAAAAAAAAAAAAAAAull), lo, hi);
  return {_mm512_ternarylogic_epi32(w, y, _mm512_set1_epi16(int16_t(0x8000)), 0xF8)};  // w | (y & sign)
}
#else
inline W fp8_pair(const uint8_t* code) { return fp8_pair(code, _mm512_set1_epi16(0x3C00), fp8_subnormals()); }
#endif

// FP4 byte row j of a panel (code + j * 16: lane l's byte holds k = 2j low nibble, 2j+1 high)
// -> pair vector: each nibble indexes the 16 e2m1 values as bf16
inline W fp4_pair(const uint8_t* code) {
  const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code)));
  const __m512i idx = _mm512_or_si512(_mm512_and_si512(z, _mm512_set1_epi32(0x0F)),
                                      _mm512_and_si512(_mm512_slli_epi32(z, 12), _mm512_set1_epi32(0xF0000)));
  const __m512i tab = _mm512_set_epi16(
      int16_t(0xC0C0), int16_t(0xC080), int16_t(0xC040), int16_t(0xC000), int16_t(0xBFC0), int16_t(0xBF80),
      int16_t(0xBF00), int16_t(0x8000), 0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0,
      int16_t(0xC0C0), int16_t(0xC080), int16_t(0xC040), int16_t(0xC000), int16_t(0xBFC0), int16_t(0xBF80),
      int16_t(0xBF00), int16_t(0x8000), 0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0);
  return {_mm512_permutexvar_epi16(idx, tab)};
}

// bf16 rows k, k+1 of a panel (val + k * 16: 32 values) -> pair vector (an interleave)
inline W bf16_pair(const uint16_t* val) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return {_mm512_permutexvar_epi16(idx, _mm512_loadu_si512(val))};
}

#elif DSN_AVX2

// 16 lanes as two halves of 8 (lo: lanes 0-7); a pair vector widened to fp32: e = w[k][l],
// o = w[k + 1][l], 0 / 1 = lanes 0-7 / 8-15. The portable layer's arithmetic, fma for fma.
struct Acc { __m256 lo, hi; };
struct W { __m256 e0, o0, e1, o1; };
using WElem = float;
using AElem = float;
constexpr int kTileRows = 8;  // measured against 4 and 6 (prefill-sized M): more rows per pair load win over spills
constexpr int kDirectRows = 8;  // measured against 4: FP4 and bf16 0.7-0.9x the time at 5-8 rows

inline Acc azero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Acc aset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Acc aload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
// all-ones in lanes i < n of 8 (none for n <= 0)
inline __m256i first_lanes(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
inline Acc aload_n(const float* p, int n) {
  return {_mm256_maskload_ps(p, first_lanes(n)), _mm256_maskload_ps(p + 8, first_lanes(n - 8))};
}
inline void astore_n(float* p, Acc x, int n) {
  _mm256_maskstore_ps(p, first_lanes(n), x.lo);
  _mm256_maskstore_ps(p + 8, first_lanes(n - 8), x.hi);
}
inline Acc afma(Acc p, Acc s, Acc acc) { return {_mm256_fmadd_ps(p.lo, s.lo, acc.lo), _mm256_fmadd_ps(p.hi, s.hi, acc.hi)}; }
inline W wload(const float* p) {
  return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), _mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)};
}
inline void wstore(float* p, W w) {
  _mm256_storeu_ps(p, w.e0);
  _mm256_storeu_ps(p + 8, w.o0);
  _mm256_storeu_ps(p + 16, w.e1);
  _mm256_storeu_ps(p + 24, w.o1);
}

// lane l += a[0] * w[k][l], then += a[1] * w[k + 1][l] (a: k and k + 1, values of bf16)
inline Acc dot(Acc c, const W& w, const float* a) {
  const __m256 a0 = _mm256_broadcast_ss(a), a1 = _mm256_broadcast_ss(a + 1);
  return {_mm256_fmadd_ps(a1, w.o0, _mm256_fmadd_ps(a0, w.e0, c.lo)),
          _mm256_fmadd_ps(a1, w.o1, _mm256_fmadd_ps(a0, w.e1, c.hi))};
}

// n fp32 -> their bf16 roundings (bf16_bits) as fp32: the portable to_bf16's values, widened back
inline void to_act(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, &x[i], 4);
    b = uint32_t(bf16_bits(b)) << 16;
    std::memcpy(&y[i], &b, 4);
  }
}

// 8 e4m3fn codes -> fp32. Sign-extended, shifted so that s.eeee.mmm lands on fp32's sign, low
// exponent bits and top mantissa bits: that float is the code's value times 2^-120 (a denormal
// for e = 0, where the code is m * 2^-9 itself), and one multiply by 2^120 gives the value
// exactly, zero and subnormal codes included. gemm_fast.cpp clears DAZ around its kernels, which
// would read that denormal as 0. Magnitude 0x7F (NaN) comes out 480: fp8_pair patches it.
inline __m256 e4m3_f32(const uint8_t* code) {
  const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code)));
  const __m256i b = _mm256_and_si256(_mm256_slli_epi32(x, 20), _mm256_set1_epi32(int32_t(0x87F00000u)));
  return _mm256_mul_ps(_mm256_castsi256_ps(b), _mm256_set1_ps(0x1p120f));
}

// the portable layer's NaN for each code of 32 whose magnitude is 0x7F: 0x7FC0 | sign as bf16
inline W with_nans(W w, const uint8_t* code) {
  alignas(32) float v[32];
  wstore(v, w);
  static constexpr int kCode[4] = {0, 16, 8, 24};  // where e0, o0, e1, o1 come from
  for (int q = 0; q < 4; ++q)
    for (int l = 0; l < 8; ++l) {
      const uint8_t c = code[kCode[q] + l];
      if ((c & 0x7F) == 0x7F) {
        const uint32_t bits = 0x7FC00000u | (uint32_t(c & 0x80) << 24);
        std::memcpy(&v[8 * q + l], &bits, 4);
      }
    }
  return wload(v);
}

// FP8 rows k, k+1 of a panel (code + k * 16: 32 bytes) -> pair vector
inline W fp8_pair(const uint8_t* code) {
  const W w{e4m3_f32(code), e4m3_f32(code + 16), e4m3_f32(code + 8), e4m3_f32(code + 24)};
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(code));
  const __m256i mag = _mm256_set1_epi8(0x7F);
  if (__builtin_expect(_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(c, mag), mag)) != 0, 0))
    return with_nans(w, code);
  return w;
}

// 8 bytes of an FP4 panel row -> the low nibbles' and the high nibbles' e2m1 values: the 8
// magnitudes by VPERMPS (which reads an index's low 3 bits), the sign bit moved to bit 31
inline void e2m1_f32(const uint8_t* code, __m256& lo, __m256& hi) {
  const __m256 tab = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code)));
  const __m256i sign = _mm256_set1_epi32(int32_t(0x80000000u));
  lo = _mm256_or_ps(_mm256_permutevar8x32_ps(tab, x), _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(x, 28), sign)));
  hi = _mm256_or_ps(_mm256_permutevar8x32_ps(tab, _mm256_srli_epi32(x, 4)),
                    _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(x, 24), sign)));
}

// FP4 byte row j of a panel (code + j * 16: lane l's byte holds k = 2j low nibble, 2j+1 high)
inline W fp4_pair(const uint8_t* code) {
  W w;
  e2m1_f32(code, w.e0, w.o0);
  e2m1_f32(code + 8, w.e1, w.o1);
  return w;
}

// 8 bf16 -> fp32
inline __m256 bf16_f32(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// bf16 rows k, k+1 of a panel (val + k * 16: 32 values) -> pair vector
inline W bf16_pair(const uint16_t* val) { return {bf16_f32(val), bf16_f32(val + 16), bf16_f32(val + 8), bf16_f32(val + 24)}; }

#else  // portable layer (the "generic" build)

struct Acc { float v[16]; };
struct W { uint16_t v[32]; };
using WElem = uint16_t;
using AElem = uint16_t;
constexpr int kTileRows = 12;
constexpr int kDirectRows = 4;
inline Acc aset(float x) { Acc r; for (float& e : r.v) e = x; return r; }
inline Acc azero() { return aset(0.0f); }
inline Acc aload(const float* p) { Acc r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline Acc aload_n(const float* p, int n) { Acc r = azero(); std::memcpy(r.v, p, 4 * n); return r; }
inline void astore_n(float* p, Acc x, int n) { std::memcpy(p, x.v, 4 * n); }
inline Acc afma(Acc p, Acc s, Acc acc) {
  for (int l = 0; l < 16; ++l) acc.v[l] = __builtin_fmaf(p.v[l], s.v[l], acc.v[l]);
  return acc;
}
inline W wload(const uint16_t* p) { W w; std::memcpy(w.v, p, sizeof w.v); return w; }
inline void wstore(uint16_t* p, W w) { std::memcpy(p, w.v, sizeof w.v); }

inline float bf16_value(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline Acc dot(Acc c, W w, const uint16_t* a) {
  const float a0 = bf16_value(a[0]), a1 = bf16_value(a[1]);
  for (int l = 0; l < 16; ++l)
    c.v[l] = __builtin_fmaf(a1, bf16_value(w.v[2 * l + 1]), __builtin_fmaf(a0, bf16_value(w.v[2 * l]), c.v[l]));
  return c;
}

// round to nearest even; NaN stays NaN (quiet)
inline void to_bf16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, &x[i], 4);
    y[i] = bf16_bits(b);
  }
}
inline void to_act(const float* x, uint16_t* y, int64_t n) { to_bf16(x, y, n); }

// e4m3fn code -> bf16 bits (s.(e+120).mmm0000; subnormals m * 2^-9; magnitude 0x7F NaN)
inline const uint16_t* e4m3_bf16_table() {
  static const auto tab = [] {
    struct T { uint16_t v[256]; } t;
    const uint16_t sub[8] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
    for (int c = 0; c < 256; ++c) {
      const int mag = c & 0x7F;
      const uint16_t m = mag == 0x7F ? 0x7FC0 : mag < 8 ? sub[mag] : uint16_t((mag << 4) + 0x3C00);
      t.v[c] = uint16_t(m | ((c & 0x80) << 8));
    }
    return t;
  }();
  return tab.v;
}

inline W fp8_pair(const uint8_t* code) {
  const uint16_t* tab = e4m3_bf16_table();
  W w;
  for (int l = 0; l < 16; ++l) {
    w.v[2 * l] = tab[code[l]];
    w.v[2 * l + 1] = tab[code[16 + l]];
  }
  return w;
}

inline W fp4_pair(const uint8_t* code) {
  static const uint16_t tab[16] = {0, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                   0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
  W w;
  for (int l = 0; l < 16; ++l) {
    w.v[2 * l] = tab[code[l] & 15];
    w.v[2 * l + 1] = tab[code[l] >> 4];
  }
  return w;
}

inline W bf16_pair(const uint16_t* val) {
  W w;
  for (int l = 0; l < 16; ++l) {
    w.v[2 * l] = val[l];
    w.v[2 * l + 1] = val[16 + l];
  }
  return w;
}

#endif

}  // namespace
}  // namespace dsn
