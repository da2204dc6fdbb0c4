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
// Kernels, per 16-column panel:
//   rows <= kDirect  pairs expanded on the fly from the panel's bytes (decode: the weights are read
//                    once, in their checkpoint width), 4 (1 row) or 2 (2-4 rows) blocks in flight
//                    so the dot latency is hidden, the next panel prefetched meanwhile;
//   more rows        the panel expanded once into a bf16 pair buffer [K/2][32] (L2), then tiles of
//                    up to kTile rows, each row's partial and acc in registers.
// Build: its own library (cpu_gemm_fast.py), -O3 -ffp-contract=off, with -mavx512f -mavx512bw
// -mavx512bf16 where the host has AVX512-BF16, else the AVX2 flags of gemm.cpp.
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
constexpr int kTile = 12;         // rows per register tile: 12 partials + 12 accs + weights < 32 zmm
constexpr int64_t kDirect = 4;    // rows up to which pairs are expanded on the fly (measured on tiny)

// One prepared panel of one format: pair(j) = pair vector of k = 2j, 2j+1; scale(b) = block b's
// scales per lane; ptr(j) = where pair j's bytes are (for prefetching)
struct Fp8P {
  static constexpr bool kStream = true;  // read from memory: prefetch the next panel
  const uint8_t* code;  // [K][16]
  const float* scale;   // [K/32]
  W pair(int64_t j) const { return fp8_pair(code + 2 * j * kPanel); }
  Acc scale_of(int64_t b) const { return aset(scale[b]); }
  const void* ptr(int64_t j) const { return code + 2 * j * kPanel; }
};
struct Fp4P {
  static constexpr bool kStream = true;  // read from memory: prefetch the next panel
  const uint8_t* code;  // [K/2][16]
  const float* scale;   // [K/32][16]
  W pair(int64_t j) const { return fp4_pair(code + j * kPanel); }
  Acc scale_of(int64_t b) const { return aload(scale + b * kPanel); }
  const void* ptr(int64_t j) const { return code + j * kPanel; }
};
struct Bf16P {
  static constexpr bool kStream = true;  // read from memory: prefetch the next panel
  const uint16_t* val;  // [K][16]
  W pair(int64_t j) const { return bf16_pair(val + 2 * j * kPanel); }
  Acc scale_of(int64_t) const { return aset(1.0f); }
  const void* ptr(int64_t j) const { return val + 2 * j * kPanel; }
};
// a panel already expanded into pairs [K/2][32], with its format's scales
template <class P>
struct Expanded {
  static constexpr bool kStream = false;
  const P& src;
  const uint16_t* buf;
  W pair(int64_t j) const { return wload(buf + j * 2 * kPanel); }
  Acc scale_of(int64_t b) const { return src.scale_of(b); }
};

// NB consecutive blocks b0.. of M rows of a (bf16, row stride lda) -> c[m] in ascending block order;
// a streamed source prefetches the bytes `ahead` past each pair (the next panel)
template <int M, int NB, class S>
inline void group(const S& s, const uint16_t* a, int64_t lda, int64_t b0, int64_t ahead, Acc* c) {
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
void tile(const S& s, const uint16_t* a, int64_t lda, int64_t kb, int64_t ahead, float* out, int64_t ldo, int cols,
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

// `rows` rows of a against one panel; buf: room for the expanded panel (K/2 pair vectors)
template <class P>
void run_panel(const P& pn, const uint16_t* a, int64_t K, int64_t rows, int64_t panel_bytes, float* out, int64_t ldo,
               int cols, uint16_t* buf, bool acc) {
  const int64_t kb = K / kBlock;
  if (rows <= kDirect) {
    by_rows(int(rows), [&](auto MR) {
      if constexpr (MR() <= kDirect) tile<MR()>(pn, a, K, kb, panel_bytes, out, ldo, cols, acc);
    });
    return;
  }
  for (int64_t j = 0; j < K / 2; ++j) wstore(buf + j * 2 * kPanel, pn.pair(j));
  const Expanded<P> ex{pn, buf};
  for (int64_t m0 = 0; m0 < rows; m0 += kTile) {
    const int mr = int(std::min<int64_t>(kTile, rows - m0));
    by_rows(mr, [&](auto MR) { tile<MR()>(ex, a + m0 * K, K, kb, 0, out + m0 * ldo, ldo, cols, acc); });
  }
}

// the RunFn of gemm_args.h
Tensor run(const Tensor& a_in, const std::vector<int64_t>& seg, const Tensor& w, const Tensor& s, int64_t fmt,
           int64_t n, int lead, const Tensor* init) {
  const Tensor a = a_in.is_contiguous() ? a_in : torch::stable::contiguous(a_in);
  const int64_t R = a.size(0), K = a.size(1), P = w.size(lead);
  Tensor out = init ? torch::stable::clone(*init) : torch::stable::new_empty(a, {R, n});
  if (init && !out.is_contiguous()) out = torch::stable::contiguous(out);
  if (R == 0 || n == 0) return out;
  // the activations as bf16, once
  std::unique_ptr<uint16_t[]> abf(new uint16_t[R * K]);
  const float* af = static_cast<const float*>(a.const_data_ptr());
  torch::stable::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    to_bf16(af + begin * K, abf.get() + begin * K, (end - begin) * K);
  });
  const std::vector<Item> items = work_items(seg, P, kTile);
  const auto* wb = static_cast<const uint8_t*>(w.const_data_ptr());
  const float* sb = s.numel() ? static_cast<const float*>(s.const_data_ptr()) : nullptr;
  const int64_t wes = lead ? w.stride(0) * w.element_size() : 0, wps = w.stride(lead) * w.element_size();
  const int64_t ses = lead && sb ? s.stride(0) : 0, sps = sb ? s.stride(lead) : 0;
  float* ob = static_cast<float*>(out.mutable_data_ptr());
  torch::stable::parallel_for(0, int64_t(items.size()), item_grain(items, wps, kTile), [&](int64_t begin, int64_t end) {
    std::unique_ptr<uint16_t[]> buf(new uint16_t[K * kPanel]);  // one expanded panel: K/2 pairs of 32 bf16
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const int cols = int(std::min(kPanel, n - it.p * kPanel));
      const uint8_t* wp = wb + it.e * wes + it.p * wps;
      const float* sp = sb ? sb + it.e * ses + it.p * sps : nullptr;
      const uint16_t* ar = abf.get() + it.r0 * K;
      float* o = ob + it.r0 * n + it.p * kPanel;
      const bool acc = init != nullptr;
      if (fmt == FP8) run_panel(Fp8P{wp, sp}, ar, K, it.r1 - it.r0, wps, o, n, cols, buf.get(), acc);
      else if (fmt == FP4) run_panel(Fp4P{wp, sp}, ar, K, it.r1 - it.r0, wps, o, n, cols, buf.get(), acc);
      else run_panel(Bf16P{reinterpret_cast<const uint16_t*>(wp)}, ar, K, it.r1 - it.r0, wps, o, n, cols, buf.get(), acc);
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
