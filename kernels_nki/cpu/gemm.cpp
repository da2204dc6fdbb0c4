// dsneuron::gemm_panels / gemm_panels_segments: block-scaled GEMM with a fixed summation order.
//
// Contract (cpu_gemm.py holds the full text and the torch reference gemm_panels_ref):
//   out[m, n] = sum over K blocks b ascending of partial_b, acc = 0, acc = acc + partial_b (fp32),
//   partial_b = fma chain over the 32 k of block b ascending, starting from 0,
// with w[n, k] the exact dequantised weight. Each SIMD lane is one output column (simd.h), each
// output element is computed by one thread from start to end, and the same scalar sequence of
// operations runs whatever the row count, the tile that holds the row, the thread count or the
// ISA: tiles only choose how many rows and blocks are in flight, never the order within an element.
//
// Kernels, per 16-column panel:
//   rows <= 6   (bf16: 12) decode on the fly from the checkpoint bytes, per 6-row tile (tile_direct):
//               one row keeps 4 blocks' partial chains in flight, two rows 2, so the fma latency is
//               hidden; the next panel is prefetched meanwhile (M = 1 streams the weight once);
//               fp8 / fp4 blocks take their power-of-two scale once, on the partial, where that
//               gives the same bits (FoldRange);
//   more rows   decode the panel once into a [K][16] fp32 buffer (L2-resident; fp32 weights are used
//               in place), then 6 x 16 register tiles (tile_buf): 12 accumulators hold the block
//               partials, the running acc lives in the 6 x 16 C tile in L1 and takes one add per
//               block. With >= 8 panels, a is first packed into 6-row tiles [K][6].
// Bindings use torch's stable C ABI (torch/csrc/stable, TORCH_TARGET_VERSION 2.10): its headers
// compile in seconds where torch/library.h takes ~15 s. Argument errors throw std::invalid_argument,
// which reaches Python as ValueError. Build: -O3 -ffp-contract=off, plus -mavx2 -mfma -mf16c for the
// AVX2 layer; -DDSN_NS names the op namespace (dsneuron, or another one for a second variant loaded
// next to it in tests).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "gemm_args.h"
#include "simd.h"

#ifndef DSN_NS
#error "build with -DDSN_NS=<op namespace>"
#endif

