// dsneuron::fp8_act_dequant: the FP8 activation of the model's FP8/FP4 GEMMs, quantised and
// dequantised in one pass (graphs/quant.py `fp8_activation`, whose result it equals bit for bit);
// dsneuron::fp4_act_dequant: the FP4 QDQ of the indexer's q and k and of the compressed KV
// (graphs/quant.py `fp4_act_quant_qdq`, before its cast back to x.dtype), likewise.
//
// Per block of `block` contiguous elements of a row (V4.1: 32), in fp32:
//   amax = max |x| (NaN if any element is NaN), floored at fp32(1e-4)
//   s    = 2^(e - 127), e = biased exponent of amax * fp32(1/448) plus 1 if its mantissa is nonzero,
//          clamped to [1, 254] (UE8M0, DeepGEMM `ceil_to_ue8m0`)
//   out  = e4m3(clamp(x / s, -448, 448)) * s, e4m3 = round to nearest even on the e4m3fn grid
// Every step is exact or one IEEE rounding, and amax does not depend on the order of the max, so
// the result depends on neither the ISA nor the thread count. Source: DeepSeek-V4.1-Flash:
// inference/model.py `linear` (act_quant with ue8m0 scales); DeepSeek-V4-Pro:inference/kernel.py
// `act_quant_kernel`. One op replaces the ~35 graph nodes of the decomposed QDQ in every linear.
//
// FP4, per block, in fp32: amax as above, then
//   scale_fmt 0 (ue8m0): s = UE8M0 ceiling of max(amax, 6 * 2^-126) * fp32(1/6)
//   scale_fmt 1 (e4m3):  s = e4m3(max(amax, 6 * 2^-9) / 6)
//   out = e2m1(clamp(x / s, -6, 6)) * s, e2m1 = nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the
//         even code, sign kept (-0 for small negatives)
// Source: DeepSeek-V4.1-Flash:inference/model.py `Indexer.forward`, `Attention._compress_kv`
// (fp4_act_quant); DeepSeek-V4-Pro:inference/kernel.py `fp4_quant_kernel`.
//
// dsneuron::state_quant / state_dequant: the decode state's caches as bytes (graphs/quant.py
// `quantize_state` / `dequantize_state`, bit for bit): a row of K values is its codes (e4m3: one
// byte each; e2m1: two per byte, even element low) then one scale byte per block (UE8M0 exponent
// byte, or the e4m3 byte of an e4m3 scale); fmt 0 = e4m3 x UE8M0, 1 = e2m1 x UE8M0, 2 = e2m1 x e4m3.
// The codes are those of the QDQs above, so dequantising gives the QDQ'd values, which bf16 holds.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "bits.h"
#include "check.h"

#ifndef DSN_NS
#error "build with -DDSN_NS=<op namespace>"
#endif

namespace dsn {
namespace {

using torch::stable::Tensor;
using ST = torch::headeronly::ScalarType;

constexpr float kE4m3Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;            // graphs/quant.py _FP8_AMAX_FLOOR, as fp32
constexpr float kInvE4m3Max = 1.0f / 448.0f;   // fp32(1/448), as torch rounds the Python float

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) { return bf16_value(bf16); }

// nearest-even e4m3fn value of v (|v| <= 448, or NaN, kept), as fp32
inline float e4m3(float v) {
  if (v != v) return v;  // a NaN's mantissa could carry into the sign bit below
  const float a = std::fabs(v);
  // below 2^-6 the subnormal grid, step 2^-9 (a * 2^9 is exact)
  const float sub = std::nearbyint(a * 512.0f) * (1.0f / 512.0f);
  // normal: keep 3 mantissa bits, ties to even; a carry moves to the next binade
  const uint32_t u = bits(a);
  const float normal = from_bits((u + 0x7FFFFu + ((u >> 20) & 1u)) & ~0xFFFFFu);
  return std::copysign(a < 0.015625f ? sub : normal, v);
}

// power-of-two ceiling of an fp32 ratio as a UE8M0 scale, exponent byte clamped to [1, 254]
inline float ue8m0_ceil(float ratio) {
  const uint32_t u = bits(ratio);
  int32_t e = int32_t((u >> 23) & 0xFFu) + ((u & 0x7FFFFFu) != 0);
  e = e < 1 ? 1 : e > 254 ? 254 : e;
  return from_bits(uint32_t(e) << 23);
}

// the FP8 activation scale of a block with maximum |x| = amax
inline float ue8m0(float amax) {
  return ue8m0_ceil((amax < kAmaxFloor ? kAmaxFloor : amax) * kInvE4m3Max);  // NaN stays NaN
}

// max |x[0..block)|, NaN when any element is NaN (torch's amax); exact in any order
template <class T>
float block_amax(const T* x, int64_t block) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < block; ++i) {
    const float a = std::fabs(to_float(x[i]));
    nan |= a != a;
    amax = a > amax ? a : amax;
  }
  return nan ? NAN : amax;
}

