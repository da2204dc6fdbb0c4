// What gemm.cpp (exact numerics) and gemm_fast.cpp (fast numerics) share around their kernels: the
// prepared panel layout's constants, the argument checks of their three ops (plain, _acc,
// _segments: the same signatures and the same prepared weights, cpu_gemm.py), and the work items
// their `run` splits a call into. Each file includes it once and keeps its own `run`, whose
// signature is RunFn; `gemm_op`, `gemm_acc_op` and `gemm_segments_op` check the arguments and call
// it. max_fmt: the largest format code the family takes (gemm.cpp 3, fp32; gemm_fast.cpp 2, bf16).
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "check.h"

namespace dsn {
namespace {

using torch::stable::Tensor;
using ST = torch::headeronly::ScalarType;

constexpr int64_t kPanel = 16;  // output columns per prepared panel (the layout of cpu_gemm.py)
constexpr int64_t kBlock = 32;  // k per block partial (the UE8M0 scale block)
enum Fmt : int64_t { FP8 = 0, FP4 = 1, BF16 = 2, FP32 = 3 };
const char* const kFmtName[] = {"fp8", "fp4", "bf16", "fp32"};

template <class Sizes>
std::string shape_str(const Sizes& sizes) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < sizes.size(); ++i) o << (i ? ", " : "") << sizes[i];
  o << "]";
  return o.str();
}

std::string describe(const Tensor& t) {
  return std::string(torch::headeronly::toString(t.scalar_type())) + " " + shape_str(t.sizes()) +
         (t.is_contiguous() ? "" : " (not contiguous)");
}

// w: [P, Kw, 16] (lead = 0) or [E, P, Kw, 16] (lead = 1); returns P
int64_t check_weight(const char* op, const Tensor& w, const Tensor& s, int64_t fmt, int64_t K, int64_t E, int lead,
                     int64_t max_fmt) {
  if (max_fmt == BF16)
    DSN_CHECK(fmt >= 0 && fmt <= BF16, op, ": fmt must be 0 (fp8), 1 (fp4) or 2 (bf16), got ", fmt,
              " (fp32 weights have no fast path: gemm_panels)");
  DSN_CHECK(fmt >= 0 && fmt <= 3, op, ": fmt must be 0 (fp8), 1 (fp4), 2 (bf16) or 3 (fp32), got ", fmt);
  const ST want = fmt == BF16 ? ST::BFloat16 : fmt == FP32 ? ST::Float : ST::Byte;
  const int64_t kw = fmt == FP4 ? K / 2 : K;
  DSN_CHECK(w.dim() == 3 + lead && w.scalar_type() == want && w.is_contiguous() && (!lead || w.size(0) == E) &&
                w.size(lead + 1) == kw && w.size(lead + 2) == kPanel,
            op, ": w must be a contiguous ", torch::headeronly::toString(want), " tensor [", lead ? "E, " : "", "P, ",
            fmt == FP4 ? "K/2=" : "K=", kw, ", 16] for fmt ", fmt, " (", kFmtName[fmt], ")",
            lead ? " with E = offsets.numel() - 1 = " + std::to_string(E) : "", ", got ", describe(w));
  const int64_t P = w.size(lead);
  if (fmt == FP8 || fmt == FP4) {
    std::vector<int64_t> shape;
    if (lead) shape.push_back(E);
    shape.insert(shape.end(), {P, K / kBlock});
    if (fmt == FP4) shape.push_back(kPanel);
    const auto got = s.sizes();
    const bool ok = std::equal(shape.begin(), shape.end(), got.begin(), got.end());
    DSN_CHECK(s.scalar_type() == ST::Float && s.is_contiguous() && ok, op, ": w_scale must be a contiguous Float ",
              "tensor ", shape_str(shape), " for fmt ", fmt, " (", kFmtName[fmt], ") and w ", shape_str(w.sizes()),
              ", got ", describe(s));
  } else {
    DSN_CHECK(s.numel() == 0, op, ": w_scale must be empty for fmt ", fmt, " (", kFmtName[fmt], "), got ", describe(s));
  }
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

// one work item: rows r0 .. r1-1 of expert e against its panel p
struct Item { int64_t e, p, r0, r1; };

// Where an item's prepared panel and its scales are: w [P, ...] or stacked per expert [E, P, ...]
// (lead 1), s likewise or empty (bf16, fp32); panel_bytes: from one panel to the next
struct Panels {
  const uint8_t* w;
  const float* s;
  int64_t expert_bytes, panel_bytes, expert_scales, panel_scales;
  Panels(const Tensor& wt, const Tensor& st, int lead)
      : w(static_cast<const uint8_t*>(wt.const_data_ptr())),
        s(st.numel() ? static_cast<const float*>(st.const_data_ptr()) : nullptr),
        expert_bytes(lead ? wt.stride(0) * wt.element_size() : 0),
        panel_bytes(wt.stride(lead) * wt.element_size()),
        expert_scales(lead && s ? st.stride(0) : 0),
        panel_scales(s ? st.stride(lead) : 0) {}
  const uint8_t* weight(const Item& it) const { return w + it.e * expert_bytes + it.p * panel_bytes; }
  const float* scale(const Item& it) const { return s ? s + it.e * expert_scales + it.p * panel_scales : nullptr; }
};

// The items of a call with experts' row offsets `seg` and P panels each: one per (expert, panel),
// rows split in whole tiles of `tile` rows only when the panels alone cannot feed the threads
std::vector<Item> work_items(const std::vector<int64_t>& seg, int64_t P, int64_t tile) {
  const int64_t E = int64_t(seg.size()) - 1, nth = torch::stable::get_num_threads();
  int64_t busy = 0;
  for (int64_t e = 0; e < E; ++e) busy += (seg[e + 1] > seg[e]) * P;
  const int64_t split = busy == 0 ? 1 : std::max<int64_t>(1, (4 * nth + busy - 1) / busy);
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = seg[e + 1] - seg[e];
    if (rows == 0) continue;
    const int64_t chunk = std::max<int64_t>(tile, ((rows + split - 1) / split + tile - 1) / tile * tile);
    for (int64_t p = 0; p < P; ++p)
      for (int64_t r0 = seg[e]; r0 < seg[e + 1]; r0 += chunk) items.push_back({e, p, r0, std::min(r0 + chunk, seg[e + 1])});
  }
  return items;
}

