"""The V4.1 model behind the compile pipeline: checkpoint -> shared weights -> one step graph per
bucket (`graphs.steps.PrefillStep` / `DecodeStep`), plus the tokenizer files and the engram hashing
parameters the runtime applies on the host."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

import dsneuron.graphs
import dsneuron.kernels_nki
from dsneuron.graphs import checkpoint as ckpt_io
from dsneuron.graphs import steps
from dsneuron.graphs.config import ModelConfig
from dsneuron.graphs.engram import engram_layout, engram_params
from dsneuron.graphs.tokenizer import tokenizer_files
from dsneuron.graphs.weights import build_model, load_casts, model_weights
from dsneuron.runtime_min.schema import PROBE_PREFIX

from .buckets import plan_buckets
from .cache import cache_root, source_digest
from .config import CompileConfig
from .export import StepGraph


class GraphsStepFactory:
    """StepFactory over one Transformer per decode capacity, all holding the same weight tensors.
    probes: every step also returns its captured stage tensors as outputs "probe.<stage>" (a probe
    bundle, for `dsneuron compare`; larger executables and outputs, same logits and state)."""

    def __init__(self, cfg: ModelConfig, models: dict[int, torch.nn.Module], probes: bool = False):
        self.cfg, self.models, self.probes = cfg, models, probes

    def fingerprint(self) -> str:
        """Changes whenever the model code, the kernels or the model config change."""
        # the NKI kernels (*_nki.py) and their stand-in (sim/) never enter a cpu graph
        src = source_digest(Path(dsneuron.graphs.__file__).parent, Path(dsneuron.kernels_nki.__file__).parent,
                            exclude=lambda rel: rel.name.endswith("_nki.py") or len(rel.parts) > 1)
        return hashlib.sha256((src + json.dumps([self.cfg.to_dict(), self.probes], sort_keys=True)).encode()).hexdigest()

    def init_state(self, batch: int, capacity: int) -> dict[str, torch.Tensor]:
        return steps.init_state(self.cfg, batch, capacity)

    def prefill(self, batch: int, seq_len: int, capacity: int) -> StepGraph:
        m = steps.PrefillStep(self.models[capacity], batch, seq_len, probes=self.probes)
        return StepGraph(m, tuple(zip(("tokens", "valid_len", "engram_ids"), m.example_inputs())), self._outputs(m))

    def decode(self, batch: int, capacity: int) -> StepGraph:
        m = steps.DecodeStep(self.models[capacity], batch, probes=self.probes)
        names = ("tokens", "pos", "engram_ids", *m.state_names)
        return StepGraph(m, tuple(zip(names, m.example_inputs())), self._outputs(m))

    @staticmethod
    def _outputs(m: steps.PrefillStep | steps.DecodeStep) -> tuple[str, ...]:
        return ("logits", *m.state_names, *(PROBE_PREFIX + n for n in m.probe_names()))


def checkpoint_for(model_cfg: ModelConfig, compile_cfg: CompileConfig, cache_dir: Path | None) -> Path:
    """compile.checkpoint, or the deterministic random checkpoint of compile.seed, made once and
    kept under the cache folder (keyed by the model config and seed) so warm compiles reuse it."""
    if compile_cfg.checkpoint is not None:
        return Path(compile_cfg.checkpoint)
    key = hashlib.sha256(json.dumps([model_cfg.to_dict(), compile_cfg.seed], sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root(cache_dir) / "checkpoints" / key
    if not (path / "model.safetensors.index.json").exists():
        ckpt_io.make_checkpoint(model_cfg, path, seed=compile_cfg.seed, force=path.exists())
    return path


def build_model_parts(model_cfg: ModelConfig, compile_cfg: CompileConfig, cache_dir: Path | None = None,
                      probes: bool = False):
    """ModelParts for `compile_bundle` (probes: see GraphsStepFactory). Raises CheckpointError /
    ConfigError on bad input."""
    from .compile import ModelParts

    path = checkpoint_for(model_cfg, compile_cfg, cache_dir)
    rows = engram_layout(model_cfg).num_embeddings if model_cfg.engram_layer_ids else ()
    weights = model_weights(ckpt_io.load_checkpoint(path, model_cfg, rows), model_cfg)
    capacities = plan_buckets(compile_cfg, model_cfg).decode_capacities
    probe = build_model(model_cfg, weights, rows, max(capacities))
    casts = load_casts(probe, weights)
    # cast once so every per-capacity model holds the very same tensors (weights stored once)
    held = {n: (t.to(casts[n]) if n in casts else t) for n, t in weights.items()}
    models = {c: build_model(model_cfg, held, rows, c) for c in capacities}
    first = models[capacities[0]]
    params = engram_params(model_cfg) if model_cfg.engram_layer_ids else None
    return ModelParts(GraphsStepFactory(model_cfg, models, probes), {n: p.detach() for n, p in first.named_parameters()},
                      tokenizer_files(), {"engram": params.to_dict() if params else None},
                      stored_dtypes={n: weights[n].dtype for n in casts})