// one block x[0..block) -> out, scalar
template <class T>
void block_scalar(const T* x, float* out, int64_t block) {
  const float s = ue8m0(block_amax(x, block));
  for (int64_t i = 0; i < block; ++i) {
    float v = to_float(x[i]) / s;
    v = v < -kE4m3Max ? -kE4m3Max : v > kE4m3Max ? kE4m3Max : v;  // NaN passes
    out[i] = e4m3(v) * s;
  }
}

#ifdef __AVX2__
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// block_amax of block % 8 == 0 elements, 8 lanes at a time (the max is exact in any order)
template <class T>
float block_amax_avx2(const T* x, int64_t block) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int64_t i = 0; i < block; i += 8) {
    const __m256 a = _mm256_and_ps(load8(x + i), abs_mask);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    amax = _mm256_max_ps(a, amax);  // a NaN lane keeps amax; nan records it
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
  return _mm256_movemask_ps(nan) ? NAN : m;
}

// e4m3() of 8 lanes v (|v| <= 448), the same integer and rounding steps; NaN lanes come out
// unspecified, for the caller to patch
inline __m256 e4m3_avx2(__m256 v) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0x80000000u)));
  const __m256 a = _mm256_and_ps(v, abs_mask);
  const __m256 sub = _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                   _mm256_set1_ps(1.0f / 512.0f));
  const __m256i u = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
  const __m256 normal = _mm256_castsi256_ps(_mm256_and_si256(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFFF)), odd), _mm256_set1_epi32(~0xFFFFF)));
  const __m256 r = _mm256_blendv_ps(normal, sub, _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ));
  return _mm256_or_ps(r, _mm256_and_ps(v, sign));
}

// block_scalar, 8 lanes at a time (block % 8 == 0); the same operations lane by lane: x * 2^-e
// rounds the same exact value as x / 2^e (2^-127 is an fp32 subnormal), and NaN lanes are passed
// through as block_scalar passes them
template <class T>
void block_avx2(const T* x, float* out, int64_t block) {
  const float s = ue8m0(block_amax_avx2(x, block));
  const __m256 vs = _mm256_set1_ps(s), vinv = _mm256_set1_ps(1.0f / s);
  const __m256 hi = _mm256_set1_ps(kE4m3Max), lo = _mm256_set1_ps(-kE4m3Max);
  for (int64_t i = 0; i < block; i += 8) {
    const __m256 xv = load8(x + i);
    const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(xv, vinv), lo), hi);  // NaN lanes fixed below
    const __m256 r = _mm256_mul_ps(e4m3_avx2(v), vs);
    _mm256_storeu_ps(out + i, _mm256_blendv_ps(r, xv, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q)));
  }
}

