"""DeepSeek-V4.1-Flash (basic mode) as explicit-state step functions: the eager golden model and the
graphs that `torch.export` traces per bucket are this one implementation.

Numerics follow the official inference code, deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py
(revision dba1be0a, cited below as `model.py <Class.method>`), with its kernels (act_quant,
fp4_act_quant, fp8_gemm/fp4_gemm, sparse_attn, hc_split_sinkhorn) in the same repository's
inference/kernel.py. The numerics switches, the roundings that differ
from the reference on purpose and the size-independent element-wise ops are in graphs/numerics.py,
the choice between reference expressions and the cpu kernels in graphs/dispatch.py, RoPE in
graphs/rope.py, mHC in graphs/mhc.py. Where this module's structure differs on purpose it says so:

- Static shapes. The reference slices caches to the live length and asks top-k for
  `min(index_topk, compress_len)`; here every tensor has its bucket shape, unreachable positions are
  masked to -inf and unused index slots are -1. Trailing -1 slots are exactly neutral in the online
  softmax.
- One index-list layout for prefill, decode and chunk, unlike the reference's prefill. A query at
  position i sees W window slots, slot j holding position i-W+1+j (-1 before position 0), then
  the compressed part at offset W. The reference's prefill list (get_window_topk_idxs) is min(L, W)
  wide, so its compressed keys start at min(L, W) in prefill but at W in decode: the same key set
  in other 64-key blocks of the online softmax (`sparse_attn`), equal up to the blocks' rounding
  (tiny, W = 128: prefill row i differed from decode at i in low bits). With one layout, prefill
  row i is bit-identical to a decode step at i and to row i of a prefill of any other length, as
  a prefix cache and a speculative verify need, and a padded prompt runs like the unpadded one.
- Per-row positions. A batch may mix prompt lengths (prefill `valid_len[B]`) and decode positions
  (`pos[B]`); ring slots, compressor completion and cache writes are selected per row with masks.
- The MoE of the exported steps has static shapes. A prefill or chunk groups its (token, expert)
  pairs by expert into fixed-size blocks, one gathered expert per block (graphs/moe_blocks.py:
  at most 1.25x the routed rows whatever the routing), unless every expert on every token (weight
  0 where not routed) computes no more rows; a decode step (tokens * topk < experts) gathers the
  packed weights of each token's topk experts. Each token's experts are added in ascending id
  order, as the reference's routed loop, which the eager golden uses (`MoE.forward(routed=True)`),
  does; an added exact 0 leaves the fp32 sum unchanged.
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
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import dsneuron.kernels_nki  # noqa: F401  registers torch.ops.dsneuron.*
from dsneuron.kernels_nki.formats import as_uint8, e4m3_to_float, ue8m0_to_float
from dsneuron.kernels_nki.rms_norm import mean_square, rms_norm

from .cache_rows import leading, newest_positions, write_groups, write_rows, write_slot
from .config import ModelConfig
from .context import Capture, StepInputs, record, step_inputs
from .dispatch import (fp4_index_scores, fp4_qdq, fp8_qdq, grouped_gemm, kernel_experts, kernel_fp8_activation, kernel_gemm,
                       kernel_mean_square, official_index_scores, plain_fmt, sparse_attn, state_bytes, state_values)
from .mhc import hc_post, hc_pre, hc_split_sinkhorn
from .moe_blocks import block_groups, route_blocks, use_blocks
from .numerics import NUMERICS, ieee_sqrt, row_sigmoid, row_softplus, stable_topk_indices
from .quant import (COMPRESS_KV_FORMAT, INDEX_K_FORMAT, add_blocks, block_partials, dequant_fp4_weight, dequant_fp8_weight,
                    experts_linear, fp8_activation, fp8_linear, linear_fp32, window_format)
from .rope import rope_tables, with_rope_tail


#: a sharded sum's hook (compiler/parallel.py Comm.chain): chain(add, zero) runs add on the previous
#: ranks' fp32 sum (zero on rank 0) and returns the last rank's
Chain = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------------- modules
class Linear(nn.Module):
    """A projection stored as the checkpoint stores it.

    kind "fp8": weight float8_e4m3fn [out, in] + scale float8_e8m0fnu [ceil(out/32), ceil(in/32)];
    kind "fp4": weight int8 [out, in/2] (two e2m1 codes, even element low) + scale e8m0 [out, in/32];
    both run as act_quant(x, 1x32) + block-scaled GEMM -> bf16 (model.py `linear`).
    kind "bf16": F.linear of bf16 operands accumulated in fp32, one bf16 rounding (see BF16_GEMM in graphs/numerics.py);
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
            y = kernel_gemm(a, self, "", plain_fmt(self, ""), self.out_features)
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
        return official_index_scores(q, index_k, w)


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
            record(cap, f"layers.{L}.compressor.latent", latent)
            slot0 = None if ctx.prefill else ctx.pos // r

            def put(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
                if g0 is not None:
                    return write_rows(cache, rows, g0, write)
                return write_groups(cache, rows, write, slot0)
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
                record(cap, f"layers.{L}.compress_kv.entry", state_values(rows, cfg.head_dim, COMPRESS_KV_FORMAT))
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

    def _select(self, x, qr, ctx: StepInputs, T: int, offset: int, shared: dict) -> torch.Tensor:
        """Top-k compressed positions per query, sorted ascending, +offset, -1 where unreachable."""
        cfg, r, L = self.cfg, self.ratio, self.layer_id
        cap = ctx.capture
        cos, sin = ctx.rope[True]
        index_k = leading(shared["index_k"], T)
        scores = self.indexer.scores(x, qr, index_k, cos, sin)  # bf16 [B,S,T]
        record(cap, f"layers.{L}.indexer.scores", scores)
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
            record(cap, f"layers.{L}.indexer.candidates", shared["candidates"])
        elif self.indexer.uses_candidates:
            scores = scores.masked_fill(~shared["candidates"], -math.inf)
        # -inf columns up to index_topk keep the top-k width static (as in select_candidate_blocks):
        # a pick at or past compress_len (unreachable, or padding) becomes -1
        scores = F.pad(scores, (0, cfg.index_topk), value=-math.inf)
        idx = stable_topk_indices(scores, cfg.index_topk).sort(dim=-1).values
        idx = torch.where(idx < compress_lens, idx + offset, -1)
        record(cap, f"layers.{L}.indexer.topk", idx)
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
        record(ctx.capture, f"layers.{L}.attn.window_kv", kv)
        keys, idx = self._window(kv, kv_raw, ctx, state, new)
        if self.ratio:
            ckv, cidx = self._compressed(x, qr, ctx, keys.size(1), state, new, shared)
            keys = torch.cat([keys, ckv], dim=1)
            # the compressed part at offset W in every step kind: each index keeps its 64-key
            # block of the online softmax whatever the prompt length (the model docstring)
            idx = torch.cat([idx.expand(B, S, -1), cidx], dim=-1)
        record(ctx.capture, f"layers.{L}.attn.idx", idx)
        o = sparse_attn(q, keys, self.attn_sink, idx.contiguous(), hd ** -0.5)
        record(ctx.capture, f"layers.{L}.attn.core", o)
        return self.output(o, cos, sin)

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The output projection: attention result o bf16 [B,S,H,hd] -> bf16 [B,S,D] (inverse RoPE on
        the tail, grouped wo_a, wo_b), with this layer kind's cos/sin at the tokens' positions."""
        cfg = self.cfg
        B, S = o.shape[:2]
        o = with_rope_tail(o, cfg.rope_head_dim, cos, sin, inverse=True)
        # wo_a is block-diagonal over groups, hence the grouped einsum (model.py Attention.forward)
        o = grouped_gemm(o.view(B, S, cfg.o_groups, -1), self, "wo_a_", self.wo_a).to(torch.bfloat16)  # BF16_GEMM
        return self.wo_b(o.flatten(2))


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
        (token, expert) pairs than there are experts (B*S*topk < E: decode), each pair gathers its
        expert's weights; otherwise the pairs run in expert blocks (`_blockwise`), or every expert
        on every token with weight 0 where not routed when that computes no more rows
        (graphs/moe_blocks.py use_blocks; adding an exact 0 leaves the fp32 sum unchanged)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, indices = self.gate(x)
        record(capture, f"{prefix}.gate.indices", indices.view(*shape[:-1], -1))
        record(capture, f"{prefix}.gate.weights", weights.view(*shape[:-1], -1))
        y = torch.zeros_like(x, dtype=torch.float32)
        if NUMERICS.gemm_order == "kernel" and not routed:
            y = kernel_experts(self, x, weights, indices)
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
        elif use_blocks(x.size(0), self.gate.topk, self.n_experts):
            y = self._blockwise(x, weights, indices, y)
        else:
            dense = torch.zeros(x.size(0), self.n_experts, dtype=torch.float32, device=x.device).scatter(1, indices, weights)
            out = self._experts(x, dense.t().unsqueeze(-1))  # bf16 [E, N, D]
            for e in range(self.n_experts):
                y = y + out[e]
        y = y + self.shared_experts(x)
        return y.to(x.dtype).view(shape)

    def _blockwise(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y fp32 [N, D] plus the routed experts of x bf16 [N, D] (weights fp32 [N, k], indices int64
        [N, k]) in the blockwise layout (graphs/moe_blocks.py): the pairs grouped by expert into
        fixed-size blocks, one gathered expert per block, so the call computes at most PAD_LIMIT
        times the routed rows whatever the routing. Each token then adds its k outputs in ascending
        expert id, as the routed loop does; every expert row is the routed loop's row."""
        r = route_blocks(indices, weights, self.n_experts)
        N, D = x.shape
        rows = torch.cat([x, x.new_zeros(1, D)])[r.slot_token].view(-1, r.block, D)
        slot_weight = r.slot_weight.view(-1, r.block, 1)
        out = torch.cat([self._experts(rows[g.start:g.stop], slot_weight[g.start:g.stop], r.block_expert[g.start:g.stop])
                         for g in block_groups(rows.size(0), self.n_experts)])  # bf16 [NB, block, D]
        per_pair = out.reshape(-1, D)[r.pair_slot].view(N, -1, D)  # bf16 [N, k, D]
        perm = indices.sort(dim=-1).indices
        per_pair = per_pair.gather(1, perm.unsqueeze(-1).expand(-1, -1, D))
        for j in range(per_pair.size(1)):
            y = y + per_pair[:, j]
        return y

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
        record(cap, f"{p}.hc_attn.pre", attn_pre)
        record(cap, f"{p}.hc_attn.post", attn_post)
        record(cap, f"{p}.hc_attn.comb", attn_comb)
        y = self.attn_norm(hc_pre(x, pre_mix))
        record(cap, f"{p}.attn.in", y)
        y = self.attn(y, ctx, state, new, shared)
        record(cap, f"{p}.attn.out", y)
        return hc_post(y, residual, attn_post, attn_comb), attn_pre

    def ffn_sublayer(self, x, attn_pre, cap: Capture | None, routed: bool):
        """The MoE half: x bf16 [B,S,hc,D], attn_pre fp32 [B,S,hc] -> (x', ffn_pre [B,S,hc]). It
        reads no state and no position, so every layer with the same expert counts has the same
        structure here."""
        p = f"layers.{self.layer_id}"
        residual = x
        ffn_pre, ffn_post, ffn_comb = self.hc_mixes(x, "ffn")
        record(cap, f"{p}.hc_ffn.pre", ffn_pre)
        record(cap, f"{p}.hc_ffn.post", ffn_post)
        record(cap, f"{p}.hc_ffn.comb", ffn_comb)
        y = self.ffn_norm(hc_pre(x, attn_pre))
        record(cap, f"{p}.ffn.in", y)
        y = self.ffn(y, routed=routed, capture=cap, prefix=f"{p}.ffn")
        record(cap, f"{p}.ffn.out", y)
        x = hc_post(y, residual, ffn_post, ffn_comb)
        record(cap, f"{p}.out", x)
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
    record(cap, f"layers.{layer}.engram.in", h)
    h = engram(h, hash_ids)
    record(cap, f"layers.{layer}.engram.out", h)
    return h


def all_head_logits(norm: RMSNorm, head: Linear, h: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
    """`head_logits` at every position of the stream h bf16 [B,S,hc,D] (pre_mix fp32 [B,S,hc]) ->
    logits fp32 [B,S,V] (a speculative verify's read)."""
    return head(norm(hc_pre(h, pre_mix)).float())


def head_logits(norm: RMSNorm, head: Linear, h: torch.Tensor, pre_mix: torch.Tensor, last: torch.Tensor,
                cap: Capture | None = None) -> torch.Tensor:
    """The final pre-mix, norm and fp32 head at position last int64 [B] of each row of the stream
    h bf16 [B,S,hc,D] (pre_mix fp32 [B,S,hc]) -> logits fp32 [B,V] (model.py Transformer.forward)."""
    B = h.size(0)
    gather = last.view(B, 1, 1, 1).expand(B, 1, h.size(2), h.size(3))
    h_last = h.gather(1, gather)
    mix_last = pre_mix.gather(1, last.view(B, 1, 1).expand(B, 1, pre_mix.size(2)))
    y = norm(hc_pre(h_last, mix_last))[:, 0]
    record(cap, "final.norm", y)
    logits = head(y.float())
    record(cap, "final.logits", logits)
    return logits
