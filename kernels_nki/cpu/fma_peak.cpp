// dsneuron_bench::fma_peak(iters) -> fp32 [threads]: the machine's fp32 FMA ceiling for cpu_bench.py.
//
// Every thread of the (stable) parallel_for runs `iters` rounds of 12 independent 8-lane fma chains (enough
// to cover 2 FMA pipes x 4-5 cycles of latency), i.e. iters * 12 * 8 * 2 flops; the returned values
// only keep the chains alive. Built with the same -mavx2 -mfma flags as the GEMM kernels.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "simd.h"

namespace {

torch::stable::Tensor fma_peak(int64_t iters) {
  const int64_t nth = torch::stable::get_num_threads();
  torch::stable::Tensor out = torch::stable::empty({nth}, torch::headeronly::ScalarType::Float);
  float* o = static_cast<float*>(out.mutable_data_ptr());
  torch::stable::parallel_for(0, nth, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      dsn::V acc[12];
      for (int i = 0; i < 12; ++i) acc[i] = dsn::vset(float(i));
      const dsn::V x = dsn::vset(0.999999f), y = dsn::vset(1e-7f);
      for (int64_t r = 0; r < iters; ++r)
        for (auto& v : acc) v = dsn::vfma(v, x, y);
      float lane[8];
      o[t] = 0.0f;
      for (auto& v : acc) {
        dsn::vstore(lane, v);
        o[t] += lane[0];
      }
    }
  });
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY(dsneuron_bench, m) { m.def("fma_peak(int iters) -> Tensor"); }
STABLE_TORCH_LIBRARY_IMPL(dsneuron_bench, CompositeExplicitAutograd, m) { m.impl("fma_peak", TORCH_BOX(&fma_peak)); }