// state_block of an e4m3 x UE8M0 block (block % 8 == 0), 8 lanes at a time: x / s clamped, e4m3()
// (e4m3_avx2), then e4m3_byte's code: (bits >> 20) - (120 << 3) for a normal value (exponent
// rebiased from fp32's 127 to e4m3's 7, three mantissa bits), a * 2^9 below 2^-6, the sign, and
// sign | 0x7F for a NaN x (x / s keeps x's NaN and its sign). Divides as state_block does.
template <class T>
void state_fp8_avx2(const T* x, uint8_t* codes, uint8_t* scale, int64_t block) {
  const float s = ue8m0(block_amax_avx2(x, block));
  *scale = uint8_t((bits(s) >> 23) & 0xFFu);
  const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps(kE4m3Max), lo = _mm256_set1_ps(-kE4m3Max);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i sign = _mm256_set1_epi32(0x80), nan_code = _mm256_set1_epi32(0x7F);
  for (int64_t i = 0; i < block; i += 8) {
    const __m256 xv = load8(x + i);
    const __m256 r = e4m3_avx2(_mm256_min_ps(_mm256_max_ps(_mm256_div_ps(xv, vs), lo), hi));
    const __m256 a = _mm256_and_ps(r, abs_mask);
    const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(a), 20), _mm256_set1_epi32(120 << 3));
    const __m256i sub = _mm256_cvttps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)));
    __m256i c = _mm256_blendv_epi8(normal, sub, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ)));
    c = _mm256_or_si256(c, _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(r), 24), sign));
    const __m256i nan = _mm256_or_si256(nan_code, _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(xv), 24), sign));
    c = _mm256_blendv_epi8(c, nan, _mm256_castps_si256(_mm256_cmp_ps(xv, xv, _CMP_UNORD_Q)));
    const __m128i c16 = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packus_epi16(c16, c16));
  }
}
#endif

template <class T>
void run_rows(const T* x, float* out, int64_t rows, int64_t K, int64_t block) {
  torch::stable::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b0 = 0; b0 < K; b0 += block) {
#ifdef __AVX2__
        if (block % 8 == 0) {
          block_avx2(x + r * K + b0, out + r * K + b0, block);
          continue;
        }
#endif
        block_scalar(x + r * K + b0, out + r * K + b0, block);
      }
  });
}

constexpr float kE2m1Max = 6.0f;
constexpr float kFp4Ue8m0Floor = 6.0f * 0x1p-126f;  // graphs/quant.py _FP4_UE8M0_AMAX_FLOOR
constexpr float kFp4E4m3Floor = 6.0f * 0x1p-9f;     // _FP4_E4M3_AMAX_FLOOR
constexpr float kInvE2m1Max = 1.0f / 6.0f;          // fp32(1/6)

// nearest e2m1 value of v in [-6, 6] (or NaN), ties to the even code: step .5 below 2, 1 below 4, 2 above
inline float e2m1(float v) {
  const float a = std::fabs(v);
  const float r = a < 2.0f ? std::nearbyint(a * 2.0f) * 0.5f
                : a < 4.0f ? std::nearbyint(a)
                           : std::nearbyint(a * 0.5f) * 2.0f;
  return std::copysign(r, v);
}

template <class T>
void fp4_block(const T* x, float* out, int64_t block, int64_t scale_fmt) {
  const float amax = block_amax(x, block);
  float s;
  if (scale_fmt == 0) {
    s = ue8m0_ceil((amax < kFp4Ue8m0Floor ? kFp4Ue8m0Floor : amax) * kInvE2m1Max);
  } else {
    float r = (amax < kFp4E4m3Floor ? kFp4E4m3Floor : amax) / kE2m1Max;
    r = r < -kE4m3Max ? -kE4m3Max : r > kE4m3Max ? kE4m3Max : r;
    s = e4m3(r);
  }
  for (int64_t i = 0; i < block; ++i) {
    float v = to_float(x[i]) / s;
    v = v < -kE2m1Max ? -kE2m1Max : v > kE2m1Max ? kE2m1Max : v;  // NaN passes
    out[i] = e2m1(v) * s;
  }
}

// checks shared by both ops; returns K
int64_t check_x(const char* op, const Tensor& x, int64_t block) {
  DSN_CHECK(x.scalar_type() == ST::BFloat16 || x.scalar_type() == ST::Float, op,
            ": x must be a bfloat16 or float32 tensor, got ", torch::headeronly::toString(x.scalar_type()));
  DSN_CHECK(x.dim() >= 1, op, ": x must have a last dimension K, got a 0-dim tensor");
  DSN_CHECK(block > 0, op, ": block must be positive, got ", block);
  const int64_t K = x.size(x.dim() - 1);
  DSN_CHECK(K % block == 0, op, ": K = x.size(-1) must be a multiple of block = ", block, ", got ", K);
  return K;
}

