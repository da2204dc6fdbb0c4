// dsneuron::sparse_attn_cpu / exp_cpu: sparse attention with a 64-slot online softmax in a fixed order.
//
// Contract (cpu_attn.py holds the full text and the torch reference sparse_attn_cpu_ref): per query
// row (b, s) and head h, over the slots of idx[b, s] in blocks of 64 (the last may be partial), all fp32:
//   logit_j = (fma chain over d ascending of q[h][d] * k_j[d], from 0) * scale   (-inf: empty slot)
//   m_new = max(m, max_j logit_j)   alpha = exp(m - m_new)   p_j = exp(logit_j - m_new)
//   l = l * alpha + (p_j summed in slot order from 0)
//   o[d] = o[d] * alpha + (fma chain over the block's slots of bf16(p_j) * v_j[d], from 0)
//   out[d] = bf16(o[d] / (l + exp(sink[h] - m))), 0 where l == 0
// with m from -1e30, l and o from 0, exp = vexp below, and v_j = k_j = kv[b, idx_j].
// An empty slot (idx outside [0, N)) contributes exactly nothing to any of these: -inf leaves a max
// unchanged, its p is exp(-inf) = +0, and adding +0 (or an fma with a +0 product) to a chain that
// started at +0 gives the chain back bit for bit (such a chain never holds -0). So the kernels skip
// empty slots, never read their kv rows, and still follow the contract's sequence exactly.
//
// Vectorisation (every lane runs the contract's scalar sequence, nothing reduces across lanes):
//   logits   one lane per head: acc[j][heads] += qT[d][heads] * broadcast(k_j[d]), d ascending;
//            register tiles of 1 x 12, 2 x 6 or 4 x 3 (8-head vectors x keys)
//   softmax  one lane per head (max, exp, sums over the block's slots in order)
//   P @ V    one lane per d: acc[h][d..d+7] += broadcast(bf16(p_j)[h]) * v_j[d..d+7], j in order;
//            register tiles of 4 heads x 3 vectors of d
// Work items are (query row, group of 8-head vectors); rows are whole items unless there are too
// few to feed the threads (decode), then head groups split. Threads take items from a shared
// counter, and each output element is computed by one thread from start to end, so the result
// does not depend on S, B, the thread count or the ISA (the AVX2 and the portable layer give the
// same bits; tests check it). K/V rows are used as exact fp32 copies: the whole kv converted once
// when the slots outnumber its rows (prefill), else each item's referenced rows (decode).
// Argument errors throw std::invalid_argument (-> ValueError). Same build as gemm.cpp (one extension).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "check.h"
#include "simd.h"

#ifndef DSN_NS
#error "build with -DDSN_NS=<op namespace>"
#endif