namespace dsn {
namespace {

constexpr int kTile = 6;        // rows per register tile: 6 x 2 accumulators + 2 weights + 1 broadcast <= 16 ymm
// Panels from which on a is packed into tiles for the decoded-panel kernel: packing costs about 1.5
// panels' work and makes each panel ~1.3x faster (measured at K = 256..4096, M = 172..715)
constexpr int64_t kPackPanels = 8;

// Rows up to which a panel is decoded on the fly for each 6-row tile rather than once into a buffer:
// decoding bf16 again is cheaper than the buffer's round trip, decoding fp8 / fp4 is not (measured)
constexpr int64_t direct_rows(int64_t fmt) { return fmt == BF16 ? 2 * kTile : kTile; }

// c[m][0..15] = c[m] + p[m]: the acc = acc + partial_b step (c starts at 0)
template <int M>
inline void add_partials(float* c, const V (&p)[M][2]) {
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) vstore(c + m * kPanel + 8 * h, vadd(vload(c + m * kPanel + 8 * h), p[m][h]));
}

// bytes from a panel's start to the next panel's (adjacent in memory)
template <class D>
int64_t panel_bytes(const D& d, int64_t kb) {
  return static_cast<const char*>(d.row_ptr(kb * kBlock)) - static_cast<const char*>(d.row_ptr(0));
}

// Scale folding. A block's partial is an fma chain p_k = fma(a_k, w_k, p_{k-1}) with w_k = r_k * f,
// r_k the raw decoded value and f a power of two (simd.h). The chain q_k = fma(a_k, r_k, q_{k-1}) on
// the raw values gives p_k = q_k * f exactly whenever no value of either chain leaves fp32's normal
// range: scaling by a power of two commutes with rounding to nearest there. So the block's partial
// may be computed as q * f, one multiply a block instead of one a weight, when
//   - every value is a multiple of L = 2^(emin - 150) * kRawLsb (emin: the smallest biased exponent
//     of a nonzero a_k of the tile's rows), so a nonzero value has magnitude >= L, and L >= 2^-126
//     (the raw chain) and L * f >= 2^-126 and kRawLsb * f >= 2^-126 (the weights, the scaled chain);
//   - no value can overflow: 32 * amax * kRawMax (twice, for the rounding) below 2^127 for the raw
//     chain, times f for the scaled one, and kRawMax * f finite (amax: the rows' largest |a_k|,
//     which must be finite).
// `FoldRange` is the [lo, hi] that f must lie in for a tile's rows; a block outside it (and any
// tile with a non-finite a) runs the per-weight products. Either way the same bits, so this is a
// speed choice only: it saves the per-weight multiply on the decode path. DSNEURON_EXACT_NO_FOLD=1
// in the environment turns it off (an A/B switch for the benchmarks, read at each call).
struct FoldRange {
  float lo = INFINITY, hi = -INFINITY;  // empty: never fold
};

// the FoldRange of rows whose smallest nonzero biased exponent is emin (256 when none is nonzero) and
// largest magnitude amax, for raw values with step raw_lsb and bound raw_max
FoldRange fold_range(int emin, float amax, float raw_lsb, float raw_max) {
  FoldRange r;
  if (!(amax <= 0x1p120f)) return r;  // NaN, inf or near the top: per-weight products
  const double lsb = emin > 255 ? 1.0 : std::ldexp(1.0, std::max(emin, 1) - 150) * raw_lsb;  // L
  const double bound = 64.0 * double(amax) * raw_max;
  if (lsb < 0x1p-126 || bound >= 0x1p127) return r;
  r.lo = float(std::max(0x1p-126 / lsb, 0x1p-126 / raw_lsb));
  r.hi = float(std::min(bound > 0 ? 0x1p127 / bound : 0x1p127, 0x1p126 / raw_max));
  return r;
}

// NB consecutive blocks b0.. of M rows of a (row stride lda), weights decoded on the fly; the
// partials go into c in ascending block order. Prefetches the next panel, `next` bytes on. kFold:
// each partial on the raw values, times the block's factor once (see FoldRange).
template <int M, int NB, bool kFold, class D>
inline void group_direct(const D& d, const float* a, int64_t lda, int64_t b0, int64_t next, float* c) {
  typename D::Blk st[NB];
  for (int i = 0; i < NB; ++i) st[i] = d.block(b0 + i);
  V p[NB][M][2];
  for (auto& pi : p)
    for (auto& pm : pi) pm[0] = pm[1] = vzero();
  for (int j = 0; j < kBlock; j += D::R) {
#pragma GCC unroll 4
    for (int i = 0; i < NB; ++i) {
      const int64_t k = (b0 + i) * kBlock + j;
      V w[2 * D::R];
      if constexpr (kFold) d.rows_raw(k, w);
      else d.rows(st[i], k, w);
      prefetch(d.row_ptr(k), next);  // the same row of the next panel: its load overlaps this math
      for (int r = 0; r < D::R; ++r)
        for (int m = 0; m < M; ++m) {
          const V x = vbcast(a + m * lda + k + r);
          p[i][m][0] = vfma(x, w[2 * r], p[i][m][0]);
          p[i][m][1] = vfma(x, w[2 * r + 1], p[i][m][1]);
        }
    }
  }
  if constexpr (kFold)
    for (int i = 0; i < NB; ++i)
      for (int m = 0; m < M; ++m)
        for (int h = 0; h < 2; ++h) p[i][m][h] = vmul(p[i][m][h], d.fold_lane(st[i], h));
  for (int i = 0; i < NB; ++i) add_partials<M>(c, p[i]);
}

// blocks b0 .. b0 + nb - 1 of a group, folded when D folds and every factor lies in fr
template <int M, int NB, class D>
inline void group_any(const D& d, const float* a, int64_t lda, int64_t b0, int64_t next, float* c,
                      const FoldRange& fr) {
  if constexpr (D::kFold) {
    bool fold = true;
    for (int i = 0; i < NB && fold; ++i) fold = d.fold_ok(b0 + i, fr.lo, fr.hi);
    if (fold) return group_direct<M, NB, true>(d, a, lda, b0, next, c);
  }
  group_direct<M, NB, false>(d, a, lda, b0, next, c);
}

template <int M, class D>
void tile_direct(const D& d, const float* a, int64_t lda, int64_t kb, float* c, const FoldRange& fr) {
  constexpr int NB = M == 1 ? 4 : M == 2 ? 2 : 1;  // keep >= 8 independent fma chains
  const int64_t next = panel_bytes(d, kb);
  int64_t b = 0;
  for (; b + NB <= kb; b += NB) group_any<M, NB>(d, a, lda, b, next, c, fr);
  for (; b < kb; ++b) group_any<M, 1>(d, a, lda, b, next, c, fr);
}

// M rows against a decoded panel w [K][16]; a is one packed tile [K][6] (kPacked) or rows of stride lda
template <int M, bool kPacked>
void tile_buf(const float* a, int64_t lda, const float* w, int64_t kb, float* c) {
  for (int64_t b = 0; b < kb; ++b) {
    V p[M][2];
    for (auto& pm : p) pm[0] = pm[1] = vzero();
    const float* ab = a + b * kBlock * (kPacked ? kTile : 1);
    const float* wb = w + b * kBlock * kPanel;
#pragma GCC unroll 8
    for (int j = 0; j < kBlock; ++j) {
      const V w0 = vload(wb + j * kPanel), w1 = vload(wb + j * kPanel + 8);
      for (int m = 0; m < M; ++m) {
        const V x = vbcast(ab + (kPacked ? j * kTile + m : m * lda + j));
        p[m][0] = vfma(x, w0, p[m][0]);
        p[m][1] = vfma(x, w1, p[m][1]);
      }
    }
    add_partials<M>(c, p);
  }
}

// the panel's exact fp32 weights -> buf [K][16]; prefetches the next panel, whose loads then overlap
// the tiles' math on this one
template <class D>
void decode_panel(const D& d, int64_t kb, float* buf) {
  const int64_t next = panel_bytes(d, kb);
  for (int64_t b = 0; b < kb; ++b) {
    const auto st = d.block(b);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; k += D::R) {
      V w[2 * D::R];
      d.rows(st, k, w);
      prefetch(d.row_ptr(k), next);
      for (int r = 0; r < D::R; ++r) {
        vstore(buf + (k + r) * kPanel, w[2 * r]);
        vstore(buf + (k + r) * kPanel + 8, w[2 * r + 1]);
      }
    }
  }
}

