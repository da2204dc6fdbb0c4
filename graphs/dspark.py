"""DSpark, V4.1's drafter (the `mtp.0..n-1` stages), as the official inference code computes it, and
the target side it reads: `main_hidden` at every position of a prefill, chunk or decode step.

Source: deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py (revision dba1be0a): `Transformer.forward`
(main_hidden), `Transformer.forward_spec`, `DSparkBlock` (forward, forward_embed, forward_head),
`DSparkAttention`, `get_dspark_topk_idxs`, `DSparkMarkovHead`, `DSparkConfidenceHead`. The official
code drafts and never verifies (generate.py does not call forward_spec); the verify loop is
runtime_min/core/speculative.py.

What the official code computes, per decode step at position t (main model fed token x_t):

- main_hidden [B, 1, T*D] bf16: for each target layer L (dspark_target_layer_ids, T of them) the mean
  over the hc copies of the stream entering layer L's attention (after L's engram, if any),
  concatenated in target order (`main_hiddens.append(h.mean(dim=2))`).
- forward_spec(x_{t+1}, main_hidden, t): main_x = main_norm(main_proj(main_hidden)); each stage's
  DSparkAttention writes main_kv = fp8_qdq(rope_t(kv_norm(wkv(main_x)))) into its own window ring
  (slot t % W), then the block of `dspark_block_size` tokens [x_{t+1}, noise, ..., noise] at
  positions t+1 .. t+block goes through the stages (mHC blocks with the lagged pre-mix, the stage's
  own MoE); its attention sees the ring slots 0 .. min(W, t+1)-1 in slot order and every block
  token (no causal mask inside the block: get_dspark_topk_idxs). The last stage's head: pre-mix,
  its norm, the main model's fp32 head, then token by token the Markov bias of the previous token
  (markov_head: a rank-r embedding and an fp32 [V, r] head) is added and the next draft sampled
  (argmax at temperature 0). confidence = proj([x, markov_embed]).
- At prefill (start_pos 0) forward_spec only seeds the rings (the last W positions of the prompt).

Here the ring is explicit state (`DraftCache`, bf16 values as the reference holds them) and the two
parts are separate calls: `seed` writes main_kv at accepted positions (a prefill, a verify's
accepted prefix), `draft` drafts from a position whose main_kv is already in the ring. Writing a
position twice writes the same row, so seed(t) + draft(t) is the reference's decode-step forward_spec
at t. Deviations, both shape-only: the ring is per row (per-row positions, as the main model's
state); draft may start at position 0 (the reference's prefill call never drafts there; its decode
call asserts start_pos > 0), where the ring holds one position.
Numerics: the golden's (exact GEMMs, graphs/model.py); MoE by the routed loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsneuron.kernels_nki.hc_mean import main_hidden_of

from .config import ModelConfig
from .context import Capture
from .dispatch import fp8_qdq, kernel_gemm
from .kernel_weights import attach_kernel_weights, kernel_recipes
from .mhc import hc_post, hc_pre
from .model import Block, Linear, RMSNorm, Transformer, all_head_logits, embed_stream
from .numerics import gemm_order, kernel_numerics
from .rope import rope_tables, with_rope_tail
from .quant import dequant_fp8_weight, linear_fp32


# ----------------------------------------------------------------------------------------- main_hidden
def target_stream_names(cfg: ModelConfig) -> list[str]:
    """The Capture names of the stream entering each target layer's attention, in target order:
    `layers.L.engram.out` for an engram layer, else the previous block's `layers.{L-1}.out`
    ("embed" for layer 0 without engram: the embedding stream)."""
    out = []
    for L in cfg.dspark_target_layer_ids:
        if L in cfg.engram_layer_ids:
            out.append(f"layers.{L}.engram.out")
        else:
            out.append(f"layers.{L - 1}.out" if L > 0 else "embed")
    return out


def main_hidden_from_capture(model: Transformer, cap: Capture, tokens: torch.Tensor) -> torch.Tensor:
    """main_hidden bf16 [B, S, T*D] at every position of a step run with `cap` (prefill, chunk or
    decode; tokens int64 [B,S] its tokens, used only for a target layer 0 without engram)."""
    parts = []
    for name in target_stream_names(model.cfg):
        h = embed_stream(model.embed, model.cfg.hc_mult, tokens)[0] if name == "embed" else cap.tensors[name]
        parts.append(main_hidden_of(h))
    return torch.cat(parts, dim=-1)


def logits_from_capture(model: Transformer, cap: Capture) -> torch.Tensor:
    """The head's logits fp32 [B, S, V] at every position of a step run with `cap` (the last block's
    output and its ffn pre-mix: what head_logits reads at one position, here at each)."""
    L = model.cfg.n_layers - 1
    return all_head_logits(model.norm, model.head, cap.tensors[f"layers.{L}.out"], cap.tensors[f"layers.{L}.hc_ffn.pre"])


# ----------------------------------------------------------------------------------------- drafter
@dataclass
class DraftCache:
    """The drafter's window rings: one bf16 [B, W, head_dim] per stage (main_kv of position p at slot
    p % W, values already FP8-QDQ'd as the reference's window_kv_cache holds them)."""

    rings: list[torch.Tensor]

    def clone(self) -> "DraftCache":
        return DraftCache([r.clone() for r in self.rings])


@dataclass
class Draft:
    """One drafted block: tokens int64 [B, block] (the drafts for positions t+2 .. t+block+1),
    logits fp32 [B, block, V] (with the Markov bias, before temperature), confidence fp32 [B, block]."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor


