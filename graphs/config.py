"""ModelConfig: the DeepSeek-V4.1-Flash model hyper-parameters under the official `ModelArgs` names.

Field names are exactly the keys of the model part of a dsneuron config JSON, which are the keys of
the official `inference/config.json` (deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py ModelArgs,
revision dba1be0a). Values that the reference derives at run time (the engram table sizes from the
prime search, the compressed tokenizer vocab size) are derived here too, never typed in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dsneuron import UserError

#: largest vocab_size: every token id 0..V-1 must fit a signed int32, because index tensors on the
#: Neuron target may be narrowed to int32 (torch-xla's XLA_USE_32BIT_LONG), where a larger id would
#: wrap around silently in the embedding gather; the host's int64 tensors and the tokenizers
#: library's u32 ids are wider. Real vocabularies are far below it (V4.1: 129,280).
MAX_VOCAB_SIZE = 2**31


#: how the indexer scores (graphs.numerics `_Numerics.indexer`): the reference's bf16 expression, or
#: the FP4 MQA-logits op on the operands' bytes
INDEXER_MODES = ("official", "kernel")
#: the numerics of the cpu kernels (graphs.numerics `kernel_numerics`), the first the default: "exact"
#: (fixed fp32 order, bit-identical to the golden on every host) or "fast" (bf16 dot products)
NUMERICS_MODES = ("exact", "fast")


class ConfigError(UserError, ValueError):
    """A config key is unknown, missing, of the wrong type or inconsistent with another key.

    The message always names the key (`model.<key>` or `compile.<key>`) and the limit it breaks.
    """


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one DeepSeek-V4.1-family model (basic mode: no vision, DSpark not run).

    Source: deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py `ModelArgs` (field names and meaning).
    Required keys have no default; the optional ones default as ModelArgs does.
    Raises ConfigError (from `from_dict` / `validate`) naming the offending key.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_mtp_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_inter_dim: int
    n_routed_experts: int
    n_activated_experts: int
    n_shared_experts: int
    score_func: str
    route_scale: float
    swiglu_limit: float
    norm_eps: float
    window_size: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    original_seq_len: int
    rope_factor: float
    beta_fast: int
    beta_slow: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_pad_id: int
    dtype: str
    expert_dtype: str
    dspark_block_size: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_n_activated_experts: int
    # optional, ModelArgs defaults (the released inference/config.json omits gate_temp and
    # norm_topk_prob; fp8_block_size, fp4_block_size and scale_fmt are module constants of the
    # reference, and bos/eos come from the HF config.json)
    dspark_noise_token_id: int = 128799
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    fp8_block_size: int = 32
    scale_fmt: str = "ue8m0"
    fp4_block_size: int = 32
    bos_token_id: int = 0
    eos_token_id: int = 1

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "model") -> "ModelConfig":
        """Build and validate from the JSON object `raw`; unknown and missing keys are errors."""
        fields = check_keys(cls, raw, where)
        values: dict[str, Any] = {}
        for name, f in fields.items():
            if name not in raw:
                continue
            values[name] = coerce(raw[name], f.type, f"{where}.{name}")
        cfg = cls(**values)
        cfg.validate(where)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (tuples as lists); `from_dict(to_dict())` round-trips."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    # ------------------------------------------------------------------ derived
    @property
    def n_all_layers(self) -> int:
        """Backbone layers plus DSpark (mtp.*) stages."""
        return self.n_layers + self.n_mtp_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def mix_hc(self) -> int:
        """Width of the hyper-connection mix projection: pre (hc) + post (hc) + comb (hc*hc)."""
        return (2 + self.hc_mult) * self.hc_mult

    def kv_source_of(self, layer_id: int) -> int | None:
        """The kv-source layer whose compressed KV `layer_id` attends to (None for ratio-0 layers).

        The reference hands the cache down the stack (`shared_attn.compress_kv`), so it is the most
        recent kv source at or before `layer_id`.
        """
        if layer_id >= self.n_layers or self.compress_ratios[layer_id] == 0:
            return None
        srcs = [s for s in self.kv_source_layers if s <= layer_id]
        return srcs[-1] if srcs else None

    def index_source_of(self, layer_id: int) -> int | None:
        """The index-source layer whose top-k selection `layer_id` reuses (itself if it is one)."""
        if layer_id >= self.n_layers or self.compress_ratios[layer_id] == 0:
            return None
        srcs = [s for s in self.index_source_layers if s <= layer_id]
        return srcs[-1] if srcs else None

    def moe_experts(self, layer_id: int) -> tuple[int, int]:
        """(routed, activated) experts of a layer; DSpark stages have their own counts."""
        if layer_id < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    # ------------------------------------------------------------------ validation
    def validate(self, where: str = "model") -> None:
        """Check the dimension rules of the reference kernels and the layer-role tables.

        Raises ConfigError naming the first key that breaks a rule.
        """
        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{where}.{key}: {msg} (got {getattr(self, key)!r})")

        for key in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank",
                    "o_groups", "o_lora_rank", "moe_inter_dim", "n_routed_experts", "n_activated_experts",
                    "window_size", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                    "hc_sinkhorn_iters", "fp8_block_size", "fp4_block_size"):
            need(getattr(self, key) > 0, key, "must be a positive integer")
        need(self.vocab_size <= MAX_VOCAB_SIZE, "vocab_size",
             f"must be <= {MAX_VOCAB_SIZE} = 2**31, so that every token id fits int32 (Neuron gather indices)")
        need(self.n_mtp_layers >= 0, "n_mtp_layers", "must be >= 0")
        need(self.score_func in ("softmax", "sigmoid", "sqrtsoftplus"), "score_func",
             "must be one of softmax, sigmoid, sqrtsoftplus")
        need(self.dtype == "fp8", "dtype", "only 'fp8' (FP8 e4m3 32x32 block-scaled linears) is supported")
        need(self.expert_dtype == "fp4", "expert_dtype", "only 'fp4' (e2m1 1x32 block-scaled experts) is supported")
        need(self.scale_fmt == "ue8m0", "scale_fmt", "only 'ue8m0' scales are supported")
        need(self.fp8_block_size == 32, "fp8_block_size", "V4.1 uses 32 (1x32 activations, 32x32 weights)")
        need(self.fp4_block_size == 32, "fp4_block_size", "V4.1 uses 32")
        need(self.n_shared_experts == 1, "n_shared_experts", "the reference asserts exactly 1")
        need(self.n_activated_experts <= self.n_routed_experts, "n_activated_experts", f"must be <= n_routed_experts={self.n_routed_experts}")
        need(self.norm_eps > 0, "norm_eps", "must be > 0")
        need(self.gate_temp > 0, "gate_temp", "must be > 0")
        # RoPE / YaRN (model.py precompute_freqs_cis): a zero here divides by zero into NaN logits
        for key in ("rope_theta", "compress_rope_theta", "rope_factor", "original_seq_len", "beta_slow", "route_scale",
                    "hc_eps"):
            need(getattr(self, key) > 0, key, "must be > 0")
        need(self.beta_fast > self.beta_slow, "beta_fast", f"must be > beta_slow={self.beta_slow} (YaRN's correction range)")
        need(self.swiglu_limit >= 0, "swiglu_limit", "must be >= 0 (0: no clamp)")
        b = self.fp8_block_size
        for key in ("dim", "q_lora_rank", "moe_inter_dim", "head_dim", "index_head_dim"):
            need(getattr(self, key) % b == 0, key, f"must be a multiple of the FP8/FP4 block size {b}")
        need(self.rope_head_dim % 2 == 0, "rope_head_dim", "must be even (interleaved RoPE pairs)")
        need(self.rope_head_dim < self.head_dim, "rope_head_dim", f"must be < head_dim={self.head_dim}")
        need(self.rope_head_dim <= self.index_head_dim, "rope_head_dim", f"must be <= index_head_dim={self.index_head_dim}")
        need(self.head_dim % 16 == 0, "head_dim", "must be a multiple of 16 (compressed KV FP4 groups)")
        need(self.n_heads % self.o_groups == 0, "o_groups", f"must divide n_heads={self.n_heads}")
        need((self.o_groups * self.o_lora_rank) % b == 0, "o_lora_rank", f"o_groups*o_lora_rank must be a multiple of {b}")
        need(self.hc_mult >= 1, "hc_mult", "must be >= 1")

        n_all = self.n_all_layers
        need(len(self.compress_ratios) == n_all, "compress_ratios",
             f"needs one entry per layer incl. DSpark stages: n_layers + n_mtp_layers = {n_all}")
        for i, r in enumerate(self.compress_ratios):
            if r not in (0, 1, 2):
                raise ConfigError(f"{where}.compress_ratios: entry {i} is {r}; V4.1 basic mode supports 0, 1 and 2")
        for i in range(self.n_layers, n_all):
            if self.compress_ratios[i] != 0:
                raise ConfigError(f"{where}.compress_ratios: DSpark stage {i} must have ratio 0 (sliding window only)")
        for key in ("kv_source_layers", "index_source_layers", "engram_layer_ids", "dspark_target_layer_ids"):
            ids = getattr(self, key)
            need(list(ids) == sorted(set(ids)), key, "must be strictly increasing")
            need(all(0 <= i < self.n_layers for i in ids), key, f"entries must be backbone layers 0..{self.n_layers - 1}")
        for s in self.kv_source_layers:
            need(self.compress_ratios[s] > 0, "kv_source_layers", f"layer {s} has compress ratio 0")
        for s in self.index_source_layers:
            need(self.compress_ratios[s] > 0, "index_source_layers", f"layer {s} has compress ratio 0")
        for i in range(self.n_layers):
            r = self.compress_ratios[i]
            if r == 0:
                continue
            src = self.kv_source_of(i)
            if src is None or self.compress_ratios[src] != r:
                raise ConfigError(f"{where}.kv_source_layers: layer {i} (ratio {r}) has no preceding kv source of the same ratio")
            isrc = self.index_source_of(i)
            if isrc is None or isrc < src:
                raise ConfigError(f"{where}.index_source_layers: layer {i} has no index source at or after its kv source {src}")
        for s in self.index_source_layers:
            ksrc = self.kv_source_of(s)
            need(ksrc is not None and ksrc in self.index_source_layers, "index_source_layers",
                 f"layer {s} reads index keys from kv source {ksrc}, which must itself be an index source")
        if self.candidate_source_layer >= 0:
            need(self.candidate_source_layer in self.index_source_layers, "candidate_source_layer",
                 "must be an index source layer")
            need(self.candidate_topk_blocks > 0, "candidate_topk_blocks", "must be > 0 when candidate_source_layer >= 0")
            need(self.candidate_block_size > 0, "candidate_block_size", "must be > 0 when candidate_source_layer >= 0")
        if self.engram_layer_ids:
            need(self.engram_max_ngram_size >= 2, "engram_max_ngram_size", "must be >= 2")
            need(self.engram_n_heads > 0, "engram_n_heads", "must be > 0")
            need(self.engram_head_dim > 0 and self.engram_head_dim % b == 0, "engram_head_dim",
                 f"must be a positive multiple of {b} (FP8 table scales)")
            need(self.engram_vocab_size > 1, "engram_vocab_size", "must be > 1")
            need(0 <= self.engram_pad_id < self.vocab_size, "engram_pad_id", f"must be a token id < vocab_size={self.vocab_size}")
        if self.n_mtp_layers:
            need(self.dspark_block_size > 0, "dspark_block_size", "must be > 0 when n_mtp_layers > 0")
            need(len(self.dspark_target_layer_ids) > 0, "dspark_target_layer_ids", "DSpark needs target layers")
            need(self.dspark_markov_rank > 0, "dspark_markov_rank", "must be > 0")
        for key in ("bos_token_id", "eos_token_id", "dspark_noise_token_id"):
            need(0 <= getattr(self, key) < self.vocab_size, key, f"must be < vocab_size={self.vocab_size}")


def check_keys(cls: type, raw: Any, where: str) -> dict[str, dataclasses.Field]:
    """The fields of dataclass `cls` after checking that `raw` is a JSON object with no unknown key
    and every required key. Raises ConfigError naming `<where>.<key>`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (known keys: {', '.join(sorted(fields))})")
    missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in raw]
    if missing:
        also = f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise ConfigError(f"{where}.{missing[0]}: missing required key{also}")
    return fields


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Type-check one JSON value against the dataclass annotation (a string under __future__)."""
    ann = str(annotation)
    if ann.startswith("tuple"):
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{key}: expected a list of integers, got {value!r}")
        return tuple(value)
    if ann == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if ann == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if ann == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if ann == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value