namespace dsn {
namespace {

constexpr int64_t kBlockKeys = 64;  // slots per online-softmax step (sparse_attn_ref.BLOCK_KEYS)
constexpr float kMInit = -1e30f;    // running-max start (sparse_attn_ref.M_INIT)
constexpr int kLanes = 8;           // fp32 lanes of V
constexpr int kQkTile = 12;         // accumulators of a logits tile (8-head vectors x keys)
constexpr int kPvHeads = 4, kPvVecs = 3;  // P @ V tile: 4 heads x 3 vectors of d = 12 accumulators

// ------------------------------------------------------------------------------ vector layer
// What simd.h does not provide; the same semantics on both layers, lane by lane.

#if DSN_AVX2

inline V vsub(V a, V b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline V vdiv(V a, V b) { return {_mm256_div_ps(a.v, b.v)}; }
// max(a, b) that is NaN when either is (torch.maximum); maxps alone returns b when either is NaN
inline V vmax_nan(V a, V b) {
  return {_mm256_blendv_ps(_mm256_max_ps(a.v, b.v), a.v, _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q))};
}
// min(max(x, lo), hi) for non-NaN x (a NaN lane gets some finite value)
inline V vclamp(V x, float lo, float hi) {
  return {_mm256_min_ps(_mm256_max_ps(x.v, _mm256_set1_ps(lo)), _mm256_set1_ps(hi))};
}
// x where x is NaN, else y
inline V vnan_or(V x, V y) { return {_mm256_blendv_ps(y.v, x.v, _mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q))}; }
// p * 2^k1 * 2^k2 (two roundings at most: the first product is exact), k = bits(t) - bits(shift),
// k1 = k >> 1 (arithmetic), k2 = k - k1; both powers are normal numbers for k in [-150, 128]
inline V vldexp_split(V p, V t, int32_t shift_bits) {
  const __m256i k = _mm256_sub_epi32(_mm256_castps_si256(t.v), _mm256_set1_epi32(shift_bits));
  const __m256i k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
  return {_mm256_mul_ps(_mm256_mul_ps(p.v, s1), s2)};
}
// fp32 -> nearest-even bf16 -> fp32 (NaN -> 0x7FC0, c10::BFloat16's scalar conversion)
inline __m256i bf16_bits32(V x) {
  const __m256i b = _mm256_castps_si256(x.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                                     _mm256_set1_epi32(int32_t(0xFFFF0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan);
}
inline V vbf16(V x) { return {_mm256_castsi256_ps(bf16_bits32(x))}; }
// the bf16 bit patterns of bf16(x) for the first n lanes -> p[0..n)
inline void store_bf16(uint16_t* p, V x, int n) {
  const __m256i h = _mm256_srli_epi32(bf16_bits32(x), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  if (n == kLanes) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  } else {
    alignas(16) uint16_t tmp[kLanes];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), packed);
    std::memcpy(p, tmp, sizeof(uint16_t) * n);
  }
}

#else  // portable layer

inline V vsub(V a, V b) { V r; for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] - b.v[i]; return r; }
inline V vdiv(V a, V b) { V r; for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] / b.v[i]; return r; }
inline V vmax_nan(V a, V b) {
  V r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = std::isnan(a.v[i]) ? a.v[i] : a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return r;
}
inline V vclamp(V x, float lo, float hi) {
  V r;
  for (int i = 0; i < kLanes; ++i) {
    const float v = std::isnan(x.v[i]) ? lo : x.v[i];
    r.v[i] = v < lo ? lo : v > hi ? hi : v;
  }
  return r;
}
inline V vnan_or(V x, V y) { V r; for (int i = 0; i < kLanes; ++i) r.v[i] = std::isnan(x.v[i]) ? x.v[i] : y.v[i]; return r; }
inline V vldexp_split(V p, V t, int32_t shift_bits) {
  V r;
  for (int i = 0; i < kLanes; ++i) {
    const int32_t k = int32_t(bits(t.v[i]) - uint32_t(shift_bits)), k1 = k >> 1, k2 = k - k1;
    r.v[i] = (p.v[i] * from_bits(uint32_t(k1 + 127) << 23)) * from_bits(uint32_t(k2 + 127) << 23);
  }
  return r;
}
inline uint32_t bf16_bits32(float x) {
  if (std::isnan(x)) return 0x7FC00000u;
  const uint32_t b = bits(x);
  return (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
}
inline V vbf16(V x) { V r; for (int i = 0; i < kLanes; ++i) r.v[i] = from_bits(bf16_bits32(x.v[i])); return r; }
inline void store_bf16(uint16_t* p, V x, int n) {
  for (int i = 0; i < n; ++i) p[i] = uint16_t(bf16_bits32(x.v[i]) >> 16);
}

#endif

// ------------------------------------------------------------------------------ exp
// fp32 exp(x), lane by lane, the same source on both layers (cpu_attn.exp_ref is it in torch ops):
//   x clamped to [-104, 89] (exp(-104) < 2^-150 rounds to 0, exp(89) overflows: the formula then
//   gives 0 and inf itself, also for -inf and +inf); NaN is returned as it is
//   k = nearest integer (ties to even) of x * log2(e): the exact fma(x, log2e, 1.5 * 2^23) rounds there
//   r = x - k * ln2 as fma(-k, ln2_hi, x) (exact: ln2_hi has 16 bits, |k| <= 150, Sterbenz) then
//       fma(-k, ln2_lo, r); |r| <= ln2/2 + 2^-20
//   p = exp(r) by a degree-7 polynomial in Horner form (fma), constant and linear coefficients 1
//       (p(0) = 1 exactly); the others fit (exp(r) - 1 - r) / r^2 on [-ln2/2, ln2/2] (Chebyshev,
//       rounded to fp32): relative error ~2^-30 before rounding
//   result = (p * 2^(k>>1)) * 2^(k - (k>>1)): the first product is exact, the second rounds once,
//       also into the subnormal range
// Measured over every fp32 x in [-104, 88.7]: max error 0.874 ulp, 99.55% correctly rounded.
constexpr float kExpShift = 0x1.8p23f;           // 1.5 * 2^23: adding it rounds to an integer
constexpr int32_t kExpShiftBits = 0x4B400000;    // its bit pattern: bits(t) - this = k
constexpr float kLog2e = 0x1.715476p+0f;
constexpr float kLn2Hi = 0x1.62e400p-1f;         // ln2 to 16 bits: k * ln2_hi is exact for |k| < 256
constexpr float kLn2Lo = 0x1.7f7d1cp-20f;        // ln2 - ln2_hi
constexpr float kExpPoly[] = {0x1.a124e4p-13f, 0x1.6d4316p-10f, 0x1.1110e0p-7f, 0x1.5554eap-5f,
                              0x1.555556p-3f, 0x1.000000p-1f, 1.0f, 1.0f};  // r^7 .. r^0

inline V vexp(V x) {
  const V xc = vclamp(x, -104.0f, 89.0f);
  const V t = vfma(xc, vset(kLog2e), vset(kExpShift));
  const V nk = vsub(vset(kExpShift), t);  // -k, exactly
  V r = vfma(nk, vset(kLn2Hi), xc);
  r = vfma(nk, vset(kLn2Lo), r);
  V p = vset(kExpPoly[0]);
  for (int i = 1; i < 8; ++i) p = vfma(p, r, vset(kExpPoly[i]));
  return vnan_or(x, vldexp_split(p, t, kExpShiftBits));
}

// ------------------------------------------------------------------------------ kernels

// n in [1, N] -> f(integral_constant<int, n>)
template <int N, class F>
inline void with_count(int n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_count<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// logits of NJ keys for NH head vectors: lg[j][hv] = (fma chain over d of qT[d][hv] * k_j[d]) * scale
template <int NH, int NJ>
void qk_tile(const float* qT, int64_t hw, const float* const* rows, int64_t D, float scale, float* lg) {
  V acc[NJ][NH];
  for (auto& a : acc)
    for (auto& x : a) x = vzero();
  const float* k[NJ];
  for (int j = 0; j < NJ; ++j) k[j] = rows[j];
  for (int64_t d = 0; d < D; ++d) {
    V qv[NH];
    for (int h = 0; h < NH; ++h) qv[h] = vload(qT + d * hw + kLanes * h);
    for (int j = 0; j < NJ; ++j) {
      const V kb = vbcast(k[j] + d);
      for (int h = 0; h < NH; ++h) acc[j][h] = vfma(qv[h], kb, acc[j][h]);
    }
  }
  const V sc = vset(scale);
  for (int j = 0; j < NJ; ++j)
    for (int h = 0; h < NH; ++h) vstore(lg + j * hw + kLanes * h, vmul(acc[j][h], sc));
}

// all nv logits of an item: qT [D][hw], hw = 8 * nhv lanes; lg [nv][hw]
void qk_all(const float* qT, int64_t hw, int64_t nhv, const float* const* rows, int64_t nv, int64_t D, float scale,
            float* lg) {
  for (int64_t v0 = 0; v0 < nhv;) {
    const int64_t left = nhv - v0;
    const int nh = left >= 4 ? 4 : left >= 2 ? 2 : 1;
    auto run = [&](auto NH) {
      constexpr int kJ = kQkTile / decltype(NH)::value;
      for (int64_t j0 = 0; j0 < nv; j0 += kJ)
        with_count<kJ>(int(std::min<int64_t>(kJ, nv - j0)), [&](auto NJ) {
          qk_tile<decltype(NH)::value, decltype(NJ)::value>(qT + kLanes * v0, hw, rows + j0, D, scale, lg + j0 * hw + kLanes * v0);
        });
    };
    if (nh == 4) run(std::integral_constant<int, 4>{});
    else if (nh == 2) run(std::integral_constant<int, 2>{});
    else run(std::integral_constant<int, 1>{});
    v0 += nh;
  }
}

// one block's P @ V for NH heads x NDV vectors of d, then o = o * alpha + pv:
// p16 [nj][hw] (bf16-rounded p, head h at column h), rows[j] the block's nj value rows, o [NH][ldo]
template <int NH, int NDV>
void pv_tile(const float* p16, int64_t hw, const float* const* rows, int64_t nj, int64_t d0, float* o, int64_t ldo,
             const float* alpha) {
  V acc[NH][NDV];
  for (auto& a : acc)
    for (auto& x : a) x = vzero();
  for (int64_t j = 0; j < nj; ++j) {
    V v[NDV];
    for (int c = 0; c < NDV; ++c) v[c] = vload(rows[j] + d0 + kLanes * c);
    for (int h = 0; h < NH; ++h) {
      const V pb = vbcast(p16 + j * hw + h);
      for (int c = 0; c < NDV; ++c) acc[h][c] = vfma(pb, v[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    const V al = vbcast(alpha + h);
    for (int c = 0; c < NDV; ++c) {
      float* dst = o + h * ldo + d0 + kLanes * c;
      vstore(dst, vadd(vmul(vload(dst), al), acc[h][c]));
    }
  }
}

void pv_all(const float* p16, int64_t hw, int64_t nh, const float* const* rows, int64_t nj, int64_t Dp, float* o,
            const float* alpha) {
  const int64_t nvec = Dp / kLanes;
  for (int64_t c0 = 0; c0 < nvec; c0 += kPvVecs) {
    const int nc = int(std::min<int64_t>(kPvVecs, nvec - c0));
    for (int64_t h0 = 0; h0 < nh; h0 += kPvHeads) {
      const int hh = int(std::min<int64_t>(kPvHeads, nh - h0));
      with_count<kPvHeads>(hh, [&](auto NH) {
        with_count<kPvVecs>(nc, [&](auto NDV) {
          pv_tile<decltype(NH)::value, decltype(NDV)::value>(p16 + h0, hw, rows, nj, kLanes * c0, o + h0 * Dp, Dp, alpha + h0);
        });
      });
    }
  }
}

struct Problem {
  const uint16_t* q;    // [B, S, H, D] bf16 bits
  const uint16_t* kv;   // [B, N, D]
  const float* sink;    // [H]
  const int32_t* idx;   // [B, S, K]
  uint16_t* out;        // [B, S, H, D]
  float scale;
  int64_t S, H, D, N, K;
  int64_t Dp;           // D rounded up to whole vectors: row stride of the fp32 K/V rows
  const float* table;   // [B * N][Dp] fp32 copy of kv, or null: items convert their own rows
};

// kv row (D bf16) -> dst (Dp fp32, zero padded)
inline void convert_row(const uint16_t* src, int64_t D, int64_t Dp, float* dst) {
  for (int64_t d = 0; d < D; ++d) dst[d] = bf16_value(src[d]);
  for (int64_t d = D; d < Dp; ++d) dst[d] = 0.0f;
}

// per-thread buffers, sized for the largest item
struct Scratch {
  std::vector<float> qT, lg, p16, o, alpha, kbuf;
  std::vector<const float*> rows;
  std::vector<int64_t> bstart;
  Scratch(const Problem& pb, int64_t hw) {
    qT.resize(pb.D * hw);
    lg.resize(pb.K * hw);
    p16.resize(kBlockKeys * hw);
    o.resize(hw * pb.Dp);
    alpha.resize(hw);
    if (!pb.table) kbuf.resize(pb.K * pb.Dp);
    rows.resize(pb.K);
    bstart.resize((pb.K + kBlockKeys - 1) / kBlockKeys + 1);
  }
};

// query row r (= b * S + s), head vectors [v0, v1)
void attend(const Problem& pb, int64_t r, int64_t v0, int64_t v1, Scratch& sc) {
  const int64_t b = r / pb.S, hw = kLanes * (v1 - v0), nhv = v1 - v0;
  const int64_t h0 = kLanes * v0, nh = std::min(pb.H, kLanes * v1) - h0;
  const int64_t D = pb.D, Dp = pb.Dp, K = pb.K, N = pb.N;
  // the valid slots in order, and where each 64-slot block starts among them
  const int32_t* ids = pb.idx + r * K;
  int64_t nv = 0;
  for (int64_t j = 0; j < K; ++j) {
    if (j % kBlockKeys == 0) sc.bstart[j / kBlockKeys] = nv;
    const int32_t t = ids[j];
    if (t < 0 || t >= N) continue;
    if (pb.table) {
      sc.rows[nv] = pb.table + (b * N + t) * Dp;
    } else {
      float* dst = sc.kbuf.data() + nv * Dp;
      convert_row(pb.kv + (b * N + t) * D, D, Dp, dst);
      sc.rows[nv] = dst;
    }
    ++nv;
  }
  const int64_t nblk = (K + kBlockKeys - 1) / kBlockKeys;
  sc.bstart[nblk] = nv;
  // qT [D][hw]: lane h of row d is q[r, h0 + h, d]; padding lanes 0
  float* qT = sc.qT.data();
  std::fill(qT, qT + D * hw, 0.0f);
  for (int64_t h = 0; h < nh; ++h) {
    const uint16_t* qh = pb.q + (r * pb.H + h0 + h) * D;
    for (int64_t d = 0; d < D; ++d) qT[d * hw + h] = bf16_value(qh[d]);
  }
  float* lg = sc.lg.data();
  qk_all(qT, hw, nhv, sc.rows.data(), nv, D, pb.scale, lg);

  // online softmax over the blocks, one lane per head
  V m[8], l[8];  // nhv <= 8 (see run())
  for (int64_t v = 0; v < nhv; ++v) m[v] = vset(kMInit), l[v] = vzero();
  float* o = sc.o.data();
  std::fill(o, o + nh * Dp, 0.0f);
  float* p16 = sc.p16.data();
  float* alpha = sc.alpha.data();
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const int64_t a0 = sc.bstart[blk], a1 = sc.bstart[blk + 1];
    for (int64_t v = 0; v < nhv; ++v) {
      V mn = m[v];
      for (int64_t j = a0; j < a1; ++j) mn = vmax_nan(mn, vload(lg + j * hw + kLanes * v));
      const V al = vexp(vsub(m[v], mn));
      V ps = vzero();
      for (int64_t j = a0; j < a1; ++j) {
        const V p = vexp(vsub(vload(lg + j * hw + kLanes * v), mn));
        ps = vadd(ps, p);
        vstore(p16 + (j - a0) * hw + kLanes * v, vbf16(p));
      }
      l[v] = vadd(vmul(l[v], al), ps);
      vstore(alpha + kLanes * v, al);
      m[v] = mn;
    }
    pv_all(p16, hw, nh, sc.rows.data() + a0, a1 - a0, Dp, o, alpha);
  }

  // out = bf16(o / (l + exp(sink - m))), 0 where l == 0
  alignas(32) float den[kLanes * 8], lsum[kLanes * 8];
  for (int64_t v = 0; v < nhv; ++v) {
    alignas(32) float s[kLanes];
    for (int i = 0; i < kLanes; ++i) s[i] = h0 + kLanes * v + i < pb.H ? pb.sink[h0 + kLanes * v + i] : 0.0f;
    vstore(den + kLanes * v, vadd(l[v], vexp(vsub(vload(s), m[v]))));
    vstore(lsum + kLanes * v, l[v]);
  }
  for (int64_t h = 0; h < nh; ++h) {
    uint16_t* dst = pb.out + (r * pb.H + h0 + h) * D;
    if (lsum[h] == 0.0f) {
      std::fill(dst, dst + D, uint16_t(0));
      continue;
    }
    const V dv = vset(den[h]);
    for (int64_t d = 0; d < D; d += kLanes)
      store_bf16(dst + d, vdiv(vload(o + h * Dp + d), dv), int(std::min<int64_t>(kLanes, D - d)));
  }
}

using torch::stable::Tensor;
using ST = torch::headeronly::ScalarType;


// torch's Python spelling of the dtypes this op takes, so messages match the fake implementation's
std::string dtype_name(ST t) {
  switch (t) {
    case ST::BFloat16: return "torch.bfloat16";
    case ST::Float: return "torch.float32";
    case ST::Int: return "torch.int32";
    case ST::Long: return "torch.int64";
    case ST::Half: return "torch.float16";
    case ST::Double: return "torch.float64";
    default: return torch::headeronly::toString(t);
  }
}

std::string describe(const Tensor& t) {
  std::ostringstream o;
  o << dtype_name(t.scalar_type()) << " (";
  const auto s = t.sizes();
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << (s.size() == 1 ? ",)" : ")");
  return o.str();
}

Tensor contig(const Tensor& t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }

Tensor sparse_attn_cpu(Tensor q_in, Tensor kv_in, Tensor sink_in, Tensor idx_in, double scale) {
  const char* op = "sparse_attn_cpu";
  DSN_CHECK(q_in.scalar_type() == ST::BFloat16 && q_in.dim() == 4, op, ": q must be bf16 [B,S,H,D], got ",
            describe(q_in));
  const int64_t B = q_in.size(0), S = q_in.size(1), H = q_in.size(2), D = q_in.size(3);
  DSN_CHECK(kv_in.scalar_type() == ST::BFloat16 && kv_in.dim() == 3 && kv_in.size(0) == B && kv_in.size(2) == D, op,
            ": kv must be bf16 [B=", B, ",N,D=", D, "], got ", describe(kv_in));
  DSN_CHECK(sink_in.scalar_type() == ST::Float && sink_in.dim() == 1 && sink_in.size(0) == H, op,
            ": sink must be fp32 [H=", H, "], got ", describe(sink_in));
  DSN_CHECK(idx_in.scalar_type() == ST::Int && idx_in.dim() == 3 && idx_in.size(0) == B && idx_in.size(1) == S, op,
            ": idx must be int32 [B=", B, ",S=", S, ",K], got ", describe(idx_in));
  const float sc = static_cast<float>(scale);
  DSN_CHECK(std::isfinite(scale) && std::isfinite(sc) && sc > 0.0f, op,
            ": scale must be finite and > 0 in fp32, got ", scale);
  const Tensor q = contig(q_in), kv = contig(kv_in), sink = contig(sink_in), idx = contig(idx_in);
  const int64_t N = kv.size(1), K = idx.size(2), R = B * S;
  Tensor out = torch::stable::new_empty(q, {B, S, H, D});
  if (out.numel() == 0) return out;

  Problem pb{static_cast<const uint16_t*>(q.const_data_ptr()), static_cast<const uint16_t*>(kv.const_data_ptr()),
             static_cast<const float*>(sink.const_data_ptr()), static_cast<const int32_t*>(idx.const_data_ptr()),
             static_cast<uint16_t*>(out.mutable_data_ptr()), sc, S, H, D, N, K,
             (D + kLanes - 1) / kLanes * kLanes, nullptr};
  // the fp32 K/V rows: all of kv converted once when the valid slots outnumber its rows
  int64_t slots = 0;
  for (int64_t i = 0; i < R * K; ++i) slots += pb.idx[i] >= 0 && pb.idx[i] < N;
  std::vector<float> table;
  if (B * N <= slots) {
    table.resize(B * N * pb.Dp);
    torch::stable::parallel_for(0, B * N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) convert_row(pb.kv + i * D, D, pb.Dp, table.data() + i * pb.Dp);
    });
    pb.table = table.data();
  }

  // items: (row, group of head vectors); halve the groups while rows alone cannot feed the threads
  const int64_t nth = torch::stable::get_num_threads(), nhv_all = (H + kLanes - 1) / kLanes;
  int64_t group = std::min<int64_t>(nhv_all, 8);
  while (group > 1 && R * ((nhv_all + group - 1) / group) < 2 * nth) group = (group + 1) / 2;
  const int64_t per_row = (nhv_all + group - 1) / group, items = R * per_row;
  const int64_t grab = std::max<int64_t>(1, items / (16 * nth));
  std::atomic<int64_t> next{0};
  torch::stable::parallel_for(0, nth, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      Scratch scr(pb, kLanes * group);
      for (;;) {
        const int64_t i0 = next.fetch_add(grab);
        if (i0 >= items) break;
        for (int64_t i = i0; i < std::min(i0 + grab, items); ++i) {
          const int64_t r = i / per_row, v0 = (i % per_row) * group;
          attend(pb, r, v0, std::min(v0 + group, nhv_all), scr);
        }
      }
    }
  });
  return out;
}

