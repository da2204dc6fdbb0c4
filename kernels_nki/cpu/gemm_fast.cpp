// dsneuron::gemm_fast / gemm_fast_acc / gemm_fast_segments: the block-scaled GEMM of fast numerics.
//
// Contract (cpu_gemm_fast.py holds the full text and the torch reference gemm_fast_ref):
//   a_bf = bf16(a) (round to nearest even), w[n, k] = the FP8 / FP4 / bf16 code value as bf16
//   (exact), s_b[n] = the block's power-of-two scale (1 for bf16 weights);
//   partial_b = 0; for the 16 k pairs (k, k+1) of block b ascending: partial_b = dot(partial_b, pair)
//   acc = 0 (or init);  for b ascending: acc = fma(partial_b, s_b, acc);  out[m, n] = acc
// with dot one VDPBF16PS lane (bf16dot.h). Same prepared panels as gemm.cpp (cpu_gemm.py layout),
// so a bundle's weights do not depend on its numerics.
//
// Determinism: each output element is computed by one thread with the sequence above whatever
// the row count, tile, expert segment or thread count, so a row's result never depends on its
// batch; on one host, every call gives the same bits.
//
// On hosts with AMX-BF16 (the "amx" build) every row count runs on AMX tiles instead, the block
// scales folded into the weights where they allow it: see the AMX layer below.
//
// Kernels, per 16-column panel:
//   rows <= kDirect  pairs expanded on the fly from the panel's bytes (decode: the weights are read
//                    once, in their checkpoint width), 4 (1 row), 2 (2-4 rows) or 1 block in flight
//                    so the dot latency is hidden, the next panel prefetched meanwhile;
//   more rows        the panel expanded once into a pair buffer [K/2][32] (L2; bf16, or fp32 on
//                    AVX2), then tiles of up to kTile rows, each row's partial and acc in registers.
// Build: its own library (cpu_gemm_fast.py), -O3 -ffp-contract=off, with -mavx512f -mavx512bw
// -mavx512bf16 where the host has AVX512-BF16 (plus -mamx-tile -mamx-bf16 where it has AMX-BF16),
// else the AVX2 flags of gemm.cpp.
#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

#include "bf16dot.h"
#include "gemm_args.h"

#ifndef DSN_NS
#error "build with -DDSN_NS=<op namespace>"
#endif