Tensor fp4_act_dequant(Tensor x_in, int64_t block, int64_t scale_fmt) {
  const char* op = "fp4_act_dequant";
  const int64_t K = check_x(op, x_in, block);
  DSN_CHECK(scale_fmt == 0 || scale_fmt == 1, op, ": scale_fmt must be 0 (ue8m0) or 1 (e4m3), got ", scale_fmt);
  const Tensor x = x_in.is_contiguous() ? x_in : torch::stable::contiguous(x_in);
  Tensor out = torch::stable::new_empty(x, x.sizes(), ST::Float);
  const int64_t blocks = K ? x.numel() / block : 0;
  float* o = static_cast<float*>(out.mutable_data_ptr());
  const bool bf16 = x.scalar_type() == ST::BFloat16;
  const void* p = x.const_data_ptr();
  torch::stable::parallel_for(0, blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (bf16)
        fp4_block(static_cast<const uint16_t*>(p) + b * block, o + b * block, block, scale_fmt);
      else
        fp4_block(static_cast<const float*>(p) + b * block, o + b * block, block, scale_fmt);
    }
  });
  return out;
}

Tensor fp8_act_dequant(Tensor x_in, int64_t block) {
  const int64_t K = check_x("fp8_act_dequant", x_in, block);
  const Tensor x = x_in.is_contiguous() ? x_in : torch::stable::contiguous(x_in);
  Tensor out = torch::stable::new_empty(x, x.sizes(), ST::Float);
  const int64_t rows = K ? x.numel() / K : 0;
  float* o = static_cast<float*>(out.mutable_data_ptr());
  if (x.scalar_type() == ST::Float)
    run_rows(static_cast<const float*>(x.const_data_ptr()), o, rows, K, block);
  else
    run_rows(static_cast<const uint16_t*>(x.const_data_ptr()), o, rows, K, block);
  return out;
}

// e4m3fn byte of an fp32 value on the e4m3 grid (|v| <= 448 or NaN)
inline uint8_t e4m3_byte(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  if (a != a) return sign | 0x7F;
  if (a < 0.015625f) return sign | uint8_t(a * 512.0f);  // subnormal: a multiple of 2^-9
  const uint32_t u = bits(a);
  return sign | uint8_t(((int32_t((u >> 23) & 0xFFu) - 127 + 7) << 3) | ((u >> 20) & 7u));
}

// e2m1 code of an e2m1 value (signed, -0 included): bit 3 the sign
inline uint8_t e2m1_code(float r) {
  const float a = std::fabs(r);
  const float m = a < 2.0f ? a * 2.0f : a < 4.0f ? a + 2.0f : a * 0.5f + 4.0f;
  return uint8_t(m) | (std::signbit(r) ? 8 : 0);
}

struct StateFmt {
  bool fp8;         // e4m3 codes (else e2m1)
  bool ue8m0;       // UE8M0 scale bytes (else e4m3 scale bytes)
  int64_t code_bytes(int64_t K) const { return fp8 ? K : K / 2; }
};

StateFmt state_fmt(const char* op, int64_t fmt) {
  DSN_CHECK(fmt >= 0 && fmt <= 2, op, ": fmt must be 0 (e4m3 x ue8m0), 1 (e2m1 x ue8m0) or 2 (e2m1 x e4m3), got ", fmt);
  return StateFmt{fmt == 0, fmt != 2};
}

