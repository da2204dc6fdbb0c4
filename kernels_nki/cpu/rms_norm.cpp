// dsneuron::mean_square(xf) -> fp32 [..., 1]: the RMSNorm reduction of the cpu target's graphs, the
// golden's own expression xf.square().mean(-1, keepdim=True) (kernels_nki/rms_norm.py mean_square)
// as the same two ATen ops, called through the dispatcher. So its bits are those of the host's ATen
// build, as the golden's are; what this file saves is the Python interpreter on every call (the op
// runs inside AOTInductor packages through the proxy executor, ~50 calls per tiny decode token).
// Why ATen and not a summation order of our own: the golden is eager ATen and stays as it is.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <array>
#include <optional>

#include "aten_call.h"
#include "check.h"

#ifndef DSN_NS
#error "build with -DDSN_NS=<op namespace>"
#endif

namespace dsn {
namespace {

using torch::stable::Tensor;
using torch::stable::detail::from;

Tensor mean_square(Tensor xf) {
  DSN_CHECK(xf.scalar_type() == torch::headeronly::ScalarType::Float && xf.dim() >= 1,
            "mean_square: expected fp32 [..., D], got ", torch::headeronly::toString(xf.scalar_type()), " with ",
            xf.dim(), " dims");
  std::array<StableIValue, 4> sq{from(xf)};
  const Tensor squares = aten_call("aten::square", "", sq.data());
  const int64_t last = -1;
  const std::optional<torch::headeronly::IntHeaderOnlyArrayRef> dim{torch::headeronly::IntHeaderOnlyArrayRef(&last, 1)};
  std::array<StableIValue, 4> mean{from(squares), from(dim), from(true),
                                   from(std::optional<torch::headeronly::ScalarType>())};
  return aten_call("aten::mean", "dim", mean.data());
}

}  // namespace
}  // namespace dsn

STABLE_TORCH_LIBRARY_FRAGMENT(DSN_NS, m) { m.def("mean_square(Tensor xf) -> Tensor"); }

STABLE_TORCH_LIBRARY_IMPL(DSN_NS, CPU, m) { m.impl("mean_square", TORCH_BOX(&dsn::mean_square)); }