namespace dsn {
namespace {

constexpr int64_t kPairs = kBlock / 2;
constexpr int kTile = kTileRows;  // rows per register tile (bf16dot.h: what the layer's registers hold)

// true when the n scales at s all lie in [lo, hi] (false for a NaN)
inline bool in_range(const float* s, int64_t n, float lo, float hi) {
  for (int64_t i = 0; i < n; ++i)
    if (!(s[i] >= lo && s[i] <= hi)) return false;
  return true;
}

// One prepared panel of one format: pair(j) = pair vector of k = 2j, 2j+1; scale(b) = block b's
// scales per lane; ptr(j) = where pair j's bytes are (for prefetching)
struct Fp8P {
  static constexpr bool kStream = true;  // read from memory: prefetch the next panel
  const uint8_t* code;  // [K][16]
  const float* scale;   // [K/32]
  W pair(int64_t j) const { return fp8_pair(code + 2 * j * kPanel); }
  Acc scale_of(int64_t b) const { return aset(scale[b]); }
  const void* ptr(int64_t j) const { return code + 2 * j * kPanel; }
  bool scales_in(float lo, float hi, int64_t kb) const { return in_range(scale, kb, lo, hi); }
};
struct Fp4P {
  static constexpr bool kStream = true;  // read from memory: prefetch the next panel
  const uint8_t* code;  // [K/2][16]
  const float* scale;   // [K/32][16]
  W pair(int64_t j) const { return fp4_pair(code + j * kPanel); }
  Acc scale_of(int64_t b) const { return aload(scale + b * kPanel); }
  const void* ptr(int64_t j) const { return code + j * kPanel; }
  bool scales_in(float lo, float hi, int64_t kb) const { return in_range(scale, kb * kPanel, lo, hi); }
};
struct Bf16P {
  static constexpr bool kStream = true;  // read from memory: prefetch the next panel
  const uint16_t* val;  // [K][16]
  W pair(int64_t j) const { return bf16_pair(val + 2 * j * kPanel); }
  Acc scale_of(int64_t) const { return aset(1.0f); }
  const void* ptr(int64_t j) const { return val + 2 * j * kPanel; }
  bool scales_in(float, float, int64_t) const { return true; }
};
// rows up to which a panel's pairs are expanded on the fly (bf16dot.h kDirectRows); FP8's
// expansion, the costliest, measured faster through the pair buffer past 4 rows on AVX2
template <class P>
constexpr int64_t kDirect = kDirectRows;
template <>
constexpr int64_t kDirect<Fp8P> = std::min(kDirectRows, 4);

// a panel already expanded into pairs [K/2][32], with its format's scales
template <class P>
struct Expanded {
  static constexpr bool kStream = false;
  const P& src;
  const WElem* buf;
  W pair(int64_t j) const { return wload(buf + j * 2 * kPanel); }
  Acc scale_of(int64_t b) const { return src.scale_of(b); }
};

// NB consecutive blocks b0.. of M rows of a (bf16, row stride lda) -> c[m] in ascending block order;
// a streamed source prefetches the bytes `ahead` past each pair (the next panel)
template <int M, int NB, class S>
inline void group(const S& s, const AElem* a, int64_t lda, int64_t b0, int64_t ahead, Acc* c) {
  Acc p[NB][M];
  for (auto& pi : p)
    for (auto& pm : pi) pm = azero();
  for (int64_t j = 0; j < kPairs; ++j) {
#pragma GCC unroll 4
    for (int i = 0; i < NB; ++i) {
      const int64_t pj = (b0 + i) * kPairs + j;
      const W w = s.pair(pj);
      if constexpr (S::kStream) prefetch_l2(s.ptr(pj), ahead);
      for (int m = 0; m < M; ++m) p[i][m] = dot(p[i][m], w, a + m * lda + 2 * pj);
    }
  }
  for (int i = 0; i < NB; ++i) {
    const Acc sc = s.scale_of(b0 + i);
    for (int m = 0; m < M; ++m) c[m] = afma(p[i][m], sc, c[m]);
  }
}

// M rows (M <= kTile) of a against one panel source -> out rows (stride ldo, `cols` columns);
// `acc`: the sums start from what out holds
template <int M, class S>
void tile(const S& s, const AElem* a, int64_t lda, int64_t kb, int64_t ahead, float* out, int64_t ldo, int cols,
          bool acc) {
  constexpr int NB = M == 1 ? 4 : M <= 4 ? 2 : 1;  // >= 4 independent dot chains
  Acc c[M];
  for (int m = 0; m < M; ++m) c[m] = acc ? aload_n(out + m * ldo, cols) : azero();
  int64_t b = 0;
  for (; b + NB <= kb; b += NB) group<M, NB>(s, a, lda, b, ahead, c);
  for (; b < kb; ++b) group<M, 1>(s, a, lda, b, ahead, c);
  for (int m = 0; m < M; ++m) astore_n(out + m * ldo, c[m], cols);
}

template <class F>
void by_rows(int mr, F&& f) {
  switch (mr) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 9: f(std::integral_constant<int, 9>{}); break;
    case 10: f(std::integral_constant<int, 10>{}); break;
    case 11: f(std::integral_constant<int, 11>{}); break;
    default: f(std::integral_constant<int, 12>{}); break;
  }
}

#if DSN_AMX
// The AMX layer (hosts with AMX-BF16): TDPBF16PS (Intel SDM, "TDPBF16PS") of a tile of up to 16 rows
// against a block's 16 pair rows of the expanded panel (the pair buffer [K/2][32] is AMX's VNNI
// layout for B). It rounds a block differently from a chain of VDPBF16PS (measured: 14% of elements
// differ), so on an AMX host every row count takes this path, decode included: a row's result then
// never depends on its batch. Tiles 0-1: sums or partials (mr rows of 16 fp32), 2-3: activations
// (mr rows of one 32-k block), 4-5: pair rows.
constexpr int kAmxRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tiles 0-3: mr rows of 64 bytes (16 fp32 / 32 bf16); tiles 4-5: 16 pair rows of 64 bytes
inline void amx_config(int mr) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 6; ++t) {
    c.rows[t] = uint8_t(t < 4 ? mr : kPairs);
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// Storing each block's partial to apply its scale costs more than its TDPBF16PS (measured: 240 vs
// 470 GFLOP/s a core at M = 715), so where a panel's scales lie in [2^-64, 2^64] (checkpoint scales
// do) they are folded into its expanded weights instead: an FP8 / FP4 value times a power of two in
// that range is a normal bf16, exactly, and the tile accumulates the whole K in fp32, block after
// block in ascending order (amx_folded). Other panels keep a stored partial per block, folded into
// acc by the fma of the other layers (amx_rows). Which one a panel takes depends on its scales
// alone, never on the row count.
constexpr float kFoldMin = 0x1p-64f, kFoldMax = 0x1p64f;

// Folding 2^e into a block's pairs as it expands them: FP8 through fp8_pair's exponent bias and
// subnormal table, FP4 by adding e << 7 to the nonzero values' bits (e per lane), bf16 scale 1
struct Fold { __m512i x, y; };

inline Fold fold_of(const Fp8P& pn, int64_t b) {
  int32_t bits;
  std::memcpy(&bits, &pn.scale[b], 4);
  const int16_t e = int16_t(((bits >> 23) & 0xFF) - 127);
  const __m512i sub = fp8_subnormals();
  return {_mm512_set1_epi16(int16_t(0x3C00 + e * 128)),
          _mm512_mask_add_epi16(sub, _mm512_test_epi16_mask(sub, sub), sub, _mm512_set1_epi16(int16_t(e * 128)))};
}
inline W folded_pair(const Fp8P& pn, int64_t j, const Fold& f) { return fp8_pair(pn.code + 2 * j * kPanel, f.x, f.y); }

inline Fold fold_of(const Fp4P& pn, int64_t b) {
  const __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(pn.scale_of(b).v), 23), _mm512_set1_epi32(127));
  const __m512i lo = _mm512_and_si512(_mm512_slli_epi32(e, 7), _mm512_set1_epi32(0xFFFF));
  return {_mm512_or_si512(lo, _mm512_slli_epi32(lo, 16)), _mm512_setzero_si512()};
}
inline W folded_pair(const Fp4P& pn, int64_t j, const Fold& f) {
  const __m512i w = pn.pair(j).v;
  return {_mm512_mask_add_epi16(w, _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x7FFF)), w, f.x)};
}