template <class D> const float* values_in_place(const D&) { return nullptr; }
const float* values_in_place(const Fp32& d) { return d.val; }

template <class F>
void by_rows(int mr, F&& f) {
  switch (mr) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    default: f(std::integral_constant<int, 6>{}); break;
  }
}

// `rows` rows of a (row stride K, or packed as tiles [K][6] when `packed`) against one panel ->
// out[rows][cols] (row stride ldo), decoded on the fly (`direct`, the tile's rows folding where `fr`
// allows) or once into buf (K*16 floats); `acc`: each element's sum starts from what out holds
// (gemm_panels_acc) instead of 0
template <class D>
void run_panel(const D& d, const float* a, bool packed, bool direct, int64_t K, int64_t rows, float* out, int64_t ldo,
               int64_t cols, float* buf, bool acc, const FoldRange& fr) {
  const int64_t kb = K / kBlock;
  const float* w = nullptr;
  if (!direct && !(w = values_in_place(d))) {
    decode_panel(d, kb, buf);
    w = buf;
  }
  alignas(64) float c[kTile * kPanel];
  for (int64_t m0 = 0; m0 < rows; m0 += kTile) {
    const int mr = int(std::min<int64_t>(kTile, rows - m0));
    std::fill(c, c + kTile * kPanel, 0.0f);
    if (acc)
      for (int m = 0; m < mr; ++m) std::copy(out + (m0 + m) * ldo, out + (m0 + m) * ldo + cols, c + m * kPanel);
    const float* am = a + m0 * K;  // row m0, or tile m0 / 6
    by_rows(mr, [&](auto MR) {
      if (!w) tile_direct<MR()>(d, am, K, kb, c, fr);
      else if (packed) tile_buf<MR(), true>(am, K, w, kb, c);
      else tile_buf<MR(), false>(am, K, w, kb, c);
    });
    for (int m = 0; m < mr; ++m) std::copy(c + m * kPanel, c + m * kPanel + cols, out + (m0 + m) * ldo);
  }
}

