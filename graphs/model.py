"""DeepSeek-V4.1-Flash (basic mode) as explicit-state step functions: the eager golden model and the
graphs that `torch.export` traces per bucket are this one implementation.

Numerics follow the official inference code, deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py
(revision dba1be0a, cited below as `model.py <Class.method>`), with its kernels (act_quant,
fp4_act_quant, fp8_gemm/fp4_gemm, sparse_attn, hc_split_sinkhorn) as summarised in
reference/deepseek_v4_arch.md sections 2 and 7. Where this module differs on purpose it says so:

- Static shapes. The reference slices caches to the live length and asks top-k for
  `min(index_topk, compress_len)`; here every tensor has its bucket shape, unreachable positions are
  masked to -inf and unused index slots are -1. Trailing -1 slots are exactly neutral in the online
  softmax.
- One index-list layout for prefill, decode and chunk, unlike the reference's prefill. For a query
  at position i the window part is W slots, slot j holding position i-W+1+j (-1 before position
  0), and the compressed part follows at offset W. The reference's prefill list
  (get_window_topk_idxs) is min(L, W) wide, the window positions first, so for a prompt of L
  tokens the compressed keys start at min(L, W) there but at W in its decode: the same key set
  in other 64-key blocks of the online softmax (`sparse_attn`), so the same attention up to the
  blocks' rounding, a deviation of the GEMM-order floor's kind (tiny, W = 128: prefill row i
  differed from decode at i in low bits). With one layout, prefill row i is bit-identical to a
  decode step at i and to row i of a prefill of any other length: what a prefix cache (a
  snapshot after a prefix, continued by a chunk) and a speculative verify (a chunk checked
  against the decode steps it stands for) need. The width never depends on L, so a padded prompt
  runs bit for bit like the unpadded one.
- One tie rule for every top-k (indexer, candidate blocks, MoE): a stable descending sort, so among
  equal scores the lower position (expert id) wins. `torch.topk` leaves the order unspecified and
  the bf16 indexer scores tie often.
- Per-row positions. A batch may mix prompt lengths (prefill `valid_len[B]`) and decode positions
  (`pos[B]`); ring slots, compressor completion and cache writes are selected per row with masks.
- The MoE of the exported steps has static shapes. A prefill runs every expert on every token
  with weight 0 where the token is not routed, as one batched GEMM over the stacked experts; adding
  an exact zero leaves the fp32 sum bit-identical to the reference's routed loop, which the eager
  golden uses (`MoE.forward(routed=True)`). A decode step (tokens * topk < experts) gathers the
  packed weights of each token's topk experts and dequantises only those, and adds the experts in
  ascending id order, as the routed loop does.
- RoPE is applied with explicit real arithmetic in fp32 (no complex tensors in the graph), on
  cos/sin tables taken from torch.polar as the reference's freqs_cis is; the reference's complex
  multiply rounds each of its two products and their sum as the real form does. Measured on tiny's
  three shipped prompts (inverse RoPE of every layer's attention output): 0 of 4.6M bf16 elements
  differ from the complex form (16 did with torch.cos/torch.sin tables).
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
- No per-head RMS rescale of q: V4-Flash had one, the V4.1 code does not (model.py Attention.forward).
- Chunks. The reference prefills only at position 0 and decodes one token at a time; a chunk (a
  prefill continuing from state at any position, StepInputs.chunk) has no counterpart there, so it
  computes what that many decode steps in order compute: decode's window and compressed index
  lists per query, decode's pooling of each compressed group, decode's state afterwards
  (graphs/steps.py prefill_chunk).

Shapes: B batch, S tokens in this call, D dim, H heads, hd head_dim, rd rope_head_dim, W window,
hc hc_mult, C = max_seq_len // ratio compressed slots, T compressed positions visible to a call.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch._higher_order_ops.while_loop import while_loop
from torch import nn

import dsneuron.kernels_nki  # noqa: F401  registers torch.ops.dsneuron.*
from dsneuron.kernels_nki.formats import SPELLING, as_uint8, e4m3_to_float, ue8m0_to_float
from dsneuron.kernels_nki.rms_norm import mean_square, rms_norm

from .config import INDEXER_MODES, NUMERICS_MODES, ModelConfig
from .quant import (COMPRESS_KV_FORMAT, GEMM_ORDERS, INDEX_K_FORMAT, StateFormat, act_quant_qdq, add_blocks,
                    block_partials, dequant_fp4_weight, dequant_fp8_weight, dequantize_state, experts_linear, fp4_act_quant_qdq,
                    fp4_operand_bytes, fp8_activation, fp8_linear, linear_fp32, quantize_state, window_format)


#: a sharded sum's hook (compiler/parallel.py Comm.chain): chain(add, zero) runs add on the previous
#: ranks' fp32 sum (zero on rank 0) and returns the last rank's
Chain = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------------- options
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


@dataclass
class Capture:
    """Optional record of every stage's inputs and outputs (eager only), keyed `layers.3.attn.out`.

    Tensors are detached copies, so a stage can be re-run alone from them.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __call__(self, name: str, t: torch.Tensor | None) -> None:
        if t is not None:
            self.tensors[name] = t.detach().clone()


def _cap(cap: Capture | None, name: str, t: torch.Tensor | None) -> None:
    if cap is not None:
        cap(name, t)


# ----------------------------------------------------------------------------------------- cpu kernels
def leading(cache: torch.Tensor, n: int) -> torch.Tensor:
    """cache [B,C,...] -> its first n slots [B,n,...]. An index_select rather than a slice: for B > 1
    the slice of a longer cache is strided, and a later op's contiguity check would specialise a
    dynamic token count n to C."""
    if isinstance(n, int) and n == cache.size(1):  # (comparing a symbolic n would specialise it)
        return cache
    return cache.index_select(1, torch.arange(n, device=cache.device))


def slot_index(slot: torch.Tensor, X: int) -> torch.Tensor:
    """slot int64 [B] -> the gather / scatter index int64 [B,1,X] of row slot[b] of a [B,C,X] cache."""
    return slot.view(-1, 1, 1).expand(-1, 1, X)


