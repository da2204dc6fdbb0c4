// dsneuron::index_scores(q, index_k, w) -> bf16 [B, S, T]: the lightning indexer's scores of the
// cpu target, read straight from the index-key cache bytes. Bit for bit the golden expression
// kernels_nki/mqa_logits_ref.py `mqa_logits_bf16_ref(q, dequantize_state(index_k), w)`:
//
//   k[b, t, :]       = bf16(e2m1 code * 2^(UE8M0 byte - 127)) per 32-element block (the cache row:
//                      D/2 packed e2m1 bytes, even element in the low nibble, then D/32 scale bytes)
//   score[b,s,h,t]   = bf16(fp32(sum_d q[b,s,h,d] * k[b,t,d]))   the sum in float64
//   out[b, s, t]     = (relu(score) * w[..., None]).sum(dim=2)   ATen's bf16 ops, as the golden
//
// Why: the golden dequantises the whole cache to bf16, widens both operands to float64 and runs a
// float64 GEMM (~260 us a decode step per indexer layer of tiny at 1,024 keys); here each key is
// decoded once, into a 16-key tile, and never leaves the cache. The products are exact in float64
// (bf16 times e2m1 x 2^e: 8 + 2 significant bits), and each dot is one float64 chain in ascending
// d, vectorised across the 16 keys of a tile only, so the sum is the same on every ISA, thread count
// and batch. It equals the golden's float64 GEMM whenever that sum is exact, which holds for the
// model's FP4-QDQ'd operands: each 32-block's products are multiples of one power of two, below
// 2^13 of them, so the sum stays exact while the D/32 blocks' scales (q's times k's) span at most
// about 40 binades (UE8M0 scales of one row's activations span far fewer). The relu, the weighting and the head sum are ATen's own ops, called through the
// dispatcher, so they are the golden's bits on this host as the golden's are.
// Source: DeepSeek-V4.1-Flash:inference/model.py Indexer.forward (einsum "bshd,btd->bsht", relu,
// times the weights, sum over the heads).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "aten_call.h"
#include "bits.h"
#include "check.h"

#ifndef DSN_NS
#error "build with -DDSN_NS=<op namespace>"
#endif

