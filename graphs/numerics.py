"""The process-wide numerics switches of the graphs (GEMM order, indexer mode, cpu kernel numerics,
the embedding nudge) and the element-wise ops whose rounding must not depend on the tensor's size.

Where the graphs round differently from the official inference code
(deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py, cited as `model.py <Class.method>`) on purpose:

- One tie rule for every top-k (indexer, candidate blocks, MoE): a stable descending sort, so among
  equal scores the lower position (expert id) wins. `torch.topk` leaves the order unspecified and
  the bf16 indexer scores tie often.
- wo_a (BF16_GEMM below) is the exact dot product rounded to fp32 and then to bf16; the
  reference's bf16 einsum rounds inside its fp32 accumulation in its library's order. Measured on
  tiny's three shipped prompts (every layer): 544 of 9.2M outputs (0.006%) differ by one bf16 step
  on this AVX2 host with torch 2.13's bf16 einsum, a difference of the floor's kind that depends
  on the host's bf16 GEMM kernel and so cannot be reproduced host-independently.
- Exact GEMMs. The golden's GEMMs (every order but "fused") sum exact products in float64 and
  round once (`quant.exact_linear`, `quant.block_scaled_matmul`: each 32-K block of an FP8/FP4
  GEMM is exact, the blocks are added in fp32 in the kernels' order), and so do the references of
  sparse_attn and the indexer score. A row's result then depends neither on how many rows share
  the call nor on the host's BLAS or ISA, which is what makes padded == unpadded, prefill + decode
  == a longer prefill and batch == single hold bit for bit on every host
  (tests/test_host_independence.py). The one GEMM with inexact products, the mHC projection
  (fp32 weights), can differ in about one output in 2^26 (see `exact_linear`).
- The router's square root (sqrtsoftplus) is the IEEE one, as CUDA's sqrtf is (`ieee_sqrt`):
  eager ATen's fp32 sqrt on MKL builds is an ulp off for 1 value in 6, Inductor's is not, and one
  fp32 ulp of a routing weight became up to 256 bf16 ulps of tiny's MoE output.
- BF16_GEMM: the reference's bf16 GEMMs (wo_a's grouped einsum, the indexer's weights_proj and
  wk) run on bf16 operands with fp32 accumulation and one bf16 rounding of the result. Here that is
  written out: the operands are upcast (exact), the GEMM is fp32, the result is cast once. Eager
  bf16 on CPU computes nearly the same (its fp32 sums may be ordered differently), but a compiler
  may not: Inductor turned the 1-row decode einsum into a kernel that rounds inside the sum (40%
  of wo_a's outputs one bf16 step or more off). The indexer's score GEMM keeps the official bf16
  expression (kernels_nki/mqa_logits_ref.py); its operands are FP4-QDQ'd, so its fp32 sums are exact.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .config import INDEXER_MODES, NUMERICS_MODES
from .quant import GEMM_ORDERS


class _Numerics:
    """Process-wide numeric switch read while a step runs or is traced (plain Python, never a graph input).

    gemm_order: how every GEMM sums (`ORDERS`): "ascending" is the kernels' order and the eager
    golden's (exact products, float64-exact 32-K block partials added in ascending order);
    "descending" is the golden's numeric floor (issue 6); "fused" (one fp32 GEMM over the whole K)
    is what the neuron steps trace; "kernel" runs every GEMM through the cpu kernels
    (kernels_nki/cpu_gemm.py: fp32 32-K block partials in k order, ascending blocks) on the weights
    attached by graphs.kernel_weights, which is what the cpu target's stages trace and what the
    golden re-runs a compiled cpu stage with.
    """

    gemm_order: str = "ascending"
    #: how the indexer scores (`INDEXER_MODES`): "official" is the reference's bf16 expression on the
    #: FP4-QDQ'd values (`mqa_logits_bf16`); "kernel" is the FP4 MQA-logits op on their bytes
    #: (`mqa_logits`: fp32 dots and head sum, one bf16 rounding), the NKI kernel on neuron
    indexer: str = "official"
    #: move every element of the embedding output one bf16 step up: the smallest perturbation there
    #: is, used to measure how far one rounding difference carries (the comparison's second floor)
    nudge_embedding: bool = False
    #: how GEMM order "kernel" computes (`NUMERICS_MODES`): "exact" is the fixed-order fp32 kernel
    #: (kernels_nki/cpu_gemm.py, bit-identical to the golden on every host), "fast" the bf16 dot
    #: product kernel (kernels_nki/cpu_gemm_fast.py: deterministic and batch-invariant on one host)
    #: for every GEMM on fp8, fp4 and bf16 weights; fp32 weights (the mHC projections) stay exact
    numerics: str = "exact"


NUMERICS = _Numerics()

#: every GEMM order (`_Numerics.gemm_order`): the block-scaled GEMM orders plus the cpu kernels'
ORDERS = GEMM_ORDERS + ("kernel",)


@contextmanager
def _numerics(field: str, value: object):
    """NUMERICS.<field> = value while the block runs, restored after."""
    prev = getattr(NUMERICS, field)
    setattr(NUMERICS, field, value)
    try:
        yield
    finally:
        setattr(NUMERICS, field, prev)


def gemm_order(order: str):
    """Run (or trace) the model with every block-scaled GEMM summing its K blocks in `order` (a
    context manager). Raises ValueError for an order not in ORDERS."""
    if order not in ORDERS:
        raise ValueError(f"gemm_order: order must be one of {ORDERS}, got {order!r}")
    return _numerics("gemm_order", order)


def indexer_mode(mode: str):
    """Run (or trace) the model with the indexer scoring in `mode` (`_Numerics.indexer`; a context
    manager). Raises ValueError for a mode not in INDEXER_MODES."""
    if mode not in INDEXER_MODES:
        raise ValueError(f"indexer_mode: mode must be one of {INDEXER_MODES}, got {mode!r}")
    return _numerics("indexer", mode)


def kernel_numerics(mode: str):
    """Run (or trace) GEMM order "kernel" with numerics `mode` (`_Numerics.numerics`; a context
    manager). Raises ValueError for a mode not in NUMERICS_MODES."""
    if mode not in NUMERICS_MODES:
        raise ValueError(f"kernel_numerics: mode must be one of {NUMERICS_MODES}, got {mode!r}")
    return _numerics("numerics", mode)


def nudged_embedding():
    """Run the model with its embedding output one bf16 step up everywhere (NUMERICS.nudge_embedding;
    a context manager)."""
    return _numerics("nudge_embedding", True)


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] (int64) of the k largest scores along the last dim, best first.

    Tie rule: among equal scores the lower index wins (stable descending sort). Used for every
    selection in the model so that all targets agree on ties.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    """x fp32 [...] >= 0 -> fp32 [...]: the correctly rounded square root (IEEE 754), which CUDA's
    sqrtf is under the reference's build flags and which Inductor's code computes (sqrtps). Eager
    ATen's fp32 sqrt is not that on an MKL build: it calls MKL's vsSqrt in its HA mode (ATen/cpu/vml.h),
    one fp32 ulp off for 17% of the fp32 values in [2^-24, 2^8). Through float64 it is exact: MKL's float64 root
    rounded to fp32 is the correctly rounded one for every fp32 value in that range (one ulp off in
    float64 at 1.3% of them, never at an fp32 rounding boundary), and the compiled graph computes
    the same bits. GEMM order "fused" (the neuron steps, no float64 on the device) keeps the fp32 op."""
    if NUMERICS.gemm_order == "fused":
        return x.sqrt()
    return x.double().sqrt().float()


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """x fp32 [...] -> fp32 [...]: 1 / (1 + exp(-x)), each element's value independent of the
    tensor's size. Eager ATen's fp32 sigmoid computes whole vectors with a fast exp and the tail of
    the tensor with the scalar one, one ulp apart for 4% of the values on an AVX512 host; in a
    [B,S,hc] tensor whether row i falls in the tail depends on S, so the mHC and engram gates of
    prefill row i changed with the prompt length (and from decode's). Its exp has one result on
    both paths (0 of 4M values differ), and the add and divide are IEEE. GEMM order "fused" (the
    neuron steps) keeps the op."""
    if NUMERICS.gemm_order == "fused":
        return torch.sigmoid(x)
    return 1 / (1 + torch.exp(-x))


def row_softplus(x: torch.Tensor) -> torch.Tensor:
    """x fp32 [...] -> fp32 [...]: log1p(exp(x)) (x itself above 20, as F.softplus), each element's
    value independent of the tensor's size, for the reason of `row_sigmoid` (F.softplus: 10% of
    the values one ulp apart between its vector and scalar paths; exp and log1p: none). The
    router's scores [N, n_experts] put a row in the tail or not depending on N. GEMM order "fused"
    keeps the op."""
    if NUMERICS.gemm_order == "fused":
        return F.softplus(x)
    return torch.where(x > 20, x, torch.log1p(torch.exp(x)))