class DSpark(nn.Module):
    """The drafter: `cfg.n_mtp_layers` stages (model.Block at layer ids n_layers + s, with their own
    MoE counts), stage 0's main_proj/main_norm, the last stage's norm, markov_head and
    confidence_head; the embedding and the head are the main model's (`model`: the Transformer, or
    any module with its `cfg`, `embed` and `head`).

    Build with `DSpark.from_checkpoint(model, ckpt)` from the checkpoint's mtp.* tensors (as loaded
    by graphs/checkpoint.py). Raises ValueError when the config has no DSpark stages or a tensor
    is missing or misshapen.

    order: the GEMM order its projections run in (graphs/numerics.py): the golden's "ascending"
    (exact block sums, float64 weight copies) or "fused" (one fp32 GEMM a projection, fp32 copies:
    several times faster, the drafts within fp32 summation order of the golden's). The drafts never
    reach the output (the verify decides), so serving may draft "fused".
    """

    order: str = "ascending"
    #: the cpu kernels' numerics of a main head held in its kernel layout only (`drafter_from_tensors`
    #: with `head_kernel`): the bundle's, so the head runs as the bundle's own head stage does
    head_numerics: str = "exact"
    #: the Markov head's bf16 values as cpu kernel panels (`drafter_from_tensors` with `head_kernel`),
    #: read by the kernel at every drafted token instead of an fp32 GEMM (6 ms a token on tiny)
    markov_kernel_w: torch.Tensor | None = None
    markov_kernel_w_scale: torch.Tensor | None = None
    #: attend with the cpu target's C++ kernel (kernels_nki/cpu_attn.py: fp32 fma chains, its own
    #: exp) instead of the golden's reference op, whose first eager call (a Python custom op)
    #: imports torch._dynamo: 2.3 s at a process's first draft (`drafter_from_tensors` with `head_kernel`)
    cpu_attention: bool = False

    def __init__(self, model: Transformer, max_seq_len: int):
        super().__init__()
        cfg = model.cfg
        if not cfg.n_mtp_layers:
            raise ValueError("DSpark: the config has no DSpark stages (n_mtp_layers = 0)")
        self.cfg, self.max_seq_len, self.block = cfg, max_seq_len, cfg.dspark_block_size
        self._main = [model]  # not a submodule: its parameters are the main model's
        d, r = cfg.dim, cfg.dspark_markov_rank
        self.stages = nn.ModuleList([Block(cfg, cfg.n_layers + s, None) for s in range(cfg.n_mtp_layers)])
        self.main_proj = Linear(d * len(cfg.dspark_target_layer_ids), d, "fp8", cfg.fp8_block_size)
        self.main_norm = RMSNorm(d, cfg.norm_eps)
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.markov_embed = nn.Parameter(torch.empty(cfg.vocab_size, r, dtype=torch.bfloat16), requires_grad=False)
        # bf16 in the checkpoint, fp32 in the reference (ParallelHead, DSparkConfidenceHead)
        self.markov_head = nn.Parameter(torch.empty(cfg.vocab_size, r, dtype=torch.float32), requires_grad=False)
        self.confidence = nn.Parameter(torch.empty(1, d + r, dtype=torch.float32), requires_grad=False)
        # ratio-0 RoPE (rope_theta, no YaRN) up to the last block position past the context
        cos, sin = rope_tables(cfg, max_seq_len + self.block + 1, compressed=False)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # checkpoint name (after "mtp.{s}.") -> this module's parameter, for the head-only tensors
    _EXTRA = {"main_proj.weight": "main_proj.weight", "main_proj.scale": "main_proj.scale",
              "main_norm.weight": "main_norm.weight", "norm.weight": "norm.weight",
              "markov_head.embed.weight": "markov_embed", "markov_head.head.weight": "markov_head",
              "confidence_head.proj.weight": "confidence"}

    @classmethod
    def param_name(cls, name: str) -> str | None:
        """This module's parameter that checkpoint tensor `name` becomes ("mtp.0.attn.wq_a.weight"
        -> "stages.0.attn.wq_a.weight"; the head-only tensors sit on stage 0 (main_*) and the last
        stage (the others)); None for a tensor that is not the drafter's or is folded into another
        (wo_a's scale, into its dequantised weight)."""
        if not name.startswith("mtp.") or name.endswith("attn.wo_a.scale"):
            return None
        s, rest = name[len("mtp."):].split(".", 1)
        return cls._EXTRA.get(rest, f"stages.{s}.{rest}")

    @classmethod
    def from_checkpoint(cls, model: Transformer, ckpt: dict[str, torch.Tensor], max_seq_len: int,
                        order: str = "ascending", cached: bool = True) -> "DSpark":
        """The drafter with the checkpoint's mtp.* tensors (wo_a dequantised to bf16 as convert.py
        does for the main layers, unless it is bf16 already; bf16 heads promoted to fp32 as the
        reference holds them), drafting in GEMM `order` (class docstring). cached: keep each
        projection's dequantised copy (eager speed; a graph dequantises from the stored bytes
        instead, `DraftStep`). A tensor of the same dtype is taken as is (its storage), so a
        graph binds it to its checkpoint name. Raises ValueError as the class says, or for an
        order other than "ascending" and "fused"."""
        if order not in ("ascending", "fused"):
            raise ValueError(f"DSpark: order must be 'ascending' or 'fused', got {order!r}")
        drafter = cls(model, max_seq_len)
        drafter.order = order
        params = dict(drafter.named_parameters())
        loaded = {}
        for name, t in ckpt.items():
            target = cls.param_name(name)
            if target is None:
                continue
            if name.endswith("attn.wo_a.weight") and t.dtype != torch.bfloat16:
                scale = ckpt[name[:-len("weight")] + "scale"]
                t = dequant_fp8_weight(t, scale, model.cfg.fp8_block_size).to(torch.bfloat16)
            if target not in params:
                raise ValueError(f"DSpark: checkpoint tensor {name} has no place in the drafter")
            p = params[target]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"DSpark: {name} is {tuple(t.shape)}, the drafter needs {tuple(p.shape)}")
            loaded[target] = t.to(p.dtype)
        missing = sorted(set(params) - set(loaded))
        if missing:
            raise ValueError(f"DSpark: the checkpoint lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")
        drafter.load_state_dict(loaded, strict=False, assign=True)
        for mod in drafter.modules():
            if isinstance(mod, Linear) and cached:
                mod.cached = mod.dequantized().double() if order != "fused" else mod.dequantized().float()
        return drafter.eval()

    # ------------------------------------------------------------------ state
    def init_cache(self, batch: int) -> DraftCache:
        """Empty rings (zeros; a slot is read only once its position is written)."""
        shape = (batch, self.cfg.window_size, self.cfg.head_dim)
        return DraftCache([torch.zeros(shape, dtype=torch.bfloat16) for _ in self.stages])

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_cos[positions], self.rope_sin[positions]

    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        """main_hidden bf16 [B,S,T*D] -> main_x bf16 [B,S,D] (DSparkBlock.forward_embed)."""
        return self.main_norm(self.main_proj(main_hidden))

    @torch.inference_mode()
    def seed(self, cache: DraftCache, main_hidden: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> DraftCache:
        """Write main_kv of row b's positions start[b] .. start[b]+count[b]-1 (main_hidden bf16
        [B,S,T*D], row b's first count[b] rows) into every stage's ring at slot position % W, in
        position order (DSparkAttention.forward: the start_pos 0 seeding and the decode-step write).
        start, count int64 [B]. Returns the new cache."""
        W = self.cfg.window_size
        B, S, _ = main_hidden.shape
        mx = self.main_x(main_hidden)
        positions = start.unsqueeze(1) + torch.arange(S)
        cos, sin = self._rope(positions.clamp(max=self.rope_cos.size(0) - 1))
        rings = []
        for stage, ring in zip(self.stages, cache.rings):
            a = stage.attn
            kv = fp8_qdq(with_rope_tail(a.kv_norm(a.wkv(mx)), self.cfg.rope_head_dim, cos, sin), self.cfg.fp8_block_size)
            ring = ring.clone()
            for b in range(B):
                for j in range(int(count[b])):  # in order: the newest position of a slot wins
                    ring[b, int(positions[b, j]) % W] = kv[b, j]
            rings.append(ring)
        return DraftCache(rings)

    def seed_rings(self, rings: list[torch.Tensor], main_hidden: torch.Tensor, start: torch.Tensor,
                   count: torch.Tensor) -> list[torch.Tensor]:
        """`seed` with static shapes (a graph's): main_kv of row b's positions start[b] ..
        start[b]+count[b]-1 (main_hidden bf16 [B,S,T*D], S <= window_size, count int64 [B] in
        0..S) written into each ring (bf16 [B, W, head_dim]) at slot position % W; the S
        positions are consecutive, so their slots are distinct and the write is one scatter.
        Returns the new rings; the values are `seed`'s."""
        cfg = self.cfg
        W, hd = cfg.window_size, cfg.head_dim
        B, S, _ = main_hidden.shape
        if S > W:
            raise ValueError(f"seed_rings: {S} positions a call; the ring holds window_size={W}")
        mx = self.main_x(main_hidden)
        positions = start.unsqueeze(1) + torch.arange(S, device=start.device)
        cos, sin = self._rope(positions.clamp(max=self.rope_cos.size(0) - 1))
        keep = (torch.arange(S, device=start.device) < count.unsqueeze(1)).unsqueeze(-1)  # [B, S, 1]
        slots = (positions % W).unsqueeze(-1).expand(B, S, hd)
        out = []
        for stage, ring in zip(self.stages, rings):
            a = stage.attn
            kv = fp8_qdq(with_rope_tail(a.kv_norm(a.wkv(mx)), cfg.rope_head_dim, cos, sin), cfg.fp8_block_size)
            out.append(ring.scatter(1, slots, torch.where(keep, kv, ring.gather(1, slots))))
        return out

    def _attention(self, stage: Block, x: torch.Tensor, ring: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """DSparkAttention.forward at start_pos = pos (int64 [B]) after its ring write: x bf16
        [B, block, D] (after attn_norm) -> bf16 [B, block, D]."""
        cfg, a = self.cfg, stage.attn
        B, K, _ = x.shape
        W, rd, hd = cfg.window_size, cfg.rope_head_dim, cfg.head_dim
        cos, sin = self._rope(pos.unsqueeze(1) + 1 + torch.arange(K))
        q = with_rope_tail(a.wq_b(a.q_norm(a.wq_a(x))).unflatten(-1, (cfg.n_heads, hd)), rd, cos, sin)
        kv = fp8_qdq(with_rope_tail(a.kv_norm(a.wkv(x)), rd, cos, sin), cfg.fp8_block_size)
        keys = torch.cat([ring, kv], dim=1)  # [B, W + K, hd]
        # get_dspark_topk_idxs: ring slots 0 .. min(W, pos+1)-1, then the block; -1 after (neutral)
        j = torch.arange(W + K)
        n = torch.clamp(pos + 1, max=W).unsqueeze(1)  # [B,1]
        idx = torch.where(j < n, j, torch.where(j < n + K, W + j - n, -1))
        idx = idx.unsqueeze(1).expand(B, K, W + K).to(torch.int32).contiguous()
        attn = torch.ops.dsneuron.sparse_attn_cpu if self.cpu_attention else torch.ops.dsneuron.sparse_attn
        o = attn(q, keys, a.attn_sink, idx, hd ** -0.5)
        return a.output(o, cos, sin)

    def _stage(self, stage: Block, h: torch.Tensor, pre_mix: torch.Tensor, ring: torch.Tensor, pos: torch.Tensor,
               routed: bool = True):
        """Block.forward of a DSparkBlock at start_pos > 0: (h, pre_mix) -> (h', ffn_pre); routed:
        the MoE's routed loop (eager) or its static-shape form (a graph: graphs/model.py MoE)."""
        residual = h
        attn_pre, attn_post, attn_comb = stage.hc_mixes(h, "attn")
        y = self._attention(stage, stage.attn_norm(hc_pre(h, pre_mix)), ring, pos)
        h = hc_post(y, residual, attn_post, attn_comb)
        return stage.ffn_sublayer(h, attn_pre, None, routed=routed)

    def block_logits(self, rings: list[torch.Tensor], token: torch.Tensor, pos: torch.Tensor, routed: bool = True,
                     head_order: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block [token, noise, ...] from position pos (int64 [B]) through the stages reading
        `rings` (bf16 [B, W, head_dim] each), then the last stage's pre-mix and norm and the main
        model's fp32 head (in GEMM order `head_order` when given: "kernel" where the main model's
        head holds only its cpu kernel layout): (x bf16 [B, block, D] after the pre-mix, logits
        fp32 [B, block, V] before the Markov bias)."""
        main = self._main[0]
        B, K = token.size(0), self.block
        ids = torch.cat([token.unsqueeze(1), torch.full((B, K - 1), self.cfg.dspark_noise_token_id, dtype=torch.int64,
                                                        device=token.device)], dim=1)
        h, pre_mix = embed_stream(main.embed, self.cfg.hc_mult, ids)
        for stage, ring in zip(self.stages, rings):
            h, pre_mix = self._stage(stage, h, pre_mix, ring, pos, routed)
        x = hc_pre(h, pre_mix)
        y = self.norm(x).float()
        if head_order is None:
            return x, main.head(y)
        with gemm_order(head_order):
            return x, main.head(y)

    def markov(self, x: torch.Tensor, logits: torch.Tensor, token: torch.Tensor, pick) -> Draft:
        """Token by token, the Markov bias of the previous token (DSparkMarkovHead) added to
        logits[:, i] and the next draft picked by `pick(i, logits_i fp32 [B, V]) -> int64 [B]`;
        then the confidence (DSparkConfidenceHead) from x and the Markov embeddings."""
        prev, tokens, rows, embeds = token, [], [], []
        for i in range(self.block):
            e = self.markov_embed[prev]  # bf16 [B, r]
            if self.markov_kernel_w is not None:  # its bf16 values in cpu kernel panels (drafter_from_tensors)
                bias = kernel_gemm(e.float(), self, "markov_", "bf16", self.cfg.vocab_size)
            else:
                bias = linear_fp32(e.float(), self.markov_head, self.order)
            row = logits[:, i] + bias
            prev = pick(i, row)
            tokens.append(prev)
            rows.append(row)
            embeds.append(e)
        hidden = torch.cat([x, torch.stack(embeds, dim=1)], dim=-1).float()
        confidence = linear_fp32(hidden, self.confidence, self.order).squeeze(-1)
        return Draft(torch.stack(tokens, dim=1), torch.stack(rows, dim=1), confidence)

    @torch.inference_mode()
    def draft(self, cache: DraftCache, token: torch.Tensor, pos: torch.Tensor, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Draft:
        """Draft a block from position pos (int64 [B]; main_kv at pos already seeded): token int64
        [B] is x_{pos+1}, the first block token (forward_spec / DSparkBlock.forward_head).
        temperature 0: each draft is the argmax; else drawn from softmax(logits / T) with `generator`."""
        pick = lambda i, row: draw(row, temperature, generator)  # noqa: E731
        if self._main[0].head.weight is None:  # the head in its cpu kernel layout only
            with kernel_numerics(self.head_numerics):
                x, logits = self.block_logits(cache.rings, token, pos, head_order="kernel")
                return self.markov(x, logits, token, pick)
        x, logits = self.block_logits(cache.rings, token, pos)
        return self.markov(x, logits, token, pick)


def draft_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The drafter's proposal distribution q float64 [..., V] at temperature T > 0 (softmax of the
    max-shifted logits / T, as runtime_min/core/sampling.py computes the target's)."""
    x = logits.double()
    return torch.softmax((x - x.amax(dim=-1, keepdim=True)) / temperature, dim=-1)


def draw(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits fp32 [B, V] -> int64 [B]: argmax at temperature 0 (forward_head's `sample`), else one
    draw from `draft_probs` (the reference's exponential-race draw has this distribution)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(draft_probs(logits, temperature), 1, generator=generator)[:, 0]


# ----------------------------------------------------------------------------------------- speculative
class DSparkDrafter:
    """`DSpark` as runtime_min/core/speculative.py's Drafter (eager, in the DSpark's GEMM order)."""

    def __init__(self, dspark: DSpark):
        self.dspark, self.block = dspark, dspark.block

    def start(self, batch: int) -> DraftCache:
        return self.dspark.init_cache(batch)

    def seed(self, cache: DraftCache, main_hidden: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> DraftCache:
        with gemm_order(self.dspark.order):
            return self.dspark.seed(cache, main_hidden, start, count)

    def propose(self, cache: DraftCache, token: torch.Tensor, pos: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        with gemm_order(self.dspark.order):
            d = self.dspark.draft(cache, token, pos, temperature, generator)
        q = draft_probs(d.logits[:, :k], temperature) if temperature > 0 else None
        return d.tokens[:, :k], q


def load_drafter(checkpoint, cfg: ModelConfig, max_seq_len: int, order: str = "ascending") -> DSparkDrafter:
    """The DSpark drafter of a checkpoint folder (validated, graphs/checkpoint.py): `drafter_from_tensors`
    on its tensors. max_seq_len: the context capacity it drafts within; order: its GEMM order
    (`DSpark`). Raises CheckpointError / ValueError as load_checkpoint and `DSpark.from_checkpoint`."""
    from pathlib import Path

    from .checkpoint import load_checkpoint
    from .engram import engram_layout

    ckpt = load_checkpoint(Path(checkpoint), cfg, engram_layout(cfg).num_embeddings if cfg.engram_layer_ids else ())
    return drafter_from_tensors({n: t for n, t in ckpt.items() if n.startswith("mtp.") or n in DRAFTER_MAIN_WEIGHTS},
                                cfg, max_seq_len, order)


#: the main model's tensors the drafter reads besides its own mtp.*: the embedding and the head
DRAFTER_MAIN_WEIGHTS = ("embed.weight", "head.weight")


def bundle_drafter(bundle, cfg: ModelConfig, max_seq_len: int, order: str = "ascending",
                   weights: dict[str, torch.Tensor] | None = None) -> DSparkDrafter | None:
    """The drafter a bundle compiled with `--speculative dspark` stores (a runtime_min/bundle/bundle.py
    Bundle: its `speculative` and `stored_tensors`), in GEMM `order` (`DSpark`); None for a bundle
    that stores none. weights: the loaded bundle's weights (a Runner's `weights`, the prepare
    recipes applied): where they hold the head's cpu kernel layout (`head.kernel_w`, a cpu bundle),
    the drafter's head runs through the cpu kernel on it in the bundle's numerics, as the bundle's
    head stage does, instead of on an fp32 copy of head.weight (tiny: a 530 MB fp32 GEMM of 110 ms
    a draft on a 2-core AMD EPYC, 2026-12-07). Raises ValueError as `drafter_from_tensors` for
    stored tensors that do not make the drafter."""
    if bundle.speculative != "dspark":
        return None
    kernel = None
    if weights is not None and "head.kernel_w" in weights:
        kernel = {n: weights[f"head.{n}"] for n in ("kernel_w", "kernel_w_scale")}
    return drafter_from_tensors(bundle.stored_tensors(lambda n: n.startswith("mtp.") or n in DRAFTER_MAIN_WEIGHTS),
                                cfg, max_seq_len, order, head_kernel=kernel,
                                head_numerics=bundle.manifest.numerics)


def drafter_from_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, max_seq_len: int,
                         order: str = "ascending", head_kernel: dict[str, torch.Tensor] | None = None,
                         head_numerics: str = "exact") -> DSparkDrafter:
    """The DSpark drafter built on the main model's embedding and head alone (no main layers: what a
    bundle's runtime needs beside its executables). tensors: checkpoint names and formats, every
    `mtp.*` tensor plus `embed.weight` (bf16 [V, D]) and `head.weight` (bf16 or fp32 [V, D], held
    fp32 as the reference promotes it), e.g. from a checkpoint or a bundle compiled with
    `--speculative dspark`; order: its GEMM order (`DSpark`). head_kernel: {"kernel_w",
    "kernel_w_scale"}, the head prepared for the cpu kernels (graphs/kernel_weights.py): the head
    then holds only those and drafts through the kernel in numerics `head_numerics` (head.weight
    is not read). Raises ValueError naming a missing or misshapen tensor, or a bad order
    (`DSpark.from_checkpoint`)."""
    missing = [n for n in DRAFTER_MAIN_WEIGHTS if n not in tensors]
    if missing:
        raise ValueError(f"DSpark drafter: no tensor {missing[0]!r} (the main model's {missing[0].split('.')[0]})")
    main = nn.Module()
    main.cfg = cfg
    main.embed = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=tensors["embed.weight"], _freeze=True)
    main.head = Linear(cfg.dim, cfg.vocab_size, "fp32")
    if head_kernel is None:
        main.head.weight = nn.Parameter(tensors["head.weight"].float(), requires_grad=False)
    else:  # as a cpu compile holds it: the prepared panels as buffers, the weight dropped
        attach_kernel_weights(main, {f"head.{n}": t for n, t in head_kernel.items()},
                              kernel_recipes(main, {"head.weight": tensors["head.weight"]}), drop=True)
    mtp = {n: t for n, t in tensors.items() if n.startswith("mtp.")}
    with torch.inference_mode():
        dspark = DSpark.from_checkpoint(main, mtp, max_seq_len, order)
    dspark.head_numerics = head_numerics
    if head_kernel is not None:
        from dsneuron.kernels_nki import cpu_attn  # noqa: F401  (loads the C++ op and its fake)

        dspark.cpu_attention = True
        markov = tensors[f"mtp.{cfg.n_mtp_layers - 1}.markov_head.head.weight"]
        if markov.dtype == torch.bfloat16:  # as stored: the panels hold the values the fp32 copy holds
            from dsneuron.kernels_nki.cpu_gemm import prepare_weight

            prepared = prepare_weight("bf16", markov)
            dspark.markov_kernel_w, dspark.markov_kernel_w_scale = prepared["w"], prepared["w_scale"]
    return DSparkDrafter(dspark)


# ----------------------------------------------------------------------------------------- the compiled step
class DraftStep(nn.Module):
    """Exportable DSpark step at a fixed batch: the reference's forward_spec at decode, one call
    (the drafter's bucket, kind "draft"). It seeds the rings with main_kv of the positions the
    last verify kept (`seed_rings`), then drafts a block from `pos` (`block_logits`, the MoE in
    its static-shape form) with the Markov bias token by token. Each draft is the argmax of
    logits_i at temperature 0, else of logits_i / T + gumbel_i (the Gumbel-max draw: a sample of
    softmax(logits_i / T) for gumbel_i drawn as -log(-log U), U uniform, by the caller), so the
    proposal q = softmax(logits / T) of the returned logits is what was drawn from.

    dspark: a `DSpark` in GEMM order "fused" built with cached=False (its projections dequantise
    from the stored bytes in the graph); the main model's embedding and head are registered here
    too, so an export binds them; a head that holds only its cpu kernel layout runs through the
    kernel, in the cpu kernels' `numerics`. seed_len: the positions one call can seed, at most window_size
    (all a ring keeps: a verify's 1 + block, or a prompt's last window_size, in one call).

    forward(token int64 [B], pos int64 [B], main_hidden bf16 [B, seed_len, T*D], seed_pos int64 [B],
            seed_count int64 [B] (0..seed_len), gumbel fp32 [B, block, V], temperature fp32 [B],
            *rings bf16 [B, W, head_dim] (one per stage))
        -> (tokens int64 [B, block], logits fp32 [B, block, V] (Markov bias added, before the
            temperature), confidence fp32 [B, block], *rings')
    """

    def __init__(self, dspark: DSpark, batch: int, seed_len: int, numerics: str = "exact"):
        super().__init__()
        if dspark.order != "fused":
            raise ValueError(f"DraftStep: the drafter must run in GEMM order 'fused' (got {dspark.order!r})")
        if not 1 <= seed_len <= dspark.cfg.window_size:
            raise ValueError(f"DraftStep: seed_len must be in 1..window_size={dspark.cfg.window_size}, got {seed_len}")
        self.dspark, self.batch, self.seed_len, self.numerics = dspark, batch, seed_len, numerics
        main = dspark._main[0]
        self.embed, self.head = main.embed, main.head
        # a cpu compile holds the main head in its kernel layout only (graphs/kernel_weights.py)
        self.head_order = "kernel" if main.head.weight is None else None

    @property
    def ring_names(self) -> list[str]:
        return [f"mtp.{s}.ring" for s in range(len(self.dspark.stages))]

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        cfg, B = self.dspark.cfg, self.batch
        T = len(cfg.dspark_target_layer_ids)
        i64 = dict(dtype=torch.int64)
        return (torch.zeros(B, **i64), torch.zeros(B, **i64),
                torch.zeros(B, self.seed_len, T * cfg.dim, dtype=torch.bfloat16), torch.zeros(B, **i64),
                torch.zeros(B, **i64), torch.zeros(B, self.dspark.block, cfg.vocab_size, dtype=torch.float32),
                torch.zeros(B, dtype=torch.float32), *self.dspark.init_cache(B).rings)

    def forward(self, token, pos, main_hidden, seed_pos, seed_count, gumbel, temperature, *rings):
        d = self.dspark
        with gemm_order("fused"), kernel_numerics(self.numerics):
            rings = d.seed_rings(list(rings), main_hidden, seed_pos, seed_count)
            x, logits = d.block_logits(rings, token, pos, routed=False, head_order=self.head_order)
            t = temperature.unsqueeze(1)
            hot = t > 0

            def pick(i: int, row: torch.Tensor) -> torch.Tensor:
                return torch.where(hot, row / torch.where(hot, t, torch.ones_like(t)) + gumbel[:, i], row).argmax(-1)

            out = d.markov(x, logits, token, pick)
        return (out.tokens, out.logits, out.confidence, *rings)