// one block of x -> its codes (at codes, e4m3: block bytes, e2m1: block / 2) and its scale byte
template <class T>
void state_block(const T* x, uint8_t* codes, uint8_t* scale, int64_t block, StateFmt f) {
  const float amax = block_amax(x, block);
  float s;
  if (f.fp8) {
    s = ue8m0(amax);
  } else if (f.ue8m0) {
    s = ue8m0_ceil((amax < kFp4Ue8m0Floor ? kFp4Ue8m0Floor : amax) * kInvE2m1Max);
  } else {
    float r = (amax < kFp4E4m3Floor ? kFp4E4m3Floor : amax) / kE2m1Max;
    s = e4m3(r > kE4m3Max ? kE4m3Max : r);
  }
  *scale = f.ue8m0 ? uint8_t((bits(s) >> 23) & 0xFFu) : e4m3_byte(s);
  const float lim = f.fp8 ? kE4m3Max : kE2m1Max;
  for (int64_t i = 0; i < block; ++i) {
    float v = to_float(x[i]) / s;
    v = v < -lim ? -lim : v > lim ? lim : v;  // NaN passes
    if (f.fp8) {
      codes[i] = e4m3_byte(e4m3(v));
    } else {
      const uint8_t c = e2m1_code(e2m1(v));
      codes[i / 2] = (i & 1) ? uint8_t(codes[i / 2] | (c << 4)) : c;
    }
  }
}

Tensor state_quant(Tensor x_in, int64_t block, int64_t fmt) {
  const char* op = "state_quant";
  const int64_t K = check_x(op, x_in, block);
  const StateFmt f = state_fmt(op, fmt);
  DSN_CHECK(f.fp8 || block % 2 == 0, op, ": an e2m1 block must be even, got ", block);
  const Tensor x = x_in.is_contiguous() ? x_in : torch::stable::contiguous(x_in);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  const int64_t row = f.code_bytes(K) + K / block;
  shape.back() = row;
  Tensor out = torch::stable::new_empty(x, shape, ST::Byte);
  const int64_t rows = K ? x.numel() / K : 0;
  uint8_t* o = static_cast<uint8_t*>(out.mutable_data_ptr());
  const bool bf16 = x.scalar_type() == ST::BFloat16;
  const void* p = x.const_data_ptr();
  torch::stable::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t j = 0; j < K / block; ++j) {
        uint8_t* codes = o + r * row + f.code_bytes(j * block);
        uint8_t* scale = o + r * row + f.code_bytes(K) + j;
#ifdef __AVX2__
        if (f.fp8 && block % 8 == 0) {
          if (bf16)
            state_fp8_avx2(static_cast<const uint16_t*>(p) + r * K + j * block, codes, scale, block);
          else
            state_fp8_avx2(static_cast<const float*>(p) + r * K + j * block, codes, scale, block);
          continue;
        }
#endif
        if (bf16)
          state_block(static_cast<const uint16_t*>(p) + r * K + j * block, codes, scale, block, f);
        else
          state_block(static_cast<const float*>(p) + r * K + j * block, codes, scale, block, f);
      }
  });
  return out;
}

// the value of an e4m3fn byte (exact)
inline float e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  float a = e ? std::ldexp(float(8 + m), e - 10) : float(m) * (1.0f / 512.0f);
  if (e == 15 && m == 7) a = NAN;
  return (b & 0x80) ? -a : a;
}

#ifdef __AVX2__
// bf16_bits of 8 lanes, lane for lane the same integer steps
inline __m128i bf16_bits8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x), hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // each lane < 2^16
}

// elements i0 .. i0 + n - 1 of a row (n a multiple of 8, e4m3, or 16, e2m1), all of one block with
// scale s: the scalar loop's v * s and bf16_bits, 8 lanes at a time (the same table values)
inline void dequant_run_avx2(const uint8_t* codes, int64_t i0, int64_t n, float s, bool fp8, const float* e4m3_lut,
                             uint16_t* o) {
  const __m256 vs = _mm256_set1_ps(s);
  auto store = [&](int64_t i, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), bf16_bits8(v)); };
  if (fp8) {
    for (int64_t i = i0; i < i0 + n; i += 8) {
      const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
      store(i, _mm256_mul_ps(_mm256_i32gather_ps(e4m3_lut, c, 4), vs));
    }
    return;
  }
  const __m256i nib = _mm256_set1_epi32(0xF);
  for (int64_t i = i0; i < i0 + n; i += 16) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2)));
    const __m256 lo = _mm256_mul_ps(_mm256_i32gather_ps(kE2m1Values, _mm256_and_si256(b, nib), 4), vs);
    const __m256 hi = _mm256_mul_ps(_mm256_i32gather_ps(kE2m1Values, _mm256_srli_epi32(b, 4), 4), vs);
    // element 2j is byte j's low nibble, 2j + 1 its high one
    const __m256 a = _mm256_unpacklo_ps(lo, hi), c = _mm256_unpackhi_ps(lo, hi);
    store(i, _mm256_permute2f128_ps(a, c, 0x20));
    store(i + 8, _mm256_permute2f128_ps(a, c, 0x31));
  }
}
#endif