template <class F>
void with_decoder(int64_t fmt, const uint8_t* w, const float* s, int64_t K, F&& f) {
  switch (fmt) {
    case FP8:
      if (fp8_needs_exact(w, s, K)) f(Fp8T<true>{w, s});
      else f(Fp8T<false>{w, s});
      break;
    case FP4: f(Fp4{w, s}); break;
    case BF16: f(Bf16{reinterpret_cast<const uint16_t*>(w)}); break;
    default: f(Fp32{reinterpret_cast<const float*>(w)}); break;
  }
}

// the RunFn of gemm_args.h
Tensor run(const Tensor& a_in, const std::vector<int64_t>& seg, const Tensor& w, const Tensor& s, int64_t fmt,
           int64_t n, int lead, const Tensor* init) {
  const Tensor a = a_in.is_contiguous() ? a_in : torch::stable::contiguous(a_in);
  const int64_t R = a.size(0), K = a.size(1), P = w.size(lead), E = int64_t(seg.size()) - 1;
  Tensor out = init ? torch::stable::clone(*init) : torch::stable::new_empty(a, {R, n});
  if (init && !out.is_contiguous()) out = torch::stable::contiguous(out);
  if (R == 0 || n == 0) return out;
  const std::vector<Item> items = work_items(seg, P, kTile);
  // with enough panels, the experts with more than one tile get a packed into tiles of 6 rows
  // [K][6] (tile t at ap + t*K*6), so a tile's 6 broadcasts per k are one contiguous run; padding
  // rows of a last tile are never read
  const bool pack = P >= kPackPanels;
  std::vector<int64_t> tile0(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = seg[e + 1] - seg[e];
    tile0[e + 1] = tile0[e] + (pack && rows > direct_rows(fmt) ? (rows + kTile - 1) / kTile : 0);
  }
  std::unique_ptr<float[]> ap(new float[tile0[E] * K * kTile]);
  const float* ab = static_cast<const float*>(a.const_data_ptr());
  torch::stable::parallel_for(0, tile0[E], 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t e = std::upper_bound(tile0.begin(), tile0.end(), t) - tile0.begin() - 1;
      const int64_t r0 = seg[e] + (t - tile0[e]) * kTile, mr = std::min<int64_t>(kTile, seg[e + 1] - r0);
      float* dst = ap.get() + t * K * kTile;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t m = 0; m < mr; ++m) dst[k * kTile + m] = ab[(r0 + m) * K + k];
    }
  });
  // the rows the direct items read: their smallest nonzero exponent and largest magnitude (FoldRange);
  // once a call, as is the benchmarks' A/B switch (bench/decode_ab.py)
  const char* no_fold = std::getenv("DSNEURON_EXACT_NO_FOLD");
  const bool fold = (fmt == FP8 || fmt == FP4) && !(no_fold && no_fold[0] == '1');
  auto is_direct = [&](const Item& it) { return it.r1 - it.r0 <= direct_rows(fmt); };
  std::vector<int> emin(R, 256);
  std::vector<float> amax(R, 0.0f);
  std::vector<char> direct_row(R, 0);
  for (const Item& it : items)
    if (fold && is_direct(it)) std::fill(direct_row.begin() + it.r0, direct_row.begin() + it.r1, 1);
  for (int64_t r = 0; r < R; ++r) {
    if (!direct_row[r]) continue;
    int e = 256;
    float m = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float x = ab[r * K + k];
      uint32_t u;
      std::memcpy(&u, &x, 4);
      const int be = int((u >> 23) & 0xFF);
      if (u << 1) e = std::min(e, be);
      m = x != x ? INFINITY : std::max(m, std::fabs(x));  // a NaN row never folds
    }
    emin[r] = e;
    amax[r] = m;
  }
  const Panels pn(w, s, lead);
  float* ob = static_cast<float*>(out.mutable_data_ptr());
  torch::stable::parallel_for(0, int64_t(items.size()), item_grain(items, pn.panel_bytes, kTile), [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> buf;  // the decoded panel, from the first item that needs one
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      if (!buf && fmt != FP32 && !is_direct(it)) buf.reset(new float[K * kPanel]);
      const int64_t cols = std::min(kPanel, n - it.p * kPanel);
      // chunks that decode on the fly read a in place
      const bool direct = is_direct(it);
      const bool packed = tile0[it.e + 1] > tile0[it.e] && !direct;
      const float* at = packed ? ap.get() + (tile0[it.e] + (it.r0 - seg[it.e]) / kTile) * K * kTile : ab + it.r0 * K;
      with_decoder(fmt, pn.weight(it), pn.scale(it), K, [&](const auto& d) {
        using D = std::decay_t<decltype(d)>;
        FoldRange fr;
        if constexpr (D::kFold)
          if (fold && direct) {
            int e = 256;
            float m = 0.0f;
            for (int64_t r = it.r0; r < it.r1; ++r) e = std::min(e, emin[r]), m = std::max(m, amax[r]);
            fr = fold_range(e, m, D::kRawLsb, D::kRawMax);
          }
        run_panel(d, at, packed, direct, K, it.r1 - it.r0, ob + it.r0 * n + it.p * kPanel, n, cols, buf.get(),
                  init != nullptr, fr);
      });
    }
  });
  return out;
}