namespace dsn {
namespace {

using torch::stable::Tensor;
using torch::stable::detail::from;
using ST = torch::headeronly::ScalarType;

constexpr int64_t kBlock = 32;  // UE8M0 scale block of the index keys (graphs/quant.py INDEX_K_FORMAT)
constexpr int64_t kTile = 16;   // keys decoded together; the SIMD lanes of the dot products

// key t's D values into lane j of the tile kt [D][kTile]: per 32-block the 16 values e2m1 x s in
// fp32, which are state_dequant's bf16 values exactly (at most 3 significant bits, and fp32 keeps
// e2m1 x 2^-127; 6 x 2^127 is inf in both), then widened to float64
inline void decode_key(const uint8_t* row, int64_t D, double* kt, int64_t j) {
  for (int64_t blk = 0; blk < D / kBlock; ++blk) {
    const float s = ue8m0_value(row[D / 2 + blk]);
    double v[16];
    for (int c = 0; c < 16; ++c) v[c] = double(kE2m1Values[c] * s);
    const uint8_t* codes = row + blk * kBlock / 2;
    double* out = kt + blk * kBlock * kTile + j;
    for (int64_t i = 0; i < kBlock / 2; ++i) {
      out[(2 * i) * kTile] = v[codes[i] & 0xF];
      out[(2 * i + 1) * kTile] = v[codes[i] >> 4];
    }
  }
}

std::string shape_of(const Tensor& t) {
  std::ostringstream o;
  o << torch::headeronly::toString(t.scalar_type()) << " [";
  for (int64_t i = 0; i < t.dim(); ++i) o << (i ? ", " : "") << t.size(i);
  o << "]";
  return o.str();
}

Tensor index_scores(Tensor q_in, Tensor k_in, Tensor w_in) {
  const char* op = "index_scores";
  DSN_CHECK(q_in.scalar_type() == ST::BFloat16 && q_in.dim() == 4, op, ": q must be bf16 [B,S,H,D], got ", shape_of(q_in));
  const int64_t B = q_in.size(0), S = q_in.size(1), H = q_in.size(2), D = q_in.size(3);
  DSN_CHECK(D > 0 && D % kBlock == 0, op, ": q's head dim must be a positive multiple of ", kBlock, ", got ", D);
  const int64_t row = D / 2 + D / kBlock;
  DSN_CHECK(k_in.scalar_type() == ST::Byte && k_in.dim() == 3 && k_in.size(0) == B && k_in.size(2) == row, op,
            ": index_k must be uint8 [B=", B, ",T,", row, "] (D/2 e2m1 bytes and D/32 UE8M0 bytes a key), got ",
            shape_of(k_in));
  DSN_CHECK(w_in.scalar_type() == ST::BFloat16 && w_in.dim() == 3 && w_in.size(0) == B && w_in.size(1) == S &&
                w_in.size(2) == H,
            op, ": w must be bf16 [B=", B, ",S=", S, ",H=", H, "], got ", shape_of(w_in));
  const int64_t T = k_in.size(1);
  // a leading slice of the cache is fine as it is: only each key's bytes must be contiguous
  const Tensor k = (k_in.stride(2) == 1 && k_in.stride(1) == row) ? k_in : torch::stable::contiguous(k_in);
  const Tensor q = q_in.is_contiguous() ? q_in : torch::stable::contiguous(q_in);
  Tensor score = torch::stable::new_empty(q, {B, S, H, T}, ST::BFloat16);
  const uint16_t* qp = static_cast<const uint16_t*>(q.const_data_ptr());
  const uint8_t* kp = static_cast<const uint8_t*>(k.const_data_ptr());
  uint16_t* sp = static_cast<uint16_t*>(score.mutable_data_ptr());
  const int64_t kb = k.stride(0), tiles = (T + kTile - 1) / kTile;
  torch::stable::parallel_for(0, B * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> kt(D * kTile);  // [D][kTile]: lane j = key t0 + j
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / tiles, t0 = (job % tiles) * kTile, n = std::min(kTile, T - t0);
      for (int64_t j = 0; j < n; ++j) decode_key(kp + b * kb + (t0 + j) * row, D, kt.data(), j);
      for (int64_t j = n; j < kTile; ++j)
        for (int64_t d = 0; d < D; ++d) kt[d * kTile + j] = 0.0;
      for (int64_t r = 0; r < S * H; ++r) {
        const uint16_t* qr = qp + (b * S * H + r) * D;
        double acc[kTile] = {};
        for (int64_t d = 0; d < D; ++d) {
          const double qd = bf16_value(qr[d]);
          const double* kd = kt.data() + d * kTile;
          for (int64_t j = 0; j < kTile; ++j) acc[j] = acc[j] + qd * kd[j];
        }
        uint16_t* out = sp + (b * S * H + r) * T + t0;
        for (int64_t j = 0; j < n; ++j) out[j] = bf16_bits(float(acc[j]));
      }
    }
  });
  // (relu(score) * w[..., None]).sum(dim=2), ATen's ops as the golden runs them
  std::array<StableIValue, 4> st{from(score)};
  const Tensor relu = aten_call("aten::relu", "", st.data());
  const int64_t last = -1;
  st = {from(w_in), from(last)};
  const Tensor w4 = aten_call("aten::unsqueeze", "", st.data());
  st = {from(relu), from(w4)};
  const Tensor weighted = aten_call("aten::mul", "Tensor", st.data());
  const int64_t heads = 2;
  const std::optional<torch::headeronly::IntHeaderOnlyArrayRef> dim{torch::headeronly::IntHeaderOnlyArrayRef(&heads, 1)};
  st = {from(weighted), from(dim), from(false), from(std::optional<ST>())};
  return aten_call("aten::sum", "dim_IntList", st.data());
}

}  // namespace
}  // namespace dsn

STABLE_TORCH_LIBRARY_FRAGMENT(DSN_NS, m) { m.def("index_scores(Tensor q, Tensor index_k, Tensor w) -> Tensor"); }

STABLE_TORCH_LIBRARY_IMPL(DSN_NS, CPU, m) { m.impl("index_scores", TORCH_BOX(&dsn::index_scores)); }