inline Fold fold_of(const Bf16P&, int64_t) { return {_mm512_setzero_si512(), _mm512_setzero_si512()}; }
inline W folded_pair(const Bf16P& pn, int64_t j, const Fold&) { return pn.pair(j); }

// the pairs of blocks b .. b + nb - 1 of a panel (times their scales when kFold) -> buf, their place
// in the [K/2][32] pair buffer; prefetches the bytes `ahead` past each (the next panel)
template <bool kFold, class P>
inline void amx_expand(const P& pn, int64_t b, int64_t nb, int64_t ahead, uint16_t* buf) {
  for (int64_t blk = b; blk < b + nb; ++blk) {
    const Fold f = kFold ? fold_of(pn, blk) : Fold{_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int64_t j = blk * kPairs; j < (blk + 1) * kPairs; ++j) {
      wstore(buf + j * 2 * kPanel, kFold ? folded_pair(pn, j, f) : pn.pair(j));
      prefetch_l2(pn.ptr(j), ahead);
    }
  }
}

// one or two tiles of mr rows (rows m and m + 16 of a, bf16, row stride K) against a folded panel;
// kExpand: expand each block just before its use (one tile: each pair is used once), else buf holds
// the panel. The sums start from 0, or from what out holds (acc)
template <bool kTwo, bool kExpand, class P>
void amx_folded(const P& pn, const uint16_t* am, int64_t K, int mr, int64_t ahead, uint16_t* buf, float* out,
                int64_t ldo, int cols, bool acc) {
  alignas(64) float c[2][kAmxRows * kPanel];
  if (acc) {
    for (int t = 0; t < 1 + kTwo; ++t)
      for (int m = 0; m < mr; ++m)
        _mm512_store_ps(c[t] + m * kPanel, aload_n(out + (t * kAmxRows + m) * ldo, cols).v);
    _tile_loadd(0, c[0], 64);
    if (kTwo) _tile_loadd(1, c[1], 64);
  } else {
    _tile_zero(0);
    if (kTwo) _tile_zero(1);
  }
  const int64_t kb = K / kBlock;
  // expanded kAhead blocks before their use: a tile load of pairs stored just before waits for them
  constexpr int64_t kAhead = 2;
  if (kExpand) amx_expand<true>(pn, 0, std::min(kAhead, kb), ahead, buf);
  for (int64_t b = 0; b < kb; ++b) {
    if (kExpand && b + kAhead < kb) amx_expand<true>(pn, b + kAhead, 1, ahead, buf);
    _tile_loadd(4, buf + b * kPairs * 2 * kPanel, 64);
    _tile_loadd(2, am + b * kBlock, K * 2);
    _tile_dpbf16ps(0, 2, 4);
    if (kTwo) {
      _tile_loadd(3, am + kAmxRows * K + b * kBlock, K * 2);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  _tile_stored(0, c[0], 64);
  if (kTwo) _tile_stored(1, c[1], 64);
  for (int t = 0; t < 1 + kTwo; ++t)
    for (int m = 0; m < mr; ++m) astore_n(out + (t * kAmxRows + m) * ldo, aload(c[t] + m * kPanel), cols);
}

// MR rows of a (bf16, row stride K) against one panel whose scales are not folded -> out rows,
// through a stored partial per block; kExpand as in amx_folded
template <int MR, bool kExpand, class P>
void amx_rows(const P& pn, const uint16_t* am, int64_t K, int64_t ahead, uint16_t* buf, float* out, int64_t ldo,
              int cols, bool acc) {
  const int64_t kb = K / kBlock;
  Acc c[MR];
  for (int m = 0; m < MR; ++m) c[m] = acc ? aload_n(out + m * ldo, cols) : azero();
  alignas(64) float part[MR * kPanel];
  for (int64_t b = 0; b < kb; ++b) {
    if (kExpand) amx_expand<false>(pn, b, 1, ahead, buf);
    _tile_zero(0);
    _tile_loadd(2, am + b * kBlock, K * 2);
    _tile_loadd(4, buf + b * kPairs * 2 * kPanel, 64);
    _tile_dpbf16ps(0, 2, 4);
    _tile_stored(0, part, 64);
    const Acc sc = pn.scale_of(b);
    for (int m = 0; m < MR; ++m) c[m] = afma(aload(part + m * kPanel), sc, c[m]);
  }
  for (int m = 0; m < MR; ++m) astore_n(out + m * ldo, c[m], cols);
}

// f(std::integral_constant<int, mr>) for mr in 1 .. kAmxRows
template <int N = 1, class F>
void by_amx_rows(int mr, F&& f) {
  if constexpr (N < kAmxRows) {
    if (mr != N) return by_amx_rows<N + 1>(mr, f);
  }
  f(std::integral_constant<int, N>{});
}

template <class P>
void run_panel_amx(const P& pn, const uint16_t* a, int64_t K, int64_t rows, int64_t panel_bytes, float* out,
                   int64_t ldo, int cols, uint16_t* buf, bool acc, int& configured) {
  const int64_t kb = K / kBlock;
  const bool fold = pn.scales_in(kFoldMin, kFoldMax, kb), one = rows <= kAmxRows;
  if (!one) {
    if (fold) amx_expand<true>(pn, 0, kb, panel_bytes, buf);
    else amx_expand<false>(pn, 0, kb, panel_bytes, buf);
  }
  for (int64_t m0 = 0; m0 < rows;) {
    const bool two = fold && rows - m0 >= 2 * kAmxRows;
    const int mr = int(std::min<int64_t>(kAmxRows, rows - m0));
    if (mr != configured) amx_config(configured = mr);
    const uint16_t* am = a + m0 * K;
    float* o = out + m0 * ldo;
    if (fold && one) amx_folded<false, true>(pn, am, K, mr, panel_bytes, buf, o, ldo, cols, acc);
    else if (two) amx_folded<true, false>(pn, am, K, mr, 0, buf, o, ldo, cols, acc);
    else if (fold) amx_folded<false, false>(pn, am, K, mr, 0, buf, o, ldo, cols, acc);
    else by_amx_rows(mr, [&](auto MR) {
      if (one) amx_rows<MR(), true>(pn, am, K, panel_bytes, buf, o, ldo, cols, acc);
      else amx_rows<MR(), false>(pn, am, K, 0, buf, o, ldo, cols, acc);
    });
    m0 += two ? 2 * kAmxRows : mr;
  }
}
#endif

// `rows` rows of a against one panel; buf: room for the expanded panel (K/2 pair vectors);
// configured: the AMX tile rows this thread has configured since it took its items (0: none): one
// tile configuration per thread and row count, not per panel (5% of an M = 1 GEMV, measured)
template <class P>
void run_panel(const P& pn, const AElem* a, int64_t K, int64_t rows, int64_t panel_bytes, float* out, int64_t ldo,
               int cols, WElem* buf, bool acc, int& configured) {
#if DSN_AMX
  run_panel_amx(pn, a, K, rows, panel_bytes, out, ldo, cols, buf, acc, configured);
#else
  const int64_t kb = K / kBlock;
  if (rows <= kDirect<P>) {
    by_rows(int(rows), [&](auto MR) {
      if constexpr (MR() <= kDirect<P>) tile<MR()>(pn, a, K, kb, panel_bytes, out, ldo, cols, acc);
    });
    return;
  }
  for (int64_t j = 0; j < K / 2; ++j) wstore(buf + j * 2 * kPanel, pn.pair(j));
  const Expanded<P> ex{pn, buf};
  for (int64_t m0 = 0; m0 < rows; m0 += kTile) {
    const int mr = int(std::min<int64_t>(kTile, rows - m0));
    by_rows(mr, [&](auto MR) { tile<MR()>(ex, a + m0 * K, K, kb, 0, out + m0 * ldo, ldo, cols, acc); });
  }
#endif
}

// While alive, this thread reads denormal inputs as they are (MXCSR's DAZ bit off; restored after):
// the AVX2 layer's FP8 expansion passes subnormal codes through an fp32 denormal (bf16dot.h)
struct DenormalsAsIs {
#if DSN_AVX2
  const unsigned csr = _mm_getcsr();
  DenormalsAsIs() { _mm_setcsr(csr & ~0x40u); }
  ~DenormalsAsIs() { _mm_setcsr(csr); }
#endif
};

// the RunFn of gemm_args.h
Tensor run(const Tensor& a_in, const std::vector<int64_t>& seg, const Tensor& w, const Tensor& s, int64_t fmt,
           int64_t n, int lead, const Tensor* init) {
  const Tensor a = a_in.is_contiguous() ? a_in : torch::stable::contiguous(a_in);
  const int64_t R = a.size(0), K = a.size(1), P = w.size(lead);
  Tensor out = init ? torch::stable::clone(*init) : torch::stable::new_empty(a, {R, n});
  if (init && !out.is_contiguous()) out = torch::stable::contiguous(out);
  if (R == 0 || n == 0) return out;
  // the activations rounded to bf16, once (bf16dot.h AElem)
  std::unique_ptr<AElem[]> abf(new AElem[R * K]);
  const float* af = static_cast<const float*>(a.const_data_ptr());
  torch::stable::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    to_act(af + begin * K, abf.get() + begin * K, (end - begin) * K);
  });
  const std::vector<Item> items = work_items(seg, P, kTile);
  const Panels pn(w, s, lead);
  const int64_t wps = pn.panel_bytes;
  float* ob = static_cast<float*>(out.mutable_data_ptr());
  torch::stable::parallel_for(0, int64_t(items.size()), item_grain(items, wps, kTile), [&](int64_t begin, int64_t end) {
    std::unique_ptr<WElem[]> buf(new WElem[K * kPanel]);  // one expanded panel: K/2 pair vectors
    const DenormalsAsIs keep;
    int configured = 0;  // other code on this thread (oneDNN) may have loaded its own tile configuration
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const int cols = int(std::min(kPanel, n - it.p * kPanel));
      const uint8_t* wp = pn.weight(it);
      const float* sp = pn.scale(it);
      const AElem* ar = abf.get() + it.r0 * K;
      float* o = ob + it.r0 * n + it.p * kPanel;
      const bool acc = init != nullptr;
      if (fmt == FP8) run_panel(Fp8P{wp, sp}, ar, K, it.r1 - it.r0, wps, o, n, cols, buf.get(), acc, configured);
      else if (fmt == FP4) run_panel(Fp4P{wp, sp}, ar, K, it.r1 - it.r0, wps, o, n, cols, buf.get(), acc, configured);
      else run_panel(Bf16P{reinterpret_cast<const uint16_t*>(wp)}, ar, K, it.r1 - it.r0, wps, o, n, cols, buf.get(), acc, configured);
    }
  });
  return out;
}