Tensor exp_cpu(Tensor x_in) {
  DSN_CHECK(x_in.scalar_type() == ST::Float, "exp_cpu: x must be fp32, got ", describe(x_in));
  const Tensor x = contig(x_in);
  Tensor out = torch::stable::new_empty(x, x.sizes());
  const int64_t n = x.numel();
  const float* src = static_cast<const float*>(x.const_data_ptr());
  float* dst = static_cast<float*>(out.mutable_data_ptr());
  torch::stable::parallel_for(0, (n + kLanes - 1) / kLanes, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t i = c * kLanes, m = std::min<int64_t>(kLanes, n - i);
      alignas(32) float buf[kLanes] = {};
      std::memcpy(buf, src + i, sizeof(float) * m);
      vstore(buf, vexp(vload(buf)));
      std::memcpy(dst + i, buf, sizeof(float) * m);
    }
  });
  return out;
}

}  // namespace
}  // namespace dsn

STABLE_TORCH_LIBRARY_FRAGMENT(DSN_NS, m) {
  m.def("sparse_attn_cpu(Tensor q, Tensor kv, Tensor sink, Tensor idx, float scale) -> Tensor");
  m.def("exp_cpu(Tensor x) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(DSN_NS, CPU, m) {
  m.impl("sparse_attn_cpu", TORCH_BOX(&dsn::sparse_attn_cpu));
  m.impl("exp_cpu", TORCH_BOX(&dsn::exp_cpu));
}
