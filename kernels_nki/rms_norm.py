"""RMSNorm as one expression for every GEMM order: the golden's and the cpu target's graphs run it.

    rms_norm(x, weight, eps, mean_sq) = (weight * x * rsqrt(mean_sq(x) + eps)) in fp32, as x.dtype

`mean_square` is the golden's reduction, xf.square().mean(-1, keepdim=True) in eager ATen. The cpu
target's graphs pass `torch.ops.dsneuron.mean_square` instead (graphs/model.py RMSNorm): the same two
ATen ops called from C++ (kernels_nki/cpu/rms_norm.cpp, built with the cpu kernels), registered
outside `custom_op`, so the cpu lowering keeps it as a call (compiler/lower.py inlines only ops with a
torch reference) and the executables reduce with ATen's own mean; the elementwise rest stays in
Inductor's kernels, which give eager's bits.

Why: Inductor sums the fp32 mean of squares in another order than ATen's vectorised sum, which
leaves about one row in 2,000-5,000 one bf16 step apart (tests/test_compiled_rounding.py), and the
next FP8 activation QDQ makes that step a whole e4m3 step. ATen's order is that of the host's ATen
build, so the op is bit-identical to the golden on the host that runs both, not across hosts
(neither is the golden). Source: DeepSeek-V4.1-Flash: inference/model.py RMSNorm.
"""

from __future__ import annotations

import torch


def mean_square(xf: torch.Tensor) -> torch.Tensor:
    """xf [..., D] fp32 -> mean(xf^2) over D, fp32 [..., 1]: the norm's one reduction."""
    return xf.square().mean(-1, keepdim=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mean_sq=mean_square) -> torch.Tensor:
    """x [..., D] bf16/fp32, weight [D] bf16 -> (weight * x * rsqrt(mean(x^2) + eps)) in fp32, as
    x.dtype; mean_sq computes the mean of squares (`mean_square`, or in the cpu target's graphs the
    op `torch.ops.dsneuron.mean_square`, the same ATen expression)."""
    xf = x.float()
    xf = xf * torch.rsqrt(mean_sq(xf) + eps)
    return (weight.float() * xf).to(x.dtype)
