"""The checkpoint contract: every tensor of a V4.1-Flash checkpoint with its HF name, shape and dtype.

Names are those the official inference code loads (no `model.` prefix, block scales as `.scale`),
shapes and dtypes those of the released safetensors files. Source: deepseek-ai/DeepSeek-V4.1-Flash:
inference/model.py (module tree: Block, Attention, Compressor, Indexer, MoE, Engram, DSparkBlock) and
the V4.1 safetensors header table summarised in docs/numerics.md "Number formats".

Every other part (checkpoint writer, loader, model) derives its tensor list from `checkpoint_spec`,
so there is one place that says what a checkpoint holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

# safetensors dtype names
BF16, F32, F8, E8M0, I8 = "BF16", "F32", "F8_E4M3", "F8_E8M0", "I8"


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor. `kind` says how it is stored and drawn:

    - "fp8":   F8_E4M3 weight [out, in] with a companion `<name minus .weight>.scale` F8_E8M0
               [ceil(out/32), ceil(in/32)] (32x32 blocks);
    - "fp4":   I8 packed e2m1 [out, in/2] with `.scale` F8_E8M0 [out, in/32] (1x32 blocks);
    - "fp8row": F8_E4M3 table [rows, dim] with `.scale` F8_E8M0 [rows, dim/32] (engram, 1x32);
    - "scale": the companion scale of one of the above;
    - "plain": BF16 or F32, stored as is.
    `role` is a short family name used for initialisation and reports (e.g. "norm", "linear", "hc_fn").
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    role: str
    fan_in: int = 0


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    def __init__(self, block: int):
        self.block = block
        self.out: dict[str, TensorSpec] = {}

    def plain(self, name: str, shape: tuple[int, ...], dtype: str, role: str, fan_in: int = 0) -> None:
        self.out[name] = TensorSpec(name, tuple(shape), dtype, "plain", role, fan_in)

    def fp8(self, prefix: str, out_f: int, in_f: int, role: str = "linear") -> None:
        b = self.block
        self.out[f"{prefix}.weight"] = TensorSpec(f"{prefix}.weight", (out_f, in_f), F8, "fp8", role, in_f)
        self.out[f"{prefix}.scale"] = TensorSpec(f"{prefix}.scale", (_ceil(out_f, b), _ceil(in_f, b)), E8M0, "scale", role)

    def fp4(self, prefix: str, out_f: int, in_f: int, role: str = "expert") -> None:
        self.out[f"{prefix}.weight"] = TensorSpec(f"{prefix}.weight", (out_f, in_f // 2), I8, "fp4", role, in_f)
        self.out[f"{prefix}.scale"] = TensorSpec(f"{prefix}.scale", (out_f, in_f // 32), E8M0, "scale", role)

    def fp8row(self, prefix: str, rows: int, dim: int, role: str) -> None:
        self.out[f"{prefix}.weight"] = TensorSpec(f"{prefix}.weight", (rows, dim), F8, "fp8row", role, dim)
        self.out[f"{prefix}.scale"] = TensorSpec(f"{prefix}.scale", (rows, dim // 32), E8M0, "scale", role)


def _block(b: _Builder, cfg: ModelConfig, p: str, layer_id: int, engram_rows: int | None) -> None:
    """Tensors of one Block (backbone layer or DSpark stage) under prefix `p` (e.g. `layers.3`)."""
    d, hd, hc = cfg.dim, cfg.head_dim, cfg.hc_mult
    ratio = cfg.compress_ratios[layer_id]
    backbone = layer_id < cfg.n_layers
    b.plain(f"{p}.attn_norm.weight", (d,), BF16, "norm")
    b.plain(f"{p}.ffn_norm.weight", (d,), BF16, "norm")
    for s in ("attn", "ffn"):
        b.plain(f"{p}.hc_{s}_fn", (cfg.mix_hc, hc * d), F32, "hc_fn", hc * d)
        b.plain(f"{p}.hc_{s}_base", (cfg.mix_hc,), F32, "hc_base")
        b.plain(f"{p}.hc_{s}_scale", (3,), F32, "hc_scale")
    a = f"{p}.attn"
    b.plain(f"{a}.attn_sink", (cfg.n_heads,), F32, "attn_sink")
    b.fp8(f"{a}.wq_a", cfg.q_lora_rank, d)
    b.plain(f"{a}.q_norm.weight", (cfg.q_lora_rank,), BF16, "norm")
    b.fp8(f"{a}.wq_b", cfg.n_heads * hd, cfg.q_lora_rank)
    b.fp8(f"{a}.wkv", hd, d)
    b.plain(f"{a}.kv_norm.weight", (hd,), BF16, "norm")
    # stored FP8 like every attention projection; the loader dequantises it to bf16 as convert.py does
    b.fp8(f"{a}.wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.n_heads * hd // cfg.o_groups)
    b.fp8(f"{a}.wo_b", d, cfg.o_groups * cfg.o_lora_rank)
    if backbone and layer_id in cfg.kv_source_layers:
        b.plain(f"{a}.compressor.wkv.weight", (hd, d), BF16, "linear", d)
        if ratio > 1:
            b.plain(f"{a}.compressor.wgate.weight", (hd, d), BF16, "compressor_gate", d)
        b.plain(f"{a}.compressor.norm.weight", (hd,), BF16, "norm")
    if backbone and layer_id in cfg.index_source_layers:
        ix = f"{a}.indexer"
        b.fp8(f"{ix}.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        b.plain(f"{ix}.weights_proj.weight", (cfg.index_n_heads, d), BF16, "linear", d)
        if layer_id in cfg.kv_source_layers:
            b.plain(f"{ix}.wk.weight", (cfg.index_head_dim, hd), BF16, "linear", hd)
            b.plain(f"{ix}.k_norm.weight", (cfg.index_head_dim,), BF16, "norm")
    n_exp, _ = cfg.moe_experts(layer_id)
    f = f"{p}.ffn"
    b.plain(f"{f}.gate.weight", (n_exp, d), BF16, "gate", d)
    b.plain(f"{f}.gate.bias", (n_exp,), F32, "gate_bias")
    for e in range(n_exp):
        b.fp4(f"{f}.experts.{e}.w1", cfg.moe_inter_dim, d)
        b.fp4(f"{f}.experts.{e}.w2", d, cfg.moe_inter_dim, role="expert_w2")
        b.fp4(f"{f}.experts.{e}.w3", cfg.moe_inter_dim, d)
    b.fp8(f"{f}.shared_experts.w1", cfg.moe_inter_dim, d, role="shared")
    b.fp8(f"{f}.shared_experts.w2", d, cfg.moe_inter_dim, role="shared_w2")
    b.fp8(f"{f}.shared_experts.w3", cfg.moe_inter_dim, d, role="shared")
    if engram_rows is not None:
        g = f"{p}.engram"
        n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        b.fp8row(f"{g}.embed", engram_rows, cfg.engram_head_dim, "engram_table")
        b.fp8(f"{g}.wkv", d * (hc + 1), n_cols * cfg.engram_head_dim, role="engram_wkv")
        b.plain(f"{g}.q_weight", (hc, d), BF16, "engram_qk")
        b.plain(f"{g}.k_weight", (hc, d), BF16, "engram_qk")


def checkpoint_spec(cfg: ModelConfig, engram_num_embeddings: tuple[int, ...]) -> dict[str, TensorSpec]:
    """All tensors of a checkpoint for `cfg`, in a stable order (the order files are written in).

    engram_num_embeddings: table rows per engram layer, as derived by
    `dsneuron.graphs.engram.engram_layout(cfg).num_embeddings` (the sum of that layer's primes).
    Raises ValueError when its length differs from cfg.engram_layer_ids.
    """
    if len(engram_num_embeddings) != len(cfg.engram_layer_ids):
        raise ValueError(f"engram_num_embeddings has {len(engram_num_embeddings)} entries, "
                         f"engram_layer_ids has {len(cfg.engram_layer_ids)}")
    b = _Builder(cfg.fp8_block_size)
    d = cfg.dim
    b.plain("embed.weight", (cfg.vocab_size, d), BF16, "embed")
    rows = dict(zip(cfg.engram_layer_ids, engram_num_embeddings))
    for i in range(cfg.n_layers):
        _block(b, cfg, f"layers.{i}", i, rows.get(i))
    b.plain("norm.weight", (d,), BF16, "norm")
    b.plain("head.weight", (cfg.vocab_size, d), BF16, "head", d)
    # DSpark (nextn) stages: loaded and validated, not executed in basic mode
    for s in range(cfg.n_mtp_layers):
        p = f"mtp.{s}"
        _block(b, cfg, p, cfg.n_layers + s, None)
        if s == 0:
            b.fp8(f"{p}.main_proj", d, d * len(cfg.dspark_target_layer_ids))
            b.plain(f"{p}.main_norm.weight", (d,), BF16, "norm")
        if s == cfg.n_mtp_layers - 1:
            r = cfg.dspark_markov_rank
            b.plain(f"{p}.norm.weight", (d,), BF16, "norm")
            b.plain(f"{p}.markov_head.embed.weight", (cfg.vocab_size, r), BF16, "embed")
            b.plain(f"{p}.markov_head.head.weight", (cfg.vocab_size, r), BF16, "head", r)
            b.plain(f"{p}.confidence_head.proj.weight", (1, d + r), BF16, "linear", d + r)
    return b.out