Tensor state_dequant(Tensor b_in, int64_t K, int64_t block, int64_t fmt) {
  const char* op = "state_dequant";
  const StateFmt f = state_fmt(op, fmt);
  DSN_CHECK(b_in.scalar_type() == ST::Byte, op, ": b must be a uint8 tensor, got ", torch::headeronly::toString(b_in.scalar_type()));
  DSN_CHECK(b_in.dim() >= 1, op, ": b must have a last dimension, got a 0-dim tensor");
  DSN_CHECK(block > 0 && K > 0 && K % block == 0 && (f.fp8 || block % 2 == 0), op,
            ": K must be a positive multiple of block (an even block for e2m1), got K = ", K, ", block = ", block);
  const int64_t row = f.code_bytes(K) + K / block;
  DSN_CHECK(b_in.size(b_in.dim() - 1) == row, op, ": b's last dimension must be ", row, " bytes for K = ", K,
            ", got ", b_in.size(b_in.dim() - 1));
  const Tensor b = b_in.is_contiguous() ? b_in : torch::stable::contiguous(b_in);
  std::vector<int64_t> shape(b.sizes().begin(), b.sizes().end());
  shape.back() = K;
  Tensor out = torch::stable::new_empty(b, shape, ST::BFloat16);
  const int64_t rows = b.numel() / row;
  float e4m3_lut[256];
  for (int i = 0; i < 256; ++i) e4m3_lut[i] = e4m3_value(uint8_t(i));
  const uint8_t* in = static_cast<const uint8_t*>(b.const_data_ptr());
  uint16_t* o = static_cast<uint16_t*>(out.mutable_data_ptr());
  torch::stable::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* codes = in + r * row;
      const uint8_t* scales = codes + f.code_bytes(K);
      for (int64_t j = 0; j < K / block; ++j) {
        const uint8_t sb = scales[j];
        const float s = f.ue8m0 ? ue8m0_value(sb) : e4m3_lut[sb];
#ifdef __AVX2__
        if (block % (f.fp8 ? 8 : 16) == 0) {
          dequant_run_avx2(codes, j * block, block, s, f.fp8, e4m3_lut, o + r * K);
          continue;
        }
#endif
        for (int64_t i = j * block; i < (j + 1) * block; ++i) {
          const float v = f.fp8 ? e4m3_lut[codes[i]] : kE2m1Values[(codes[i / 2] >> ((i & 1) * 4)) & 0xF];
          o[r * K + i] = bf16_bits(v * s);
        }
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace dsn

STABLE_TORCH_LIBRARY_FRAGMENT(DSN_NS, m) {
  m.def("fp8_act_dequant(Tensor x, int block) -> Tensor");
  m.def("fp4_act_dequant(Tensor x, int block, int scale_fmt) -> Tensor");
  m.def("state_quant(Tensor x, int block, int fmt) -> Tensor");
  m.def("state_dequant(Tensor b, int K, int block, int fmt) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(DSN_NS, CPU, m) {
  m.impl("fp8_act_dequant", TORCH_BOX(&dsn::fp8_act_dequant));
  m.impl("fp4_act_dequant", TORCH_BOX(&dsn::fp4_act_dequant));
  m.impl("state_quant", TORCH_BOX(&dsn::state_quant));
  m.impl("state_dequant", TORCH_BOX(&dsn::state_dequant));
}
