"""Config files: `{"model": {...ModelArgs keys...}, "compile": {...}}`, by path or packaged name,
or a checkpoint folder with the bucket plan given as flags (`checkpoint_config`).

`--config tiny` and `--config tiny.json` both find the packaged `compiler/configs/tiny.json` when no
such file exists in the working directory; a path that exists always wins.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsneuron.graphs.config import INDEXER_MODES, NUMERICS_MODES, ConfigError, ModelConfig, check_keys, coerce

PACKAGED = Path(__file__).parent / "configs"
#: what `compile --speculative` may store: no drafter, or V4.1's DSpark stages (mtp.*)
SPECULATIVE_METHODS = ("none", "dspark")


@dataclass(frozen=True)
class CompileConfig:
    """What to compile: bucket lists and the checkpoint.

    max_seq_len: context capacity in tokens (sizes every state buffer).
    batch_sizes: batch dimension of every bucket.
    decode_batch_sizes: more batch sizes for the decode buckets alone (the rows the scheduler
        decodes together; the runtime prefills one prompt at a time at the smallest batch size, so
        prefill and chunk buckets of these would go unused). Left out of `to_dict` when empty.
    prefill_seq_lens: prefill bucket lengths; [] means generated (powers of two from 128 up to
        max_seq_len, plus max_seq_len).
    decode_context_lens: decode bucket context capacities (<= max_seq_len); [] means generated like
        prefill_seq_lens. compiler/buckets.py validates both lists against the kernel constraints.
    checkpoint: a checkpoint folder; null makes the deterministic random one with `seed`.
    indexer: how the indexer scores (graphs.config.INDEXER_MODES): "official" (the reference's bf16
        expression, the default) or "kernel" (the FP4 MQA-logits op: the NKI kernel on neuron, its
        torch reference on cpu; fp32 dots and head sum, so scores differ from the golden's by
        bf16 roundings).
    chunked_prefill: on the cpu target, also compile a chunk bucket (a prefill continuing from
        state, graphs/steps.py prefill_chunk) per decode capacity at or above the largest prefill
        length, so that a prompt up to the largest capacity runs as chunks (docs/cpu-target.md "Long
        prompts") and a prompt started from a prefix-cache snapshot runs its rest as chunks.
    numerics: the cpu kernels' numerics (graphs.config.NUMERICS_MODES): "exact" (the default: every
        GEMM in one fixed fp32 order, bit-identical to the golden on every host) or "fast" (bf16 dot
        products, kernels_nki/cpu_gemm_fast.py: deterministic and batch-invariant on one host).
        Left out of `to_dict` when "exact", so an exact bundle's manifest is what it was before the field.
    speculative: the drafter the bundle carries for speculative decoding (SPECULATIVE_METHODS):
        "none" (the default, left out of `to_dict`) or "dspark" (V4.1's DSpark stages, the
        checkpoint's `mtp.*` tensors, stored in the weights file beside the executables' weights;
        the runtime drafts with them eagerly, graphs/dspark.py, and verifies on the chunk bucket).
    """

    max_seq_len: int
    batch_sizes: tuple[int, ...]
    prefill_seq_lens: tuple[int, ...]
    decode_context_lens: tuple[int, ...]
    checkpoint: str | None = None
    seed: int = 0
    indexer: str = "official"
    chunked_prefill: bool = True
    numerics: str = "exact"
    decode_batch_sizes: tuple[int, ...] = ()
    speculative: str = "none"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "compile") -> "CompileConfig":
        fields = check_keys(cls, raw, where)
        values = {}
        for name, f in fields.items():
            if name not in raw:
                continue
            if name == "checkpoint":
                if raw[name] is not None and not isinstance(raw[name], str):
                    raise ConfigError(f"{where}.checkpoint: expected a path string or null")
                values[name] = raw[name]
            elif name == "indexer":
                values[name] = check_indexer(raw[name], f"{where}.indexer")
            elif name == "numerics":
                values[name] = check_numerics(raw[name], f"{where}.numerics")
            elif name == "speculative":
                values[name] = check_speculative(raw[name], f"{where}.speculative")
            else:
                values[name] = coerce(raw[name], f.type, f"{where}.{name}")
        cfg = cls(**values)
        if cfg.max_seq_len <= 0:
            raise ConfigError(f"{where}.max_seq_len: must be > 0 (got {cfg.max_seq_len})")
        if not cfg.batch_sizes or min(cfg.batch_sizes) <= 0:
            raise ConfigError(f"{where}.batch_sizes: needs at least one positive batch size")
        if cfg.decode_batch_sizes and min(cfg.decode_batch_sizes) <= 0:
            raise ConfigError(f"{where}.decode_batch_sizes: entries must be positive batch sizes "
                              f"(got {list(cfg.decode_batch_sizes)})")
        for key in ("prefill_seq_lens", "decode_context_lens"):
            vals = getattr(cfg, key)
            if vals and (min(vals) <= 0 or max(vals) > cfg.max_seq_len):
                raise ConfigError(f"{where}.{key}: entries must be in 1..max_seq_len={cfg.max_seq_len} (got {list(vals)})")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()
                if not (k == "numerics" and v == "exact" or k == "decode_batch_sizes" and not v
                        or k == "speculative" and v == "none")}


def check_indexer(value: Any, where: str) -> str:
    """`value` if it is an indexer mode (graphs.config.INDEXER_MODES); else ConfigError naming `where`."""
    if value not in INDEXER_MODES:
        raise ConfigError(f"{where}: must be one of {', '.join(INDEXER_MODES)} (got {value!r})")
    return value


def check_speculative(value: Any, where: str) -> str:
    """`value` if it is a speculative-decoding method (SPECULATIVE_METHODS); else ConfigError naming `where`."""
    if value not in SPECULATIVE_METHODS:
        raise ConfigError(f"{where}: must be one of {', '.join(SPECULATIVE_METHODS)} (got {value!r}): dspark stores "
                          "the model's DSpark drafter (mtp.*) in the bundle for `run --speculative-tokens K`")
    return value


def check_speculative_plan(compile_cfg: "CompileConfig", model_cfg: ModelConfig, target: str, tp: int = 1) -> None:
    """ConfigError when compile_cfg.speculative cannot be served by this compile: DSpark needs the
    model's DSpark stages (n_mtp_layers >= 1, dspark_target_layer_ids); its verify runs in one
    process (no --tp), on the cpu target by tapping the staged chunk bucket (compile.chunked_prefill),
    on the neuron target in verify buckets of its own (compiler/buckets.py `with_verify`)."""
    if compile_cfg.speculative == "none":
        return
    what = f"speculative {compile_cfg.speculative}"
    if not model_cfg.n_mtp_layers or not model_cfg.dspark_target_layer_ids:
        raise ConfigError(f"{what}: the model has no DSpark stages (n_mtp_layers = {model_cfg.n_mtp_layers}, "
                          f"dspark_target_layer_ids = {list(model_cfg.dspark_target_layer_ids)})")
    if target == "cpu" and not compile_cfg.chunked_prefill:
        raise ConfigError(f"{what}: needs compile.chunked_prefill on the cpu target (its verify is a chunk of 1 + k "
                          "tokens, read stage by stage)")
    if tp > 1:
        raise ConfigError(f"{what} with --tp {tp}: the verify runs in one process; compile without --tp")


def check_numerics(value: Any, where: str) -> str:
    """`value` if it is a numerics mode (graphs.config.NUMERICS_MODES); else ConfigError naming `where`."""
    if value not in NUMERICS_MODES:
        raise ConfigError(f"{where}: must be one of {', '.join(NUMERICS_MODES)} (got {value!r}): exact is bit-identical "
                          "to the golden on every host, fast runs every GEMM on bf16 dot products")
    return value


def resolve_config_path(name: str) -> Path:
    """A path that exists, else a packaged config by name (with or without `.json`).

    Raises ConfigError listing the packaged names when neither exists (saying so when `name` is a
    folder).
    """
    p = Path(name)
    if p.is_file():
        return p
    stem = p.name[:-5] if p.name.endswith(".json") else p.name
    packaged = PACKAGED / f"{stem}.json"
    if packaged.is_file():
        return packaged
    names = ", ".join(sorted(q.stem for q in PACKAGED.glob("*.json")))
    if p.is_dir():
        raise ConfigError(f"config {name!r} is a folder; --config takes a JSON config file or a packaged config name "
                          f"(packaged: {names})")
    raise ConfigError(f"config {name!r}: no such file, and no packaged config of that name (packaged: {names})")


def load_config(name: str) -> tuple[ModelConfig, CompileConfig, Path]:
    """Read a config file; returns (model, compile, resolved path). Raises ConfigError."""
    path = resolve_config_path(name)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object with keys 'model' and 'compile'")
    unknown = sorted(set(raw) - {"model", "compile"})
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown top-level key (expected 'model' and 'compile')")
    if "model" not in raw:
        raise ConfigError("model: missing required top-level key")
    model = ModelConfig.from_dict(raw["model"], "model")
    compile_cfg = CompileConfig.from_dict(raw.get("compile", {}), "compile") if "compile" in raw else None
    if compile_cfg is None:
        raise ConfigError("compile: missing required top-level key")
    return model, compile_cfg, path


#: the bucket plan of `dsneuron compile --checkpoint DIR` when no flag says otherwise
CHECKPOINT_DEFAULTS = {"max_seq_len": 4096, "batch_sizes": [1], "prefill_seq_lens": [], "decode_context_lens": None}


def checkpoint_config(folder: str | Path, max_seq_len: int | None = None, batch_sizes: list[int] | None = None,
                      prefill_seq_lens: list[int] | None = None,
                      decode_context_lens: list[int] | None = None) -> tuple[ModelConfig, CompileConfig]:
    """(model, compile) configs for compiling the checkpoint folder `folder`: the model from its
    own config files (graphs.checkpoint.read_checkpoint_config: inference/config.json, else HF
    config.json), the plan from the arguments, each None taking CHECKPOINT_DEFAULTS (decode:
    one bucket of max_seq_len; prefill: the generated lengths). Raises CheckpointError for a
    folder that is missing or has no readable config, ConfigError for a bad plan."""
    from dsneuron.graphs.checkpoint import read_checkpoint_config

    folder = Path(folder)
    model = read_checkpoint_config(folder)
    seq = CHECKPOINT_DEFAULTS["max_seq_len"] if max_seq_len is None else max_seq_len
    raw = {"max_seq_len": seq,
           "batch_sizes": CHECKPOINT_DEFAULTS["batch_sizes"] if batch_sizes is None else batch_sizes,
           "prefill_seq_lens": CHECKPOINT_DEFAULTS["prefill_seq_lens"] if prefill_seq_lens is None else prefill_seq_lens,
           "decode_context_lens": [seq] if decode_context_lens is None else decode_context_lens,
           "checkpoint": str(folder.absolute())}
    return model, CompileConfig.from_dict(raw, "compile")