Tensor gemm_panels(Tensor a, Tensor w, Tensor w_scale, int64_t fmt, int64_t n) {
  return gemm_op(run, FP32, "gemm_panels", a, w, w_scale, fmt, n);
}

// the adds gemm_panels makes for all K when init is the sum of the K blocks before this shard's
Tensor gemm_panels_acc(Tensor a, Tensor w, Tensor w_scale, int64_t fmt, int64_t n, Tensor init) {
  return gemm_acc_op(run, FP32, "gemm_panels_acc", a, w, w_scale, fmt, n, init);
}

Tensor gemm_panels_segments(Tensor a, Tensor offsets, Tensor w, Tensor w_scale, int64_t fmt, int64_t n) {
  return gemm_segments_op(run, FP32, "gemm_panels_segments", a, offsets, w, w_scale, fmt, n);
}

}  // namespace
}  // namespace dsn

STABLE_TORCH_LIBRARY_FRAGMENT(DSN_NS, m) {
  m.def("gemm_panels(Tensor a, Tensor w, Tensor w_scale, int fmt, int n) -> Tensor");
  m.def("gemm_panels_acc(Tensor a, Tensor w, Tensor w_scale, int fmt, int n, Tensor init) -> Tensor");
  m.def("gemm_panels_segments(Tensor a, Tensor offsets, Tensor w, Tensor w_scale, int fmt, int n) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(DSN_NS, CPU, m) {
  m.impl("gemm_panels", TORCH_BOX(&dsn::gemm_panels));
  m.impl("gemm_panels_acc", TORCH_BOX(&dsn::gemm_panels_acc));
  m.impl("gemm_panels_segments", TORCH_BOX(&dsn::gemm_panels_segments));
}