Tensor gemm_fast(Tensor a, Tensor w, Tensor w_scale, int64_t fmt, int64_t n) {
  return gemm_op(run, BF16, "gemm_fast", a, w, w_scale, fmt, n);
}

Tensor gemm_fast_acc(Tensor a, Tensor w, Tensor w_scale, int64_t fmt, int64_t n, Tensor init) {
  return gemm_acc_op(run, BF16, "gemm_fast_acc", a, w, w_scale, fmt, n, init);
}

Tensor gemm_fast_segments(Tensor a, Tensor offsets, Tensor w, Tensor w_scale, int64_t fmt, int64_t n) {
  return gemm_segments_op(run, BF16, "gemm_fast_segments", a, offsets, w, w_scale, fmt, n);
}

}  // namespace
}  // namespace dsn

STABLE_TORCH_LIBRARY_FRAGMENT(DSN_NS, m) {
  m.def("gemm_fast(Tensor a, Tensor w, Tensor w_scale, int fmt, int n) -> Tensor");
  m.def("gemm_fast_acc(Tensor a, Tensor w, Tensor w_scale, int fmt, int n, Tensor init) -> Tensor");
  m.def("gemm_fast_segments(Tensor a, Tensor offsets, Tensor w, Tensor w_scale, int fmt, int n) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(DSN_NS, CPU, m) {
  m.impl("gemm_fast", TORCH_BOX(&dsn::gemm_fast));
  m.impl("gemm_fast_acc", TORCH_BOX(&dsn::gemm_fast_acc));
  m.impl("gemm_fast_segments", TORCH_BOX(&dsn::gemm_fast_segments));
}