// Panel bytes a thread must have to read before a call's items are split across threads: below
// it they run on the calling thread, since a parallel_for's rendezvous costs more than it saves.
// Each element is still computed by one thread in its fixed order, so results do not depend on
// it. Measured on tiny's decode (2 threads, a shared 2-core host at load ~12): a step took 7.0 s
// at 2 threads and 0.6 s at 1, each of the ~100 small GEMVs a step waiting ~35 ms for the second
// thread to be scheduled; on a quiet host the rendezvous is ~10-30 us, a 256 KB panel read ~25 us
constexpr int64_t kParallelBytes = 256 << 10;

// the parallel_for grain of `items` over panels of `panel_bytes`: a panel counted once per `tile`
// rows the item serves (prefill items carry their rows' compute), each thread's share >= kParallelBytes
int64_t item_grain(const std::vector<Item>& items, int64_t panel_bytes, int64_t tile) {
  int64_t total = 0;
  for (const Item& it : items) total += panel_bytes * ((it.r1 - it.r0 + tile - 1) / tile);
  if (items.empty() || total <= 0) return 1;
  const int64_t per = std::max<int64_t>(1, total / int64_t(items.size()));
  return std::max<int64_t>(1, (kParallelBytes + per - 1) / per);
}

// a family's kernel entry: seg = row offsets of the E experts (one expert for the plain ops);
// lead: 1 when w / s are stacked per expert; init: nullptr, or fp32 [R, n] the sums start from
using RunFn = Tensor (*)(const Tensor& a, const std::vector<int64_t>& seg, const Tensor& w, const Tensor& s,
                         int64_t fmt, int64_t n, int lead, const Tensor* init);

Tensor gemm_op(RunFn run, int64_t max_fmt, const char* op, const Tensor& a, const Tensor& w, const Tensor& s,
               int64_t fmt, int64_t n) {
  const int64_t K = check_a(op, a);
  check_n(op, n, check_weight(op, w, s, fmt, K, 1, 0, max_fmt));
  return run(a, {0, a.size(0)}, w, s, fmt, n, 0, nullptr);
}

// init [M, n] fp32 + a @ W.T, every element's block sum continued from init[m, n] instead of 0
Tensor gemm_acc_op(RunFn run, int64_t max_fmt, const char* op, const Tensor& a, const Tensor& w, const Tensor& s,
                   int64_t fmt, int64_t n, const Tensor& init) {
  const int64_t K = check_a(op, a);
  check_n(op, n, check_weight(op, w, s, fmt, K, 1, 0, max_fmt));
  DSN_CHECK(init.dim() == 2 && init.scalar_type() == ST::Float && init.size(0) == a.size(0) && init.size(1) == n, op,
            ": init must be a Float tensor [M, n] = [", a.size(0), ", ", n, "], got ", describe(init));
  return run(a, {0, a.size(0)}, w, s, fmt, n, 0, &init);
}

Tensor gemm_segments_op(RunFn run, int64_t max_fmt, const char* op, const Tensor& a, const Tensor& offsets,
                        const Tensor& w, const Tensor& s, int64_t fmt, int64_t n) {
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
  check_n(op, n, check_weight(op, w, s, fmt, K, E, 1, max_fmt));
  return run(a, seg, w, s, fmt, n, 1, nullptr);
}

}  // namespace
}  // namespace dsn
