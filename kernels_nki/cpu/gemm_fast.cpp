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
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16dot.h"
#include "check.h"

#ifndef DSN_NS
#error "build with -DDSN_NS=<op namespace>"
#endif

namespace dsn {
namespace {

constexpr int64_t kPanel = 16;    // output columns per prepared panel = one 16-lane accumulator
constexpr int64_t kBlock = 32;    // k per block partial (the UE8M0 scale block)
constexpr int64_t kPairs = kBlock / 2;
constexpr int kTile = 12;         // rows per register tile: 12 partials + 12 accs + weights < 32 zmm
constexpr int64_t kDirect = 4;    // rows up to which pairs are expanded on the fly (measured on tiny)
enum Fmt : int64_t { FP8 = 0, FP4 = 1, BF16 = 2 };
const char* const kFmtName[] = {"fp8", "fp4", "bf16"};

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

using torch::stable::Tensor;
using ST = torch::headeronly::ScalarType;

std::string describe(const Tensor& t) {
  std::string s = std::string(torch::headeronly::toString(t.scalar_type())) + " [";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]" + (t.is_contiguous() ? "" : " (not contiguous)");
}

// w: [P, Kw, 16] (lead = 0) or [E, P, Kw, 16] (lead = 1); returns P
int64_t check_weight(const char* op, const Tensor& w, const Tensor& s, int64_t fmt, int64_t K, int64_t E, int lead) {
  DSN_CHECK(fmt >= 0 && fmt <= 2, op, ": fmt must be 0 (fp8), 1 (fp4) or 2 (bf16), got ", fmt,
            " (fp32 weights have no fast path: gemm_panels)");
  const ST want = fmt == BF16 ? ST::BFloat16 : ST::Byte;
  const int64_t kw = fmt == FP4 ? K / 2 : K;
  DSN_CHECK(w.dim() == 3 + lead && w.scalar_type() == want && w.is_contiguous() && (!lead || w.size(0) == E) &&
                w.size(lead + 1) == kw && w.size(lead + 2) == kPanel,
            op, ": w must be a contiguous ", torch::headeronly::toString(want), " tensor [", lead ? "E, " : "", "P, ",
            fmt == FP4 ? "K/2=" : "K=", kw, ", 16] for fmt ", fmt, " (", kFmtName[fmt], ")",
            lead ? " with E = offsets.numel() - 1 = " + std::to_string(E) : "", ", got ", describe(w));
  const int64_t P = w.size(lead);
  if (fmt == BF16) {
    DSN_CHECK(s.numel() == 0, op, ": w_scale must be empty for fmt 2 (bf16), got ", describe(s));
    return P;
  }
  std::vector<int64_t> shape;
  if (lead) shape.push_back(E);
  shape.insert(shape.end(), {P, K / kBlock});
  if (fmt == FP4) shape.push_back(kPanel);
  bool ok = s.scalar_type() == ST::Float && s.is_contiguous() && s.dim() == int64_t(shape.size());
  for (int64_t i = 0; ok && i < s.dim(); ++i) ok = s.size(i) == shape[i];
  DSN_CHECK(ok, op, ": w_scale must be a contiguous Float tensor of ", shape.size(), " dims [", lead ? "E, " : "",
            "P, K/32", fmt == FP4 ? ", 16" : "", "] for fmt ", fmt, " (", kFmtName[fmt], "), got ", describe(s));
  return P;
}

void check_n(const char* op, int64_t n, int64_t P) {
  DSN_CHECK(P == 0 ? n == 0 : (n > kPanel * (P - 1) && n <= kPanel * P), op, ": n must be in (16*(P-1), 16*P] = (",
            kPanel * (P - 1), ", ", kPanel * P, "] for w with P = ", P, " panels, got ", n);
}

int64_t check_a(const char* op, const Tensor& a) {
  DSN_CHECK(a.dim() == 2 && a.scalar_type() == ST::Float, op, ": a must be a Float tensor [M, K], got ", describe(a));
  const int64_t K = a.size(1);
  DSN_CHECK(K > 0 && K % kBlock == 0, op, ": K = a.size(1) must be a positive multiple of 32, got ", K);
  return K;
}

struct Item { int64_t e, p, r0, r1; };

// seg: row offsets of the E experts (one expert for gemm_fast); lead: 1 when w / s are stacked;
// init: nullptr, or fp32 [R, n] that each output element's sum starts from
Tensor run(const Tensor& a_in, const std::vector<int64_t>& seg, const Tensor& w, const Tensor& s, int64_t fmt,
           int64_t n, int lead, const Tensor* init = nullptr) {
  const Tensor a = a_in.is_contiguous() ? a_in : torch::stable::contiguous(a_in);
  const int64_t R = a.size(0), K = a.size(1), P = w.size(lead), E = int64_t(seg.size()) - 1;
  Tensor out = init ? torch::stable::clone(*init) : torch::stable::new_empty(a, {R, n});
  if (init && !out.is_contiguous()) out = torch::stable::contiguous(out);
  if (R == 0 || n == 0) return out;
  // the activations as bf16, once
  std::unique_ptr<uint16_t[]> abf(new uint16_t[R * K]);
  const float* af = static_cast<const float*>(a.const_data_ptr());
  torch::stable::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    to_bf16(af + begin * K, abf.get() + begin * K, (end - begin) * K);
  });
  // work items; rows are split (in whole tiles) only when the panels alone cannot feed the threads
  const int64_t nth = torch::stable::get_num_threads();
  int64_t busy = 0;
  for (int64_t e = 0; e < E; ++e) busy += (seg[e + 1] > seg[e]) * P;
  const int64_t split = busy == 0 ? 1 : std::max<int64_t>(1, (4 * nth + busy - 1) / busy);
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = seg[e + 1] - seg[e];
    if (rows == 0) continue;
    const int64_t chunk = std::max<int64_t>(kTile, ((rows + split - 1) / split + kTile - 1) / kTile * kTile);
    for (int64_t p = 0; p < P; ++p)
      for (int64_t r0 = seg[e]; r0 < seg[e + 1]; r0 += chunk)
        items.push_back({e, p, r0, std::min(r0 + chunk, seg[e + 1])});
  }
  const auto* wb = static_cast<const uint8_t*>(w.const_data_ptr());
  const float* sb = s.numel() ? static_cast<const float*>(s.const_data_ptr()) : nullptr;
  const int64_t wes = lead ? w.stride(0) * w.element_size() : 0, wps = w.stride(lead) * w.element_size();
  const int64_t ses = lead && sb ? s.stride(0) : 0, sps = sb ? s.stride(lead) : 0;
  float* ob = static_cast<float*>(out.mutable_data_ptr());
  torch::stable::parallel_for(0, int64_t(items.size()), 1, [&](int64_t begin, int64_t end) {
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
  const int64_t K = check_a("gemm_fast", a);
  check_n("gemm_fast", n, check_weight("gemm_fast", w, w_scale, fmt, K, 1, 0));
  return run(a, {0, a.size(0)}, w, w_scale, fmt, n, 0);
}

Tensor gemm_fast_acc(Tensor a, Tensor w, Tensor w_scale, int64_t fmt, int64_t n, Tensor init) {
  const char* op = "gemm_fast_acc";
  const int64_t K = check_a(op, a);
  check_n(op, n, check_weight(op, w, w_scale, fmt, K, 1, 0));
  DSN_CHECK(init.dim() == 2 && init.scalar_type() == ST::Float && init.size(0) == a.size(0) && init.size(1) == n, op,
            ": init must be a Float tensor [M, n] = [", a.size(0), ", ", n, "], got ", describe(init));
  return run(a, {0, a.size(0)}, w, w_scale, fmt, n, 0, &init);
}

Tensor gemm_fast_segments(Tensor a, Tensor offsets, Tensor w, Tensor w_scale, int64_t fmt, int64_t n) {
  const char* op = "gemm_fast_segments";
  const int64_t K = check_a(op, a), R = a.size(0);
  DSN_CHECK(offsets.dim() == 1 && offsets.scalar_type() == ST::Long && offsets.numel() >= 1, op,
            ": offsets must be a Long tensor [E+1], got ", describe(offsets));
  const Tensor off = offsets.is_contiguous() ? offsets : torch::stable::contiguous(offsets);
  const auto* o = static_cast<const int64_t*>(off.const_data_ptr());
  const std::vector<int64_t> seg(o, o + off.numel());
  const int64_t E = int64_t(seg.size()) - 1;
  DSN_CHECK(seg.front() == 0 && seg.back() == R, op, ": offsets must start at 0 and end at R = a.size(0) = ", R,
            ", got ", seg.front(), " and ", seg.back());
  for (int64_t e = 0; e < E; ++e)
    DSN_CHECK(seg[e] <= seg[e + 1], op, ": offsets must be non-decreasing, got offsets[", e, "] = ", seg[e],
              " > offsets[", e + 1, "] = ", seg[e + 1]);
  check_n(op, n, check_weight(op, w, w_scale, fmt, K, E, 1));
  return run(a, seg, w, w_scale, fmt, n, 1);
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
