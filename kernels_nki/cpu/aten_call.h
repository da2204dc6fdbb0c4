// One ATen op called from a kernel through the dispatcher of torch's stable C ABI
// (torch/csrc/stable: torch_call_dispatcher): `stack` holds the op's arguments as StableIValues and
// receives its result; an error of the op is thrown as an exception. rms_norm.cpp and
// index_scores.cpp run the golden's own ATen ops this way, so their bits are the golden's.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

namespace dsn {
namespace {

inline torch::stable::Tensor aten_call(const char* op, const char* overload, StableIValue* stack) {
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(op, overload, stack, TORCH_ABI_VERSION));
  return torch::stable::detail::to<torch::stable::Tensor>(stack[0]);
}

}  // namespace
}  // namespace dsn