def write_slot(cache: torch.Tensor, row: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """cache [B,C,X] with row [B,1,X] written at slot [B] (int64, 0 <= slot < C), the rest as it was.
    A scatter: Inductor makes it a copy of the cache and one row's store, where a where() over the
    cache tests every element's slot (a decode step's cache writes went 4.2 -> ~0.3 ms on tiny)."""
    return cache.scatter(1, slot_index(slot, cache.size(2)), row)


def kernel_gemm(a: torch.Tensor, owner: nn.Module, prefix: str, fmt: str, n: int,
                init: torch.Tensor | None = None) -> torch.Tensor:
    """a fp32 [..., K] @ W.T -> fp32 [..., n] through the cpu kernel (GEMM order "kernel"), W the
    prepared weight `owner` holds as buffers <prefix>kernel_w / <prefix>kernel_w_scale; with init
    fp32 [..., n] each element's block sum starts from init (cpu_gemm.gemm_acc). Numerics "fast"
    (`kernel_numerics`) runs it on the bf16 dot product kernel unless fmt is fp32."""
    kernels = _gemm_kernels(fmt)
    lead = a.shape[:-1]
    prepared = {"w": getattr(owner, f"{prefix}kernel_w"), "w_scale": getattr(owner, f"{prefix}kernel_w_scale")}
    a2 = a.reshape(-1, a.shape[-1])
    if init is None:
        return kernels.gemm(a2, prepared, fmt, n).reshape(*lead, n)
    return kernels.gemm_acc(a2, prepared, fmt, n, init.reshape(-1, n)).reshape(*lead, n)


def _gemm_kernels(fmt: str):
    """The module whose gemm / gemm_acc / gemm_segments run a GEMM on `fmt` weights in the current
    numerics: cpu_gemm (exact), or cpu_gemm_fast (fast, but fp32 weights, which it does not take)."""
    if NUMERICS.numerics == "fast" and fmt != "fp32":
        from dsneuron.kernels_nki import cpu_gemm_fast  # builds the kernels on first use

        return cpu_gemm_fast
    from dsneuron.kernels_nki import cpu_gemm  # builds the kernels on first use

    return cpu_gemm


def kernel_gemm_segments(a: torch.Tensor, offsets: torch.Tensor, owner: nn.Module, prefix: str, fmt: str,
                         n: int) -> torch.Tensor:
    """Grouped `kernel_gemm`: rows offsets[e]..offsets[e+1]-1 of a fp32 [R, K] against the e-th of
    the stacked prepared weights <prefix>kernel_w / _scale of `owner` -> fp32 [R, n]."""
    w, ws = getattr(owner, f"{prefix}kernel_w"), getattr(owner, f"{prefix}kernel_w_scale")
    return _gemm_kernels(fmt).gemm_segments(a, offsets, {"w": w, "w_scale": ws}, fmt, n)


def kernel_fp8_activation(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """`fp8_activation` (FP8 QDQ, fp32 out) as one cpu kernel call: bit-identical, and one graph
    node where the decomposed QDQ is ~35 (kernels_nki/cpu_gemm.py `fp8_act_dequant`)."""
    from dsneuron.kernels_nki import cpu_gemm

    return cpu_gemm.fp8_act_dequant(x, block)


def fp8_qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    """`act_quant_qdq` (x.dtype out); in GEMM order "kernel" through `kernel_fp8_activation`."""
    if NUMERICS.gemm_order != "kernel":
        return act_quant_qdq(x, block)
    return kernel_fp8_activation(x, block).to(x.dtype)


def fp4_qdq(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    """`fp4_act_quant_qdq` (x.dtype out); in GEMM order "kernel" as one cpu kernel call, bit-identical
    (kernels_nki/cpu_gemm.py `fp4_act_dequant`), where the decomposed QDQ is ~40 graph nodes."""
    if NUMERICS.gemm_order != "kernel":
        return fp4_act_quant_qdq(x, block, scale_fmt)
    from dsneuron.kernels_nki import cpu_gemm

    return cpu_gemm.fp4_act_dequant(x, block, scale_fmt).to(x.dtype)


def state_bytes(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """x [..., K] bf16/fp32 before its QDQ -> the cache rows uint8 [..., fmt.row_bytes(K)] that hold
    its QDQ (`quant.quantize_state`); in GEMM order "kernel" as one cpu kernel call, bit-identical
    (kernels_nki/cpu_gemm.py `state_quant`)."""
    if NUMERICS.gemm_order != "kernel":
        return quantize_state(x, fmt)
    from dsneuron.kernels_nki import cpu_gemm

    return cpu_gemm.state_quant(x, fmt.block, fmt.elem, fmt.scale)


def state_values(b: torch.Tensor, K: int, fmt: StateFormat) -> torch.Tensor:
    """Cache rows uint8 [..., fmt.row_bytes(K)] -> their values bf16 [..., K], exact
    (`quant.dequantize_state`; GEMM order "kernel": cpu_gemm.py `state_dequant`)."""
    if NUMERICS.gemm_order != "kernel":
        return dequantize_state(b, K, fmt).to(torch.bfloat16)
    from dsneuron.kernels_nki import cpu_gemm

    return cpu_gemm.state_dequant(b, K, fmt.block, fmt.elem, fmt.scale)


def kernel_mean_square(xf: torch.Tensor) -> torch.Tensor:
    """`mean_square` (xf fp32 [..., D] -> fp32 [..., 1]) as one cpu kernel call, bit-identical: the
    golden's ATen expression, run from C++ (kernels_nki/cpu_gemm.py `mean_square`)."""
    from dsneuron.kernels_nki import cpu_gemm

    return cpu_gemm.mean_square(xf)


def _plain_fmt(owner: nn.Module, prefix: str) -> str:
    """The kernel format of a prepared plain weight: bf16 or fp32 panels (a bf16 checkpoint weight
    the model holds as fp32 is prepared from its bf16 bytes)."""
    return "bf16" if getattr(owner, f"{prefix}kernel_w").dtype == torch.bfloat16 else "fp32"


# ----------------------------------------------------------------------------------------- modules
class Linear(nn.Module):
    """A projection stored as the checkpoint stores it.

    kind "fp8": weight float8_e4m3fn [out, in] + scale float8_e8m0fnu [ceil(out/32), ceil(in/32)];
    kind "fp4": weight int8 [out, in/2] (two e2m1 codes, even element low) + scale e8m0 [out, in/32];
    both run as act_quant(x, 1x32) + block-scaled GEMM -> bf16 (model.py `linear`).
    kind "bf16": F.linear of bf16 operands accumulated in fp32, one bf16 rounding (see BF16_GEMM);
    kind "fp32": plain fp32 F.linear (input cast to fp32).
    """

    def __init__(self, in_features: int, out_features: int, kind: str = "fp8", block: int = 32):
        super().__init__()
        self.in_features, self.out_features, self.kind, self.block = in_features, out_features, kind, block
        if kind == "fp8":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.scale = nn.Parameter(torch.empty(-(-out_features // block), -(-in_features // block), dtype=torch.float8_e8m0fnu), requires_grad=False)
        elif kind == "fp4":
            self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.int8), requires_grad=False)
            self.scale = nn.Parameter(torch.empty(out_features, in_features // 32, dtype=torch.float8_e8m0fnu), requires_grad=False)
        else:
            dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[kind]
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        """fp32 [out, in]: exact values of the quantised weight (power-of-two scales)."""
        if self.kind == "fp8":
            return dequant_fp8_weight(self.weight, self.scale, self.block)
        if self.kind == "fp4":
            return dequant_fp4_weight(self.weight, self.scale)
        return self.weight.float()

    #: float64 [out, in] copy of the weight's values kept by `Transformer.cache_dequantized`
    #: (eager golden only: its exact GEMMs run in float64)
    cached: torch.Tensor | None = None
    #: a row-parallel shard (compiler/parallel.py Comm.chain): its ranks add their K blocks' partials
    #: in rank order onto one fp32 accumulator, the adds one process makes; None in one process
    chain: Chain | None = None
    #: a column-parallel shard whose outputs every rank needs (the vocabulary-parallel head): the
    #: ranks' outputs put side by side (compiler/parallel.py); None in one process
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local_forward(x)
        return y if self.gather is None else self.gather(y)

    def local_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> this shard's output [..., out] (all of it in one process)."""
        if NUMERICS.gemm_order == "kernel":
            return self.kernel_forward(x)
        if self.chain is not None:
            return self.chained_forward(x)
        if self.kind in ("fp8", "fp4"):
            w = self.cached if self.cached is not None else self.dequantized()
            return fp8_linear(x, w, self.block, NUMERICS.gemm_order)
        w = self.cached if self.cached is not None else self.weight
        if self.kind == "bf16":
            # BF16_GEMM: exact fp32 products, fp32 sum, one bf16 rounding
            return linear_fp32(x.to(torch.bfloat16).float(), w, NUMERICS.gemm_order).to(torch.bfloat16)
        return linear_fp32(x.float(), w, NUMERICS.gemm_order)

    def chained_forward(self, x: torch.Tensor) -> torch.Tensor:
        """forward of a row-parallel FP8/FP4 shard in order "ascending": this rank's block partials
        (quant.block_partials) added onto the previous ranks' sum by `chain`, then the one bf16
        rounding: bit-identical to the unsharded forward."""
        if self.kind not in ("fp8", "fp4") or NUMERICS.gemm_order != "ascending":
            raise NotImplementedError(f"a row-parallel {self.kind} linear in GEMM order {NUMERICS.gemm_order!r}")
        w = self.cached if self.cached is not None else self.dequantized()
        partials = block_partials(fp8_activation(x, self.block), w, self.block)
        zero = partials.new_zeros(partials.shape[1:])
        return self.chain(lambda acc: add_blocks(acc, partials), zero).to(torch.bfloat16)


    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """forward through the cpu kernel on the prepared weight: the same activation (FP8 QDQ,
        bf16 or fp32 values) and output dtype as the other orders."""
        if self.kind in ("fp8", "fp4"):
            a = kernel_fp8_activation(x, self.block)
            if self.chain is not None:  # a row-parallel shard continues the previous ranks' block sums
                zero = a.new_zeros(*a.shape[:-1], self.out_features)
                y = self.chain(lambda acc: kernel_gemm(a, self, "", self.kind, self.out_features, acc), zero)
            else:
                y = kernel_gemm(a, self, "", self.kind, self.out_features)
        else:
            if self.chain is not None:
                raise NotImplementedError(f"a row-parallel {self.kind} linear")
            a = x.to(torch.bfloat16).float() if self.kind == "bf16" else x.float()
            y = kernel_gemm(a, self, "", _plain_fmt(self, ""), self.out_features)
        return y if self.kind == "fp32" else y.to(torch.bfloat16)


class RMSNorm(nn.Module):
    """y = (w * x * rsqrt(mean(x^2) + eps)) in fp32, cast back to x.dtype (model.py RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the cpu target: ATen's own mean of squares, as the golden's (kernels_nki/rms_norm.py)
        mean_sq = kernel_mean_square if NUMERICS.gemm_order == "kernel" else mean_square
        return rms_norm(x, self.weight, self.eps, mean_sq)


# ----------------------------------------------------------------------------------------- rope
def rope_tables(cfg: ModelConfig, max_seq_len: int, compressed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [max_seq_len, rd/2] of one layer kind (model.py precompute_freqs_cis).

    compressed=True: layers with compress ratio > 0 use compress_rope_theta with YaRN
    (original_seq_len, rope_factor, beta_fast, beta_slow); ratio-0 layers use rope_theta, no YaRN.
    """
    rd = cfg.rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    orig = cfg.original_seq_len if compressed else 0
    freqs = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    if orig > 0:
        def corrected_dim(rotations: float) -> float:
            return rd * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(cfg.beta_fast)), 0)
        high = min(math.ceil(corrected_dim(cfg.beta_slow)), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    angle = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    # torch.polar, as the reference builds freqs_cis: its cos/sin differ from torch.cos/torch.sin
    # in the last fp32 bit on ~5% of the entries, which moved 16 of 4.6M bf16 elements of the
    # inverse RoPE on tiny's prompts; with the polar tables none (see "RoPE" in the module docstring)
    rot = torch.polar(torch.ones_like(angle), angle)
    return rot.real.contiguous(), rot.imag.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last rd dims of x (bf16 [B, S, rd] or [B, S, H, rd]) as interleaved pairs.

    cos/sin: fp32 [B, S, rd/2] (per-row positions). Pairs (x[2i], x[2i+1]) are complex numbers
    multiplied by exp(i*angle) (conjugate when inverse) in fp32, written back in x.dtype
    (model.py apply_rotary_emb).
    """
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if inverse:
        sin = -sin
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


def with_rope_tail(x: torch.Tensor, rd: int, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x with RoPE applied to its last rd dims only (functional form of the reference's in-place op)."""
    return torch.cat([x[..., :-rd], apply_rope(x[..., -rd:], cos, sin, inverse)], dim=-1)


# ----------------------------------------------------------------------------------------- top-k
def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] (int64) of the k largest scores along the last dim, best first.

    Tie rule: among equal scores the lower index wins (stable descending sort). Used for every
    selection in the model so that all targets agree on ties.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


# ----------------------------------------------------------------------------------------- mHC
def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float):
    """Split mixes fp32 [B, S, (2+hc)*hc] into pre [B,S,hc], post [B,S,hc], comb [B,S,hc,hc].

    pre = sigmoid(.) + eps; post = 2*sigmoid(.); comb = exp(c - max) / sum over its last dim + eps
    (the kernel's softmax: exp of the max-shifted value divided by the row sum, which torch.softmax
    rounds differently in about 60% of the entries), then column-normalised, then iters-1 rounds of
    row- then column-normalisation, all fp32 (reference/deepseek_v4_arch.md section 2,
    hc_split_sinkhorn; official kernel.py hc_split_sinkhorn_kernel).
    """
    pre = row_sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * row_sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)

    def more(i: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return i < iters - 1

    def normalise(i: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        return i + 1, c / (c.sum(dim=-2, keepdim=True) + eps)

    if SPELLING.neuron:  # torch-mlir lowers no loop op to StableHLO (torch.prim.Loop): unrolled
        for i in range(iters - 1):
            _, comb = normalise(i, comb)
        return pre, post, comb
    # a loop op, not an unrolled Python loop: the rounds would be a fifth of the exported graph's
    # nodes, and the compile time grows with the node count
    _, comb = while_loop(more, normalise, (torch.zeros((), dtype=torch.int64), comb))
    return pre, post, comb


def hc_pre(x: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
    """Collapse the hc copies: x bf16 [B,S,hc,D], pre_mix fp32 [B,S,hc] -> bf16 [B,S,D] (Block.hc_pre)."""
    return torch.sum(pre_mix.unsqueeze(-1) * x.float(), dim=2).to(x.dtype)


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand: out[j] = post[j]*f + sum_i comb[i,j]*residual[i], fp32 math, bf16 out (Block.hc_post).

    f bf16 [B,S,D], residual bf16 [B,S,hc,D], post [B,S,hc], comb [B,S,hc,hc] -> bf16 [B,S,hc,D].
    """
    y = post.unsqueeze(-1) * f.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=2)
    return y.to(f.dtype)


# ----------------------------------------------------------------------------------------- call context
@dataclass
class StepInputs:
    """What one call knows about its tokens, shared by every layer.

    prefill: pos is None, valid_len [B] int64 (tokens at >= valid_len are right padding);
    decode: S == 1, pos [B] int64 the position of each row's token, valid_len is None;
    chunk (a prefill continuing from state, `chunk`): pos [B] int64 the position of each row's
    first token, valid_len [B] int64 its tokens in this call (1..S, right padding after).
    rope: cos/sin fp32 [B, S, rd/2] of both layer kinds (False: ratio 0, True: compressed) at the
    tokens' positions; tables: the full [max_seq_len, rd/2] tables, for compressed-group positions.
    """

    seqlen: int
    valid_len: torch.Tensor | None
    pos: torch.Tensor | None
    rope: dict[bool, tuple[torch.Tensor, torch.Tensor]]
    tables: dict[bool, tuple[torch.Tensor, torch.Tensor]]
    capture: Capture | None = None

    def rope_at(self, positions: torch.Tensor, compressed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin fp32 [..., rd/2] at int64 positions of any shape."""
        cos, sin = self.tables[compressed]
        return cos[positions], sin[positions]

    @property
    def prefill(self) -> bool:
        return self.pos is None

    @property
    def chunk(self) -> bool:
        """A chunk: tokens at positions pos .. pos + valid_len - 1 read and extend the state as
        that many decode steps in order would (graphs/steps.py prefill_chunk)."""
        return self.pos is not None and self.valid_len is not None


def step_inputs(owner: nn.Module, seqlen: int, positions: torch.Tensor, valid_len: torch.Tensor | None,
                pos: torch.Tensor | None, capture: Capture | None = None) -> StepInputs:
    """The per-call context for tokens at int64 positions [B,S], with the RoPE tables held by
    `owner` as buffers rope_cos_0/1, rope_sin_0/1 (the Transformer, or a stage module)."""
    tables = {c: (getattr(owner, f"rope_cos_{int(c)}"), getattr(owner, f"rope_sin_{int(c)}")) for c in (False, True)}
    rope = {c: (cos[positions], sin[positions]) for c, (cos, sin) in tables.items()}
    return StepInputs(seqlen, valid_len, pos, rope, tables, capture)


# ----------------------------------------------------------------------------------------- chunks
def newest_positions(start: torch.Tensor, count: torch.Tensor, n: int) -> torch.Tensor:
    """The ring of n slots after positions start .. start+count-1 were written in order (slot =
    position % n): int64 [B, n], slot j's newest position t < start + count with t % n == j
    (negative where no position ever reached slot j). start, count int64 [B]."""
    last = (start + count - 1).unsqueeze(1)  # [B,1]
    slots = torch.arange(n, device=start.device)
    return slots + n * torch.div(last - slots, n, rounding_mode="floor")


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slot0: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
    """cache [B,C,X] with rows [B,G,X] written at slots slot0[b] + j (int64 [B]) where write [B,G]
    is True, the other slots as they were. A where over the cache (row j's slot computed per cache
    slot), so rows past the cache or not written never collide with a written one."""
    B, C, X = cache.shape
    G = rows.size(1)
    j = torch.arange(C, device=cache.device).unsqueeze(0) - slot0.unsqueeze(1)  # [B,C]: the row landing in slot c
    inside = (j >= 0) & (j < G)
    jc = j.clamp(0, G - 1)
    take = inside & write.gather(1, jc)
    return torch.where(take.unsqueeze(-1), rows.gather(1, jc.unsqueeze(-1).expand(B, C, X)), cache)


# ----------------------------------------------------------------------------------------- attention
class Compressor(nn.Module):
    """KV compression of a kv-source layer (model.py Compressor): ratio r > 1 pools r consecutive
    tokens with a per-feature softmax gate in fp32; ratio 1 is a plain bf16 projection. Output is
    the pre-RoPE latent, RMS-normed in bf16."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        # ratio > 1 pools in fp32, so the reference promotes these bf16 checkpoint weights to fp32
        kind = "fp32" if ratio > 1 else "bf16"
        self.wkv = Linear(cfg.dim, cfg.head_dim, kind)
        if ratio > 1:
            self.wgate = Linear(cfg.dim, cfg.head_dim, kind)
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def prefill(self, x: torch.Tensor, valid_len: torch.Tensor, kv_state: torch.Tensor | None, score_state: torch.Tensor | None):
        """x bf16 [B,S,D] -> (latent bf16 [B, S//r, hd], kv_state', score_state' fp32 [B,r,hd] or None).

        Groups j < valid_len//r are real. The state ends as valid_len decode steps leave it: slot s
        holds the newest position t < valid_len with t % r == s (the trailing partial group, then
        the tokens of the last complete group, dead until overwritten), fresh (0 / -inf) where no
        position reached it; so a prefill's state is the decode steps' bit for bit (a prefix
        snapshot continued by decode steps or a chunk equals the longer prefill).
        """
        r = self.ratio
        if r == 1:
            return self.norm(self.wkv(x)), None, None
        B, S, _ = x.shape
        xf = x.float()
        kv, score = self.wkv(xf), self.wgate(xf)
        G = S // r
        pooled = (kv[:, :G * r].unflatten(1, (G, r)) * score[:, :G * r].unflatten(1, (G, r)).softmax(dim=2)).sum(dim=2)
        latent = self.norm(pooled.to(x.dtype))
        src = newest_positions(torch.zeros_like(valid_len), valid_len, r)  # [B, r]
        live = (src >= 0).unsqueeze(-1)
        gather = src.clamp(0, S - 1).unsqueeze(-1).expand(B, r, kv.size(-1))
        kv_state = torch.where(live, kv.gather(1, gather), kv_state)
        score_state = torch.where(live, score.gather(1, gather), score_state)
        return latent, kv_state, score_state

    def chunk(self, x: torch.Tensor, start: torch.Tensor, count: torch.Tensor, kv_state: torch.Tensor | None,
              score_state: torch.Tensor | None):
        """A chunk's tokens x bf16 [B,S,D] at positions start .. start+count-1 (int64 [B] each) ->
        (latent bf16 [B,G,hd], first group g0 int64 [B], write bool [B,G], kv_state', score_state').

        Row j of the latent is group g0 + j, the groups whose last token falls in the chunk
        (g0 = start // r), real where `write`. Each pools the r slots `decode` would hold when it
        completes: the pending partial group's slots from the state for positions before start,
        the chunk's rows after, with decode's softmax; the state ends as decode leaves it (slot s
        holds the newest position t with t % r == s). G = S // r + 1 (a chunk at any start), S for
        ratio 1."""
        r = self.ratio
        B, S, _ = x.shape
        if r == 1:
            return self.norm(self.wkv(x)), start, torch.arange(S, device=x.device) < count.unsqueeze(1), None, None
        xf = x.float()
        kv, score = self.wkv(xf), self.wgate(xf)  # [B,S,hd]
        hd = kv.size(-1)
        G = S // r + 1
        g0 = torch.div(start, r, rounding_mode="floor")
        # position of slot s of group g0 + j, [B,G,r], and where it comes from
        t = ((g0.unsqueeze(1) + torch.arange(G, device=x.device)) * r).unsqueeze(-1) + torch.arange(r, device=x.device)
        rel = t - start.view(B, 1, 1)
        fresh = (rel >= 0).unsqueeze(-1)
        take = rel.clamp(0, S - 1).flatten(1).unsqueeze(-1).expand(B, G * r, hd)

        def gathered(rows: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
            prev = old.unsqueeze(1).expand(B, G, r, hd)
            return torch.where(fresh, rows.gather(1, take).view(B, G, r, hd), prev)

        kv_g, score_g = gathered(kv, kv_state), gathered(score, score_state)
        pooled = (kv_g * score_g.softmax(dim=2)).sum(dim=2)
        latent = self.norm(pooled.to(x.dtype))
        write = (g0.unsqueeze(1) + torch.arange(G, device=x.device)) < torch.div(start + count, r, rounding_mode="floor").unsqueeze(1)
        # the slots as decode leaves them: the newest position of each, from the chunk where it is in it
        src = newest_positions(start, count, r)  # [B,r]
        new = (src >= start.unsqueeze(1)).unsqueeze(-1)
        idx = (src - start.unsqueeze(1)).clamp(0, S - 1).unsqueeze(-1).expand(B, r, hd)
        kv_state = torch.where(new, kv.gather(1, idx), kv_state)
        score_state = torch.where(new, score.gather(1, idx), score_state)
        return latent, g0, write, kv_state, score_state

    def decode(self, x: torch.Tensor, pos: torch.Tensor, kv_state: torch.Tensor | None, score_state: torch.Tensor | None):
        """x bf16 [B,1,D] -> (latent bf16 [B,1,hd], complete bool [B], kv_state', score_state').

        The latent is meaningful only where `complete` ((pos+1) % r == 0): the group just filled.
        """
        r = self.ratio
        if r == 1:
            return self.norm(self.wkv(x)), torch.ones_like(pos, dtype=torch.bool), None, None
        xf = x.float()
        kv, score = self.wkv(xf), self.wgate(xf)  # [B,1,hd]
        slot = (torch.arange(r, device=x.device) == (pos % r).unsqueeze(1)).unsqueeze(-1)  # [B,r,1]
        kv_state = torch.where(slot, kv, kv_state)
        score_state = torch.where(slot, score, score_state)
        pooled = (kv_state * score_state.softmax(dim=1)).sum(dim=1, keepdim=True)
        return self.norm(pooled.to(x.dtype)), (pos + 1) % r == 0, kv_state, score_state


class Indexer(nn.Module):
    """The lightning indexer of an index-source layer (model.py Indexer): FP4-QDQ'd query heads
    against one FP4 key per compressed position (the state's `index_k` bytes), scores `sum_h relu(q_h.k) * w_h` in bf16
    via `torch.ops.dsneuron.mqa_logits_bf16` (indexer mode "kernel": `fp4_index_scores`), causal
    mask, optional candidate-block filter, top-k."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg = cfg
        self.owns_k = layer_id in cfg.kv_source_layers
        self.is_candidate_source = layer_id == cfg.candidate_source_layer
        self.uses_candidates = 0 <= cfg.candidate_source_layer < layer_id
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, "fp8")
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads, "bf16")
        if self.owns_k:
            self.wk = Linear(cfg.head_dim, cfg.index_head_dim, "bf16")
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.norm_eps)

    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Index keys from the pre-RoPE latent [B,G,hd] at the groups' positions, as the cache rows
        that hold their FP4 QDQ (e2m1 x UE8M0 per 32): uint8 [B,G,ihd/2 + ihd/32]."""
        k = self.k_norm(self.wk(latent))
        k = with_rope_tail(k, self.cfg.rope_head_dim, cos, sin)
        return state_bytes(k, INDEX_K_FORMAT)

    def scores(self, x: torch.Tensor, qr: torch.Tensor, index_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """bf16 [B,S,T]: raw index scores of every query against every key slot of index_k, the
        cache rows uint8 [B,T,ihd/2 + ihd/32] (`keys`)."""
        cfg = self.cfg
        q = self.wq_b(qr).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
        q = with_rope_tail(q, cfg.rope_head_dim, cos, sin)
        q = fp4_qdq(q, 32, "ue8m0")
        w = self.weights_proj(x) * (cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)
        if NUMERICS.indexer == "kernel":
            return fp4_index_scores(q, index_k, w)
        k = state_values(index_k, cfg.index_head_dim, INDEX_K_FORMAT)
        return torch.ops.dsneuron.mqa_logits_bf16(q, k, w)


def fp4_index_scores(q: torch.Tensor, index_k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The indexer's scores through the FP4 MQA-logits op (indexer mode "kernel").

    q: [B,S,H,D] bf16 holding FP4-QDQ'd values (e2m1 times a UE8M0 scale per 32 elements);
    index_k: the cache rows uint8 [B,T,D/2 + D/32] (packed e2m1, then UE8M0 exponent bytes:
    `quant.INDEX_K_FORMAT`, the op's operand format); w: [B,S,H] bf16 head weights. Returns bf16 [B,S,T]: bf16(sum_h relu(q_h . k) * w_h)
    with the dot products and the head sum in fp32 (`torch.ops.dsneuron.mqa_logits`), where the
    official expression rounds each head's dot and product to bf16 (`mqa_logits_bf16`). The keys are
    the stored bytes; q is re-encoded as the bytes that hold it (`quant.fp4_operand_bytes`, exact);
    the batch becomes one
    row list over the batch's keys, each row's range [b*T, b*T + T) its own sequence's.
    Source: seeds/003 fp8_fp4_mqa_logits (DeepGEMM); DeepSeek-V4.1-Flash:inference/model.py Indexer.
    """
    B, S, H, D = q.shape
    T = index_k.shape[1]
    q_codes, q_sf = fp4_operand_bytes(q)
    n = INDEX_K_FORMAT.code_bytes(D)
    k_codes, k_sf = index_k[..., :n], index_k[..., n:]
    starts = (torch.arange(B * S, device=q.device) // S * T).to(torch.int32)
    logits = torch.ops.dsneuron.mqa_logits(q_codes.flatten(0, 1), q_sf.flatten(0, 1), k_codes.flatten(0, 1),
                                           k_sf.flatten(0, 1), w.flatten(0, 1), starts, starts + T, T)
    return logits.unflatten(0, (B, S))


def select_candidate_blocks(scores: torch.Tensor, compress_lens: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """Level one of the two-level top-k (model.py select_candidate_blocks): bool [..., T].

    scores [..., T] with unreachable positions already -inf; compress_lens broadcasts against the
    leading dims ([S,1] in prefill, [B,1,1] in decode). A block's score is its best position; the
    block holding position compress_len-1 is always kept; the best `topk_blocks` blocks with a finite
    score survive (ties: lower block first).
    """
    T = scores.size(-1)
    n_blocks = (T + block_size - 1) // block_size  # explicit, not unflatten(-1, ...): T may be symbolic
    padded = F.pad(scores.float(), (0, n_blocks * block_size - T), value=-math.inf)
    block = padded.unflatten(-1, (n_blocks, block_size)).amax(dim=-1)
    last = (compress_lens - 1).div(block_size, rounding_mode="floor")
    block = block.masked_fill(torch.arange(n_blocks, device=scores.device) == last, math.inf)
    # -inf columns up to topk_blocks, so that the top-k width never depends on T (a graph with a
    # dynamic token count has no branch on it); a -inf pick is dropped, as an unreachable block is
    block = F.pad(block, (0, topk_blocks), value=-math.inf)
    top = stable_topk_indices(block, topk_blocks)
    keep = torch.zeros_like(block, dtype=torch.bool).scatter(-1, top, block.gather(-1, top) > -math.inf)
    return keep[..., :n_blocks].repeat_interleave(block_size, dim=-1)[..., :T]


class Attention(nn.Module):
    """Sparse MQA over one shared 512-wide latent: a sliding window of raw KV plus, on layers with
    compress ratio > 0, the top-k compressed positions chosen by the indexer (model.py Attention)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.ratio = cfg.compress_ratios[layer_id]
        self.is_kv_source = layer_id in cfg.kv_source_layers
        self.is_index_source = layer_id in cfg.index_source_layers
        d, hd = cfg.dim, cfg.head_dim
        self.attn_sink = nn.Parameter(torch.empty(cfg.n_heads, dtype=torch.float32), requires_grad=False)
        self.wq_a = Linear(d, cfg.q_lora_rank, "fp8")
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.n_heads * hd, "fp8")
        self.wkv = Linear(d, hd, "fp8")
        self.kv_norm = RMSNorm(hd, cfg.norm_eps)
        # convert.py dequantises wo_a to bf16; the einsum runs in bf16 without activation quantisation
        self.wo_a = Linear(cfg.n_heads * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, "bf16")
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, d, "fp8")
        if self.is_kv_source:
            self.compressor = Compressor(cfg, self.ratio)
        if self.is_index_source:
            self.indexer = Indexer(cfg, layer_id)

    # -------------------------------------------------------------- window
    def _window(self, kv: torch.Tensor, kv_raw: torch.Tensor, ctx: StepInputs, state: dict, new: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes this layer's ring (the rows of kv_raw [B,S,hd], before its FP8 QDQ, as bytes) and
        returns (keys bf16 [B,N,hd], window index list int32 [B,S,W]); kv is kv_raw's QDQ."""
        B, S, hd = kv.shape
        W = self.cfg.window_size
        fmt = window_format(self.cfg.fp8_block_size)
        name = f"layers.{self.layer_id}.window_kv"
        slots = torch.arange(W, device=kv.device)
        if ctx.prefill:
            # slot j holds the newest real position p < valid_len with p % W == j
            last = ctx.valid_len.unsqueeze(1) - 1  # [B,1]
            src = slots + W * torch.div(last - slots, W, rounding_mode="floor")
            live = (src >= 0).unsqueeze(-1)
            ring = state_bytes(kv_raw.gather(1, src.clamp(0, S - 1).unsqueeze(-1).expand(B, W, hd)), fmt)
            new[name] = torch.where(live, ring, torch.zeros_like(ring))
            # query i's slot j holds position i-W+1+j (-1 before position 0): decode's list at
            # position i, over this call's rows (the model docstring: one layout everywhere)
            q_pos = torch.arange(S, device=kv.device).unsqueeze(1)
            idx = q_pos - W + 1 + slots
            idx = torch.where(idx < 0, -1, idx)
            return kv, idx.to(torch.int32).unsqueeze(0).expand(B, S, W)
        if ctx.chunk:
            return self._window_chunk(kv, kv_raw, ctx, state, new)
        # the new row decodes to kv, the others to what they held: the ring's values stay exact
        ring = write_slot(state[name], state_bytes(kv_raw, fmt), ctx.pos % W)
        new[name] = ring
        ring = state_values(ring, hd, fmt)
        # the whole ring, oldest first: slot j of the list holds position p-W+1+j, at ring slot
        # (p+1+j) % W; positions before 0 (ring still filling) are -1
        p = ctx.pos.unsqueeze(1)
        idx = (p % W + 1 + slots) % W
        idx = torch.where(idx > p, -1, idx)
        return ring, idx.to(torch.int32).unsqueeze(1)

    def _window_chunk(self, kv, kv_raw, ctx: StepInputs, state: dict, new: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The window of a chunk at positions p = ctx.pos .. p + valid_len - 1: keys bf16 [B, W+S, hd]
        (the ring as it was, holding positions p-W .. p-1 at slot position % W, then this call's
        rows) and index list int32 [B,S,W], query p+i seeing positions p+i-W+1 .. p+i oldest first
        with -1 before position 0: decode's list at that position, over the same values. The ring
        is left as the decode steps leave it."""
        B, S, hd = kv.shape
        W = self.cfg.window_size
        fmt = window_format(self.cfg.fp8_block_size)
        name = f"layers.{self.layer_id}.window_kv"
        p = ctx.pos.view(B, 1, 1)
        t = p + torch.arange(S, device=kv.device).view(1, S, 1) - (W - 1) + torch.arange(W, device=kv.device)  # [B,S,W]
        idx = torch.where(t < 0, -1, torch.where(t < p, t % W, W + t - p))
        old = state[name]
        src = newest_positions(ctx.pos, ctx.valid_len, W)  # [B,W]
        fresh = (src >= ctx.pos.unsqueeze(1)).unsqueeze(-1)
        rows = kv_raw.gather(1, (src - ctx.pos.unsqueeze(1)).clamp(0, S - 1).unsqueeze(-1).expand(B, W, hd))
        new[name] = torch.where(fresh, state_bytes(rows, fmt), old)
        return torch.cat([state_values(old, hd, fmt), kv], dim=1), idx.to(torch.int32)

    # -------------------------------------------------------------- compressed
    def _compressed(self, x, qr, ctx: StepInputs, offset: int, state: dict, new: dict, shared: dict):
        """Returns (compressed keys, their index list int32 [B,S,index_topk], offset by `offset`, -1
        for none): for a prefill or chunk every compressed row [B,T,hd]; for a decode step only the
        rows its index list picks [B,index_topk,hd], the list then numbering them in order."""
        cfg, r, L = self.cfg, self.ratio, self.layer_id
        cap = ctx.capture
        B, S, _ = x.shape
        cos, sin = ctx.rope[True]
        if self.is_kv_source:
            ckv_name, ik_name = f"layers.{L}.compress_kv", f"layers.{L}.index_k"
            ks_name, ss_name = f"layers.{L}.kv_state", f"layers.{L}.score_state"
            g0 = None  # a chunk's first group: its rows go to slots g0 + j
            if ctx.prefill:
                latent, kvs, scs = self.compressor.prefill(x, ctx.valid_len, state.get(ks_name), state.get(ss_name))
                G = latent.size(1)
                j = torch.arange(G, device=x.device)
                write = j.unsqueeze(0) < (ctx.valid_len // r).unsqueeze(1)  # [B,G] real groups only
                gcos, gsin = ctx.rope_at((j * r).expand(B, G), True)
            elif ctx.chunk:
                latent, g0, write, kvs, scs = self.compressor.chunk(x, ctx.pos, ctx.valid_len, state.get(ks_name),
                                                                    state.get(ss_name))
                g = g0.unsqueeze(1) + torch.arange(latent.size(1), device=x.device)  # [B,G]
                # a group past the context (padding) takes the last table row; it is never written
                gcos, gsin = ctx.rope_at((g * r).clamp(max=ctx.tables[True][0].size(0) - 1), True)
            else:
                latent, complete, kvs, scs = self.compressor.decode(x, ctx.pos, state.get(ks_name), state.get(ss_name))
                write = complete.unsqueeze(1)  # [B,1]
                gcos, gsin = ctx.rope_at((ctx.pos // r * r).unsqueeze(1), True)
            if kvs is not None:
                new[ks_name], new[ss_name] = kvs, scs
            _cap(cap, f"layers.{L}.compressor.latent", latent)
            slot0 = None if ctx.prefill else ctx.pos // r

            def put(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
                if g0 is not None:
                    return write_rows(cache, rows, g0, write)
                return self._write(cache, rows, write, slot0)
            # the indexer needs the latent before RoPE, so its keys are made first (model.py _compress_kv)
            if self.is_index_source:
                k = self.indexer.keys(latent, gcos, gsin)
                new[ik_name] = put(state[ik_name], k)
                shared["index_k"] = new[ik_name]
            latent = with_rope_tail(latent, cfg.rope_head_dim, gcos, gsin)
            # compressed KV: FP4 e2m1 with one e4m3 scale per 16 channels (model.py _compress_kv),
            # stored as those bytes
            rows = state_bytes(latent, COMPRESS_KV_FORMAT)
            if cap is not None:
                _cap(cap, f"layers.{L}.compress_kv.entry", state_values(rows, cfg.head_dim, COMPRESS_KV_FORMAT))
            new[ckv_name] = put(state[ckv_name], rows)
            shared["compress_kv"] = new[ckv_name]
        T = S // r if ctx.prefill else shared["compress_kv"].size(1)
        if self.is_index_source:
            idx = self._select(x, qr, ctx, T, offset, shared)
            shared["topk_idxs"] = idx
        idx = shared["topk_idxs"]
        if ctx.prefill or ctx.chunk:
            return state_values(leading(shared["compress_kv"], T), cfg.head_dim, COMPRESS_KV_FORMAT), idx
        # a decode step attends to index_topk of the T cache rows: it decodes just those (the same
        # values, in the same order), so its cost does not grow with the context
        B, _, K = idx.shape
        rows = shared["compress_kv"].gather(1, (idx.view(B, K, 1).long() - offset).clamp(min=0).expand(
            B, K, shared["compress_kv"].size(2)))
        picked = torch.where(idx < 0, idx, offset + torch.arange(K, device=x.device, dtype=idx.dtype))
        return state_values(rows, cfg.head_dim, COMPRESS_KV_FORMAT), picked

    @staticmethod
    def _write(cache: torch.Tensor, rows: torch.Tensor, write: torch.Tensor, slot0: torch.Tensor | None) -> torch.Tensor:
        """cache [B,C,X] with rows [B,G,X] written at slots 0..G-1 (prefill, slot0 None) or at slot0[B]
        (decode, G == 1), only where write [B,G] is True."""
        B, C, X = cache.shape
        if slot0 is None:
            G = rows.size(1)
            fresh = torch.where(write.unsqueeze(-1), rows, leading(cache, G))
            # index_copy, not a cat with cache[:, G:]: that slice is empty when the prompt fills the
            # cache, and a graph with a dynamic token count must not depend on it being empty
            return cache.index_copy(1, torch.arange(G, device=cache.device), fresh)
        keep = write & (slot0 < C).unsqueeze(1)  # [B,1]: a slot past the cache writes nothing
        slot = slot0.clamp(max=C - 1)
        return write_slot(cache, torch.where(keep.unsqueeze(-1), rows, cache.gather(1, slot_index(slot, X))), slot)

    def _select(self, x, qr, ctx: StepInputs, T: int, offset: int, shared: dict) -> torch.Tensor:
        """Top-k compressed positions per query, sorted ascending, +offset, -1 where unreachable."""
        cfg, r, L = self.cfg, self.ratio, self.layer_id
        cap = ctx.capture
        cos, sin = ctx.rope[True]
        index_k = leading(shared["index_k"], T)
        scores = self.indexer.scores(x, qr, index_k, cos, sin)  # bf16 [B,S,T]
        _cap(cap, f"layers.{L}.indexer.scores", scores)
        t = torch.arange(T, device=x.device)
        if ctx.prefill:
            compress_lens = (torch.arange(1, ctx.seqlen + 1, device=x.device) // r).unsqueeze(-1)  # [S,1]
        elif ctx.chunk:  # query i at position pos + i, as its decode step
            q_pos = ctx.pos.view(-1, 1, 1) + torch.arange(ctx.seqlen, device=x.device).view(1, -1, 1)
            compress_lens = torch.div(q_pos + 1, r, rounding_mode="floor")  # [B,S,1]
        else:
            compress_lens = ((ctx.pos + 1) // r).view(-1, 1, 1)  # [B,1,1]
        scores = scores.masked_fill(t >= compress_lens, -math.inf)
        if self.indexer.is_candidate_source:
            shared["candidates"] = select_candidate_blocks(scores, compress_lens, cfg.candidate_topk_blocks, cfg.candidate_block_size)
            _cap(cap, f"layers.{L}.indexer.candidates", shared["candidates"])
        elif self.indexer.uses_candidates:
            scores = scores.masked_fill(~shared["candidates"], -math.inf)
        # -inf columns up to index_topk keep the top-k width static (as in select_candidate_blocks):
        # a pick at or past compress_len (unreachable, or padding) becomes -1
        scores = F.pad(scores, (0, cfg.index_topk), value=-math.inf)
        idx = stable_topk_indices(scores, cfg.index_topk).sort(dim=-1).values
        idx = torch.where(idx < compress_lens, idx + offset, -1)
        _cap(cap, f"layers.{L}.indexer.topk", idx)
        return idx.to(torch.int32)

    # -------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, ctx: StepInputs, state: dict, new: dict, shared: dict) -> torch.Tensor:
        """x bf16 [B,S,D] (after attn_norm) -> bf16 [B,S,D]; writes this layer's state into `new`."""
        cfg, L = self.cfg, self.layer_id
        B, S, _ = x.shape
        rd, hd = cfg.rope_head_dim, cfg.head_dim
        cos, sin = ctx.rope[self.ratio > 0]
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (cfg.n_heads, hd))
        q = with_rope_tail(q, rd, cos, sin)
        kv = self.kv_norm(self.wkv(x))
        kv_raw = with_rope_tail(kv, rd, cos, sin)
        # window KV: FP8 over the whole post-RoPE vector, RoPE tail included (model.py _window_kv)
        kv = fp8_qdq(kv_raw, cfg.fp8_block_size)
        _cap(ctx.capture, f"layers.{L}.attn.window_kv", kv)
        keys, idx = self._window(kv, kv_raw, ctx, state, new)
        if self.ratio:
            ckv, cidx = self._compressed(x, qr, ctx, keys.size(1), state, new, shared)
            keys = torch.cat([keys, ckv], dim=1)
            # the compressed part at offset W in every step kind: each index keeps its 64-key
            # block of the online softmax whatever the prompt length (the model docstring)
            idx = torch.cat([idx.expand(B, S, -1), cidx], dim=-1)
        _cap(ctx.capture, f"layers.{L}.attn.idx", idx)
        if NUMERICS.gemm_order == "kernel":  # the cpu kernel: fixed fp32 order, its own exp (kernels_nki/cpu_attn.py)
            from dsneuron.kernels_nki import cpu_attn  # builds the kernels on first use
            o = cpu_attn.sparse_attn_cpu(q, keys, self.attn_sink, idx.contiguous(), hd ** -0.5)
        else:
            o = torch.ops.dsneuron.sparse_attn(q, keys, self.attn_sink, idx.contiguous(), hd ** -0.5)
        _cap(ctx.capture, f"layers.{L}.attn.core", o)
        return self.output(o, cos, sin)

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The output projection: attention result o bf16 [B,S,H,hd] -> bf16 [B,S,D] (inverse RoPE on
        the tail, grouped wo_a, wo_b), with this layer kind's cos/sin at the tokens' positions."""
        cfg = self.cfg
        B, S = o.shape[:2]
        o = with_rope_tail(o, cfg.rope_head_dim, cos, sin, inverse=True)
        # wo_a is block-diagonal over groups, hence the grouped einsum (model.py Attention.forward)
        o = o.view(B, S, cfg.o_groups, -1)
        if NUMERICS.gemm_order == "kernel":  # one grouped GEMM: the rows of group g against wo_a's block g
            G, rows = cfg.o_groups, B * S
            a = o.permute(2, 0, 1, 3).reshape(G * rows, -1).float()
            offsets = torch.arange(G + 1, device=o.device) * rows
            o = kernel_gemm_segments(a, offsets, self, "wo_a_", "bf16", cfg.o_lora_rank)
            o = o.view(G, B, S, -1).permute(1, 2, 0, 3)
        elif NUMERICS.gemm_order == "fused":
            wo_a = self.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)
            o = torch.einsum("bsgd,grd->bsgr", o.float(), wo_a.float())
        else:  # exact products, float64 sum (quant.exact_linear)
            wo_a = self.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)
            o = torch.einsum("bsgd,grd->bsgr", o.double(), wo_a.double()).float()
        o = o.to(torch.bfloat16)  # BF16_GEMM
        return self.wo_b(o.flatten(2))


# ----------------------------------------------------------------------------------------- MoE
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


class Expert(nn.Module):
    """SwiGLU FFN with the V4.1 clamps (up to [-limit, limit], gate to <= limit); the routing weight
    multiplies the fp32 activation before the bf16 cast and w2 (model.py Expert)."""

    def __init__(self, dim: int, inter: int, kind: str, swiglu_limit: float):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, inter, kind), Linear(inter, dim, kind), Linear(dim, inter, kind)
        self.limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.w2(h.to(x.dtype))


class Gate(nn.Module):
    """Router (model.py Gate): fp32 scores, score_func, bias for selection only, normalised top-k
    weights times route_scale. Returns (weights fp32 [N,k], indices int64 [N,k])."""

    def __init__(self, cfg: ModelConfig, n_experts: int, topk: int):
        super().__init__()
        self.cfg, self.topk = cfg, topk
        self.weight = nn.Parameter(torch.empty(n_experts, cfg.dim, dtype=torch.bfloat16), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if NUMERICS.gemm_order == "kernel":
            scores = kernel_gemm(x.float(), self, "", "bf16", self.bias.shape[0]) / cfg.gate_temp
        else:
            scores = linear_fp32(x.float(), self.weight.float(), NUMERICS.gemm_order) / cfg.gate_temp
        if cfg.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        elif cfg.score_func == "sigmoid":
            scores = row_sigmoid(scores)
        else:
            scores = ieee_sqrt(row_softplus(scores))
        indices = stable_topk_indices(scores + self.bias, self.topk)
        weights = scores.gather(1, indices)
        if cfg.norm_topk_prob and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.route_scale, indices


class MoE(nn.Module):
    """Routed experts (FP4) plus one shared expert (FP8), summed in fp32 in ascending expert order,
    shared expert last, one bf16 rounding (model.py MoE)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        n_exp, topk = cfg.moe_experts(layer_id)
        self.n_experts = n_exp
        self.gate = Gate(cfg, n_exp, topk)
        self.experts = nn.ModuleList([Expert(cfg.dim, cfg.moe_inter_dim, "fp4", cfg.swiglu_limit) for _ in range(n_exp)])
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, "fp8", cfg.swiglu_limit)
        #: the routed experts this process runs, and how ranks in turn add theirs onto one fp32 sum
        #: (ascending ids across the ranks, as one process adds them): an expert-parallel shard's
        #: (compiler/parallel.py Comm.chain), else all and None
        self.owned: range = range(n_exp)
        self.chain: Chain | None = None

    def forward(self, x: torch.Tensor, routed: bool = False, capture: Capture | None = None, prefix: str = "") -> torch.Tensor:
        """x bf16 [B,S,D] -> bf16 [B,S,D]. routed=True loops over the experts, each on its tokens
        (eager golden). routed=False has static shapes for export: when the call routes fewer
        (token, expert) pairs than there are experts (B*S*topk < E: decode), only those experts' weights
        are gathered and dequantised; otherwise every expert runs densely with zero weights."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, indices = self.gate(x)
        _cap(capture, f"{prefix}.gate.indices", indices.view(*shape[:-1], -1))
        _cap(capture, f"{prefix}.gate.weights", weights.view(*shape[:-1], -1))
        y = torch.zeros_like(x, dtype=torch.float32)
        if NUMERICS.gemm_order == "kernel" and not routed:
            y = self._kernel_experts(x, weights, indices)
        elif routed:
            def add_owned(y: torch.Tensor) -> torch.Tensor:
                for e in self.owned:
                    rows, slot = torch.where(indices == e)
                    if rows.numel():
                        y[rows] += self.experts[e](x[rows], weights[rows, slot, None])
                return y
            y = add_owned(y) if self.chain is None else self.chain(add_owned, y)
        elif self.chain is not None:
            raise NotImplementedError("an expert-parallel MoE runs the routed loop only (routed=True)")
        elif x.size(0) * self.gate.topk < self.n_experts:
            # each token's experts in ascending id order: the order the routed loop adds them in
            ids, perm = indices.sort(dim=-1)
            k = ids.size(1)
            out = self._experts(x.repeat_interleave(k, dim=0).unsqueeze(1), weights.gather(1, perm).reshape(-1, 1, 1),
                                ids.reshape(-1)).view(x.size(0), k, -1)  # bf16 [N, k, D]
            for j in range(k):
                y = y + out[:, j]
        else:
            dense = torch.zeros(x.size(0), self.n_experts, dtype=torch.float32, device=x.device).scatter(1, indices, weights)
            out = self._experts(x, dense.t().unsqueeze(-1))  # bf16 [E, N, D]
            for e in range(self.n_experts):
                y = y + out[e]
        y = y + self.shared_experts(x)
        return y.to(x.dtype).view(shape)

    def _kernel_experts(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The routed experts through the cpu kernels' grouped GEMM: every (token, expert) pair is a
        row, the rows sorted by expert, one GEMM call per projection; each token's expert outputs
        are then added in ascending expert id, as the routed loop adds them. x bf16 [N, D],
        weights fp32 [N, k], indices int64 [N, k] -> fp32 [N, D] (before the shared expert)."""
        N, k = indices.shape
        ids, perm = indices.sort(dim=-1)  # each token's experts in ascending id
        w = weights.gather(1, perm).reshape(-1)
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # [N*k] pairs grouped by expert
        lo, hi = self.owned.start, self.owned.stop
        offsets = torch.searchsorted(flat[order], torch.arange(lo, hi + 1, device=x.device))
        shard = (lo, hi) != (0, self.n_experts)
        if shard:  # an EP shard holds experts lo..hi-1: other ranks' rows run with its first or last expert, unused
            offsets = torch.cat([offsets.new_zeros(1), offsets[1:-1], offsets.new_full((1,), N * k)])
        a = kernel_fp8_activation(x, 32)[order // k]  # each row's token, QDQ'd as its expert's linear does
        ex = self.experts[lo]
        gate = kernel_gemm_segments(a, offsets, self, "experts_w1_", "fp4", ex.w1.out_features).to(x.dtype).float()
        up = kernel_gemm_segments(a, offsets, self, "experts_w3_", "fp4", ex.w3.out_features).to(x.dtype).float()
        if ex.limit > 0:
            up = up.clamp(-ex.limit, ex.limit)
            gate = gate.clamp(max=ex.limit)
        h = w[order].unsqueeze(-1) * (F.silu(gate) * up)
        out = kernel_gemm_segments(kernel_fp8_activation(h.to(x.dtype), 32), offsets, self, "experts_w2_", "fp4",
                                   ex.w2.out_features).to(x.dtype)
        out = torch.empty_like(out).index_copy(0, order, out).view(N, k, -1)  # back to (token, its j-th expert)

        def add_owned(y: torch.Tensor) -> torch.Tensor:
            for j in range(k):
                # another rank's expert adds +0, which leaves y as it is (y, a sum from +0, is never -0)
                y = y + (torch.where(((ids[:, j] >= lo) & (ids[:, j] < hi)).unsqueeze(-1), out[:, j], 0)
                         if shard else out[:, j])
            return y
        y = torch.zeros_like(x, dtype=torch.float32)
        return add_owned(y) if self.chain is None else self.chain(add_owned, y)

    def _stacked(self, which: str, ids: torch.Tensor | None) -> torch.Tensor:
        """fp32 [E', out, in]: the `which` (w1/w2/w3) projection of every routed expert (ids None,
        E' = E) or of the experts ids int64 [E'] (repeats allowed), dequantised from the stacked
        packed bytes after the gather (or taken from the golden's cached copies)."""
        lins = [getattr(ex, which) for ex in self.experts]
        if lins[0].cached is not None:
            w = torch.stack([lin.cached for lin in lins])
            return w if ids is None else w[ids]
        # stack the scale bytes as uint8: Inductor's cpu codegen has no e8m0 buffers
        codes = torch.stack([lin.weight for lin in lins])
        scales = torch.stack([as_uint8(lin.scale) for lin in lins])
        if ids is not None:
            codes, scales = codes[ids], scales[ids]
        return dequant_fp4_weight(codes, scales)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Expert.forward of a stack of experts at once: every routed expert on every token (ids
        None: x bf16 [N, D], weights fp32 [E, N, 1], 0 where not routed -> bf16 [E, N, D]), or
        expert ids[i] on its own rows (x bf16 [E', M, D], weights fp32 [E', M, 1] -> bf16 [E', M, D])."""
        order = NUMERICS.gemm_order
        gate = experts_linear(x, self._stacked("w1", ids), order=order).float()
        up = experts_linear(x, self._stacked("w3", ids), order=order).float()
        limit = self.experts[0].limit
        if limit > 0:
            up = up.clamp(-limit, limit)
            gate = gate.clamp(max=limit)
        h = weights * (F.silu(gate) * up)
        return experts_linear(h.to(x.dtype), self._stacked("w2", ids), order=order)


# ----------------------------------------------------------------------------------------- engram
class Engram(nn.Module):
    """N-gram memory written into the hc stream before the block (model.py Engram): FP8 table rows
    looked up by host-computed hash ids, dequantised per 1x32, projected to hc keys + one value,
    gated per (token, hc copy) by a signed-sqrt sigmoid of a normalised dot product."""

    def __init__(self, cfg: ModelConfig, num_embeddings: int):
        super().__init__()
        self.cfg = cfg
        n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.empty(num_embeddings, cfg.engram_head_dim, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.embed.scale = nn.Parameter(torch.empty(num_embeddings, cfg.engram_head_dim // 32, dtype=torch.float8_e8m0fnu), requires_grad=False)
        self.wkv = Linear(n_cols * cfg.engram_head_dim, cfg.dim * (cfg.hc_mult + 1), "fp8")
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim, dtype=torch.bfloat16), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim, dtype=torch.bfloat16), requires_grad=False)
        #: a row-parallel shard's input columns of wkv (compiler/parallel.py); None: all
        self.wkv_cols: slice | None = None

    def lookup(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """hash_ids int64 [B,S,C] -> bf16 [B,S,C*engram_head_dim] (ParallelEngramEmbedding.forward)."""
        rows = e4m3_to_float(as_uint8(self.embed.weight)[hash_ids])
        scales = as_uint8(self.embed.scale)[hash_ids]
        vals = rows.unflatten(-1, (-1, 32)) * ue8m0_to_float(scales).unsqueeze(-1)
        return vals.flatten(-2).to(torch.bfloat16).flatten(-2)

    def forward(self, h: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """h bf16 [B,S,hc,D], hash_ids int64 [B,S,C] -> bf16 [B,S,hc,D]."""
        cfg = self.cfg
        D, hc = cfg.dim, cfg.hc_mult
        rows = self.lookup(hash_ids)
        kv = self.wkv(rows if self.wkv_cols is None else rows[..., self.wkv_cols])
        key = kv[..., :hc * D].float().unflatten(-1, (hc, D))
        value = kv[..., hc * D:]
        weight = self.q_weight.float() * self.k_weight.float()
        hf = h.float()
        # normalised per (token, hc copy) over D, not jointly over the copies
        rstd = torch.rsqrt(hf.square().mean(-1) + cfg.norm_eps) * torch.rsqrt(key.square().mean(-1) + cfg.norm_eps)
        dot = (hf * weight * key).sum(-1) * rstd * D ** -0.5
        gate = row_sigmoid(torch.copysign(ieee_sqrt(dot.abs().clamp_min(1e-6)), dot))
        return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)


# ----------------------------------------------------------------------------------------- block / model
class Block(nn.Module):
    """One layer: mHC around attention and MoE with the lagged pre-mix (model.py Block.forward):
    attention collapses the stream with the previous sublayer's pre-mix, and each sublayer's own
    mixes supply the pre-mix of the next one."""

    def __init__(self, cfg: ModelConfig, layer_id: int, engram_rows: int | None):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.attn = Attention(cfg, layer_id)
        self.ffn = MoE(cfg, layer_id)
        self.engram = Engram(cfg, engram_rows) if engram_rows is not None else None
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        m, hcd = cfg.mix_hc, cfg.hc_mult * cfg.dim
        for s in ("attn", "ffn"):
            setattr(self, f"hc_{s}_fn", nn.Parameter(torch.empty(m, hcd, dtype=torch.float32), requires_grad=False))
            setattr(self, f"hc_{s}_base", nn.Parameter(torch.empty(m, dtype=torch.float32), requires_grad=False))
            setattr(self, f"hc_{s}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False))

    def hc_mixes(self, x: torch.Tensor, which: str):
        """x bf16 [B,S,hc,D] -> (pre, post, comb) from one projection of the RMS-normalised stream."""
        cfg = self.cfg
        xf = x.flatten(2).float()
        rsqrt = torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.norm_eps)
        if NUMERICS.gemm_order == "kernel":
            mixes = kernel_gemm(xf, self, f"hc_{which}_", "fp32", cfg.mix_hc) * rsqrt
        else:
            mixes = linear_fp32(xf, getattr(self, f"hc_{which}_fn"), NUMERICS.gemm_order) * rsqrt
        return hc_split_sinkhorn(mixes, getattr(self, f"hc_{which}_scale"), getattr(self, f"hc_{which}_base"),
                                 cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)

    def forward(self, x, pre_mix, ctx: StepInputs, state: dict, new: dict, shared: dict, routed: bool):
        """x bf16 [B,S,hc,D], pre_mix fp32 [B,S,hc] -> (x', ffn_pre [B,S,hc])."""
        x, attn_pre = self.attn_sublayer(x, pre_mix, ctx, state, new, shared)
        return self.ffn_sublayer(x, attn_pre, ctx.capture, routed)

    def attn_sublayer(self, x, pre_mix, ctx: StepInputs, state: dict, new: dict, shared: dict):
        """The attention half: x bf16 [B,S,hc,D], pre_mix fp32 [B,S,hc] -> (x', attn_pre [B,S,hc]),
        the stream after attention and the pre-mix the MoE half collapses it with."""
        cap, p = ctx.capture, f"layers.{self.layer_id}"
        residual = x
        attn_pre, attn_post, attn_comb = self.hc_mixes(x, "attn")
        _cap(cap, f"{p}.hc_attn.pre", attn_pre)
        _cap(cap, f"{p}.hc_attn.post", attn_post)
        _cap(cap, f"{p}.hc_attn.comb", attn_comb)
        y = self.attn_norm(hc_pre(x, pre_mix))
        _cap(cap, f"{p}.attn.in", y)
        y = self.attn(y, ctx, state, new, shared)
        _cap(cap, f"{p}.attn.out", y)
        return hc_post(y, residual, attn_post, attn_comb), attn_pre

    def ffn_sublayer(self, x, attn_pre, cap: Capture | None, routed: bool):
        """The MoE half: x bf16 [B,S,hc,D], attn_pre fp32 [B,S,hc] -> (x', ffn_pre [B,S,hc]). It
        reads no state and no position, so every layer with the same expert counts has the same
        structure here."""
        p = f"layers.{self.layer_id}"
        residual = x
        ffn_pre, ffn_post, ffn_comb = self.hc_mixes(x, "ffn")
        _cap(cap, f"{p}.hc_ffn.pre", ffn_pre)
        _cap(cap, f"{p}.hc_ffn.post", ffn_post)
        _cap(cap, f"{p}.hc_ffn.comb", ffn_comb)
        y = self.ffn_norm(hc_pre(x, attn_pre))
        _cap(cap, f"{p}.ffn.in", y)
        y = self.ffn(y, routed=routed, capture=cap, prefix=f"{p}.ffn")
        _cap(cap, f"{p}.ffn.out", y)
        x = hc_post(y, residual, ffn_post, ffn_comb)
        _cap(cap, f"{p}.out", x)
        return x, ffn_pre


class Transformer(nn.Module):
    """The V4.1 backbone: embed -> hc copies -> blocks (engram before its blocks) -> final pre-mix
    -> norm -> fp32 head at one position per row (model.py Transformer.forward, basic mode).

    Parameters are named as the checkpoint names them (`layers.3.attn.wq_a.weight`); DSpark stages
    (mtp.*) are validated by the loader and not built here. `max_seq_len` sizes the RoPE tables.
    """

    def __init__(self, cfg: ModelConfig, engram_num_embeddings: tuple[int, ...], max_seq_len: int):
        super().__init__()
        self.cfg, self.max_seq_len = cfg, max_seq_len
        rows = dict(zip(cfg.engram_layer_ids, engram_num_embeddings))
        # _weight: no random init of a table the checkpoint replaces (2.3 s for tiny's)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim, dtype=torch.bfloat16),
                                  _freeze=True)
        self.layers = nn.ModuleList([Block(cfg, i, rows.get(i)) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # bf16 in the checkpoint, held fp32 so the logits come out in fp32 (ParallelHead)
        self.head = Linear(cfg.dim, cfg.vocab_size, "fp32")
        for compressed in (False, True):
            cos, sin = rope_tables(cfg, max_seq_len, compressed)
            self.register_buffer(f"rope_cos_{int(compressed)}", cos, persistent=False)
            self.register_buffer(f"rope_sin_{int(compressed)}", sin, persistent=False)

    def cache_dequantized(self) -> None:
        """Keep a float64 copy of every linear's weight values (eager golden speed: its exact GEMMs
        run in float64; ~8x the bytes of an FP8 weight). The exported steps never call this: they
        dequantise in the graph from the stored bytes."""
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.cached = mod.dequantized().double()

    def inputs(self, seqlen: int, positions: torch.Tensor, valid_len: torch.Tensor | None, pos: torch.Tensor | None,
               capture: Capture | None = None) -> StepInputs:
        """The per-call context for tokens at int64 positions [B,S]."""
        return step_inputs(self, seqlen, positions, valid_len, pos, capture)

    def run(self, tokens: torch.Tensor, ctx: StepInputs, engram_ids: torch.Tensor | None, state: dict,
            last: torch.Tensor, routed: bool = False) -> tuple[torch.Tensor, dict]:
        """tokens int64 [B,S]; engram_ids int64 [B,S,E,C]; last int64 [B] the position (within this
        call) whose logits to return. Returns (logits fp32 [B,V], new state dict)."""
        new: dict[str, torch.Tensor] = {}
        shared: dict[str, torch.Tensor] = {}
        h, pre_mix = self.embed_stream(tokens)
        for i, layer in enumerate(self.layers):
            if layer.engram is not None:
                h = self.engram_at(i, h, engram_ids[:, :, self.cfg.engram_layer_ids.index(i)], ctx.capture)
            h, pre_mix = layer(h, pre_mix, ctx, state, new, shared, routed)
        return self.head_logits(h, pre_mix, last, ctx.capture), new

    def embed_stream(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens int64 [B,S] -> (hc stream, first pre-mix); see `embed_stream`."""
        return embed_stream(self.embed, self.cfg.hc_mult, tokens)

    def engram_at(self, layer: int, h: torch.Tensor, hash_ids: torch.Tensor, cap: Capture | None = None) -> torch.Tensor:
        """Layer `layer`'s engram on the stream h bf16 [B,S,hc,D] with its hash ids int64 [B,S,C]."""
        return engram_at(self.layers[layer].engram, layer, h, hash_ids, cap)

    def head_logits(self, h: torch.Tensor, pre_mix: torch.Tensor, last: torch.Tensor, cap: Capture | None = None) -> torch.Tensor:
        """Logits at position `last` of each row; see `head_logits`."""
        return head_logits(self.norm, self.head, h, pre_mix, last, cap)


def embed_stream(embed: nn.Embedding, hc: int, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens int64 [B,S] -> the hc stream bf16 [B,S,hc,D] (hc copies of the embedding) and the
    first pre-mix fp32 [B,S,hc] (one-hot on copy 0: block 0 collapses the stream to copy 0)."""
    B, S = tokens.shape
    h = embed(tokens)
    if NUMERICS.nudge_embedding:
        h = torch.nextafter(h, torch.full_like(h, math.inf))
    h = h.unsqueeze(2).repeat(1, 1, hc, 1)
    # creation ops only: AOTAutograd traces an in-place write (`pre_mix[..., 0] = 1`), and export a
    # contiguous() of an expanded tensor, assuming S >= 2, and the executable serves S = 1 too
    ones = torch.ones(B, S, 1, dtype=torch.float32, device=tokens.device)
    return h, torch.cat([ones, torch.zeros(B, S, hc - 1, dtype=torch.float32, device=tokens.device)], -1)


def engram_at(engram: Engram, layer: int, h: torch.Tensor, hash_ids: torch.Tensor, cap: Capture | None = None) -> torch.Tensor:
    """Layer `layer`'s engram on the stream h bf16 [B,S,hc,D] with its hash ids int64 [B,S,C]."""
    _cap(cap, f"layers.{layer}.engram.in", h)
    h = engram(h, hash_ids)
    _cap(cap, f"layers.{layer}.engram.out", h)
    return h


def head_logits(norm: RMSNorm, head: Linear, h: torch.Tensor, pre_mix: torch.Tensor, last: torch.Tensor,
                cap: Capture | None = None) -> torch.Tensor:
    """The final pre-mix, norm and fp32 head at position last int64 [B] of each row of the stream
    h bf16 [B,S,hc,D] (pre_mix fp32 [B,S,hc]) -> logits fp32 [B,V] (model.py Transformer.forward)."""
    B = h.size(0)
    gather = last.view(B, 1, 1, 1).expand(B, 1, h.size(2), h.size(3))
    h_last = h.gather(1, gather)
    mix_last = pre_mix.gather(1, last.view(B, 1, 1).expand(B, 1, pre_mix.size(2)))
    y = norm(hc_pre(h_last, mix_last))[:, 0]
    _cap(cap, "final.norm", y)
    logits = head(y.float())
    _cap(cap, "final.logits", logits)
    return logits
