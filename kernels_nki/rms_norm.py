"""`dsneuron::mean_square`: the model's RMSNorm reduction as one call into eager ATen, for the cpu target.

    torch.ops.dsneuron.mean_square(xf) -> fp32 [..., 1]     (xf fp32 [..., D])

`rms_norm` is the norm itself (graphs/model.py RMSNorm calls it in every GEMM order, so the golden
and the cpu target's graphs run the same expression): fp32 x * rsqrt(mean(x^2) + eps), times the
weight, cast back. In the cpu target's graphs its mean of squares is this op, registered with
`torch.library.Library`, not `custom_op`, so the cpu lowering keeps it as a call (compiler/lower.py
inlines only ops with a torch reference) and the executables reduce with ATen's own mean; the
elementwise rest stays in Inductor's kernels, which give eager's bits.

Why: Inductor sums the fp32 mean of squares in another order than ATen's vectorised sum, which
leaves about one row in 2,000-5,000 one bf16 step apart (tests/test_compiled_rounding.py), and the
next FP8 activation QDQ makes that step a whole e4m3 step. ATen's order is that of the host's ATen
build, so the op is bit-identical to the golden on the host that runs both, not across hosts
(neither is the golden). The cost: one call through AOTInductor's proxy executor into this Python
kernel per norm (about 50 per tiny decode token). Source: DeepSeek-V4.1-Flash: inference/model.py
RMSNorm.
"""

from __future__ import annotations

import torch


def mean_square(xf: torch.Tensor) -> torch.Tensor:
    """xf [..., D] fp32 -> mean(xf^2) over D, fp32 [..., 1]: the norm's one reduction."""
    return xf.square().mean(-1, keepdim=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mean_sq=mean_square) -> torch.Tensor:
    """x [..., D] bf16/fp32, weight [D] bf16 -> (weight * x * rsqrt(mean(x^2) + eps)) in fp32, as
    x.dtype; mean_sq computes the mean of squares (the op `torch.ops.dsneuron.mean_square` in the
    cpu target's graphs, the same ATen expression)."""
    xf = x.float()
    xf = xf * torch.rsqrt(mean_sq(xf) + eps)
    return (weight.float() * xf).to(x.dtype)


def _check(xf: torch.Tensor) -> None:
    if xf.dtype != torch.float32 or xf.dim() < 1:
        raise ValueError(f"mean_square: expected fp32 [..., D], got {xf.dtype} {tuple(xf.shape)}")


def _mean_square_cpu(xf: torch.Tensor) -> torch.Tensor:
    _check(xf)
    return mean_square(xf)


_LIB = torch.library.Library("dsneuron", "FRAGMENT")  # kept: the registration lives as long as it
_LIB.define("mean_square(Tensor xf) -> Tensor")
_LIB.impl("mean_square", _mean_square_cpu, "CPU")


@torch.library.register_fake("dsneuron::mean_square")
def _mean_square_fake(xf):
    _check(xf)
    return xf.new_empty((*xf.shape[:-1], 1))
