"""The V4.1 model behind the compile pipeline: checkpoint -> shared weights -> one step graph per
bucket (`graphs.steps.PrefillStep` / `DecodeStep`), plus the tokenizer files and the engram hashing
parameters the runtime applies on the host."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

import dsneuron.graphs
import dsneuron.kernels_nki
from dsneuron.graphs import stages, steps
from dsneuron.graphs.checkpoint import map_checkpoint
from dsneuron.graphs.checkpoint_make import make_checkpoint
from dsneuron.graphs.config import ModelConfig
from dsneuron.graphs.engram import engram_layout, engram_params
from dsneuron.graphs.kernel_weights import attach_kernel_weights, kernel_recipes
from dsneuron.graphs.lazy import Computed, placeholder
from dsneuron.graphs.model import Transformer
from dsneuron.graphs.tokenizer import tokenizer_files
from dsneuron.graphs.weights import build_model, load_casts, model_weights
from dsneuron.kernels_nki.prepare import Prepare, prepared_specs
from dsneuron.runtime_min.bundle.schema import DRAFT_OUTPUTS, MAIN_HIDDEN, PROBE_PREFIX, engram_columns

from .buckets import plan_buckets
from .cache import cache_root, source_digest
from .config import CompileConfig, check_speculative_plan
from .export import CompileError, ModelParts, StageGraph, StepGraph
from .parallel import Comm, check_shardable, shard_model
from .placement import Parallel


class GraphsStepFactory:
    """StepFactory over one Transformer per decode capacity, all holding the same weight tensors.
    probes: every step also returns its captured stage tensors as outputs "probe.<stage>" (a probe
    bundle, for `dsneuron compare`; larger executables and outputs, same logits and state)."""

    def __init__(self, cfg: ModelConfig, models: dict[int, torch.nn.Module], probes: bool = False, order: str = "fused",
                 indexer: str = "official", shard: tuple[int, int, int] | None = None, numerics: str = "exact"):
        self.cfg, self.models, self.probes, self.order, self.indexer = cfg, models, probes, order, indexer
        #: the cpu kernels' numerics the stages trace with (graphs.numerics.kernel_numerics)
        self.numerics = numerics
        #: (tp, ep, rank) of a sharded compile: the rank's graphs hold its expert ids and vocabulary rows
        self.shard = shard

    def fingerprint(self) -> str:
        """Changes whenever the model code, the kernels or the model config change."""
        # the NKI kernels (*_nki.py) and their stand-in (sim/) never enter a cpu graph
        src = source_digest(Path(dsneuron.graphs.__file__).parent, Path(dsneuron.kernels_nki.__file__).parent,
                            exclude=lambda rel: rel.name.endswith("_nki.py") or len(rel.parts) > 1)
        # numerics only when fast, so that exact bundles keep the keys (and the manifests) they had
        fast = [self.numerics] if self.numerics != "exact" else []
        return hashlib.sha256((src + json.dumps([self.cfg.to_dict(), self.probes, self.order, self.indexer, self.shard,
                                                 *fast], sort_keys=True)).encode()).hexdigest()

    def init_state(self, batch: int, capacity: int) -> dict[str, torch.Tensor]:
        return steps.init_state(self.cfg, batch, capacity)

    def prefill(self, batch: int, seq_len: int, capacity: int) -> StepGraph:
        """The single-graph prefill bucket (graphs/steps.py PrefillStep); with the drafter (a
        speculative compile), it also returns main_hidden at each prompt's last window_size
        positions, what seeds the drafter's rings (graphs/steps.py prefill_seed)."""
        window = self.cfg.window_size if self.drafter is not None else 0
        m = steps.PrefillStep(self.models[capacity], batch, seq_len, probes=self.probes, indexer=self.indexer,
                              seed_window=window)
        outputs = self._outputs(m)
        if window:
            outputs = (outputs[0], MAIN_HIDDEN, *outputs[1:])
        return StepGraph(m, tuple(zip(("tokens", "valid_len", "engram_ids"), m.example_inputs())), outputs)

    def decode(self, batch: int, capacity: int) -> StepGraph:
        m = steps.DecodeStep(self.models[capacity], batch, probes=self.probes, indexer=self.indexer)
        names = ("tokens", "pos", "engram_ids", *m.state_names)
        return StepGraph(m, tuple(zip(names, m.example_inputs())), self._outputs(m))

    def chunk(self, batch: int, seq_len: int, capacity: int) -> StepGraph:
        m = steps.ChunkStep(self.models[capacity], batch, seq_len, probes=self.probes, indexer=self.indexer)
        names = ("tokens", "pos", "valid_len", "engram_ids", *m.state_names)
        return StepGraph(m, tuple(zip(names, m.example_inputs())), self._outputs(m))

    #: the DSpark drafter over the same weights (graphs/dspark.py, GEMM order "fused", uncached),
    #: for the draft buckets; None when the compile stores no drafter or its target compiles none
    drafter: Any = None

    def draft(self, batch: int, seq_len: int, capacity: int) -> StepGraph:
        """The drafter's bucket (graphs/dspark.py DraftStep): seq_len is the block it drafts; it
        seeds up to window_size positions a call (all a ring keeps: a verify's 1 + block, or a
        prompt's last window_size in one call). capacity: the context it drafts within (the
        drafter's RoPE rows; its rings do not depend on it). Raises CompileError without a drafter."""
        from dsneuron.graphs.dspark import DraftStep

        if self.drafter is None:
            raise CompileError(f"draft b{batch}: this compile holds no drafter (compile --speculative dspark)")
        m = DraftStep(self.drafter, batch, self.cfg.window_size, self.numerics)
        names = ("token", "pos", "main_hidden", "seed_pos", "seed_count", "gumbel", "temperature", *m.ring_names)
        return StepGraph(m, tuple(zip(names, m.example_inputs())), (*DRAFT_OUTPUTS, *m.ring_names))

    def verify(self, batch: int, seq_len: int, capacity: int) -> StepGraph:
        """The speculative verify bucket (graphs/steps.py VerifyStep): a chunk of seq_len tokens
        returning the logits and main_hidden at every position."""
        m = steps.VerifyStep(self.models[capacity], batch, seq_len, probes=self.probes, indexer=self.indexer)
        names = ("tokens", "pos", "valid_len", "engram_ids", *m.state_names)
        return StepGraph(m, tuple(zip(names, m.example_inputs())),
                         ("logits", MAIN_HIDDEN, *m.state_names, *(PROBE_PREFIX + n for n in m.probe_names())))

    @staticmethod
    def _outputs(m: steps.PrefillStep | steps.DecodeStep | steps.ChunkStep) -> tuple[str, ...]:
        return ("logits", *m.state_names, *(PROBE_PREFIX + n for n in m.probe_names()))

    def stages(self, kind: str, batch: int, seq_len: int, capacity: int, min_seq_len: int = 0,
               seq_len_step: int = 1, per_token_len: int | None = None) -> list[StageGraph]:
        """The bucket as graphs.stages stages, with example inputs at (batch, seq_len) and, when
        min_seq_len > 0 (prefill, chunk, verify), the token dimension dynamic: the multiples of seq_len_step in
        min_seq_len..seq_len. The engram tables' row dimension is dynamic too, so both engram
        layers share one executable. With per_token_len, the per-token stages (embed, engram, MoE
        half, head) take any token count in 1..per_token_len instead, in prefill and decode buckets alike,
        so that one executable of each serves every bucket of the batch size."""
        model = self.models[capacity]
        # a decode step writes its one-row caches in place (graphs/cache_rows.py; the runtime copies
        # the state inputs it is given once a step, runtime_min/executors/executor_cpu.py)
        built = stages.build_stages(model, kind, batch, capacity, order=self.order, indexer=self.indexer,
                                    numerics=self.numerics, in_place=True)
        if self.probes:
            stages.with_probes(built)
        S = 1 if kind == "decode" else seq_len
        E, C = steps.n_engram_cols(self.cfg)
        data = {"tokens": torch.zeros(batch, S, dtype=torch.int64), "valid_len": torch.full((batch,), S, dtype=torch.int64),
                "pos": torch.zeros(batch, dtype=torch.int64),
                **engram_columns(torch.zeros(batch, S, E, C, dtype=torch.int64)),
                **(steps.init_state(self.cfg, batch, capacity) if kind != "prefill" else {})}
        fakes = stages.trace_stages(built, data)
        dynamic_tables = {n: {0: "engram_rows"} for n, _ in model.named_parameters() if ".engram.embed." in n}
        out = []
        for st in built:
            shapes = {n: [int(d) for d in fakes[n].shape] for n in st.inputs}
            dynamic = {**dynamic_tables}
            bounds = {"engram_rows": (2, 2**62, 1)} if dynamic_tables else {}
            per_token = st.per_token and per_token_len is not None
            if per_token:
                bounds["T"] = (1, per_token_len, 1)
                for n in st.inputs:  # token-major, but the head's "last" [B]
                    if len(shapes[n]) > 1:
                        shapes[n][1] = per_token_len
                        dynamic[n] = {1: "T"}
            elif min_seq_len and min_seq_len < seq_len:  # one count (seq_len = the step) stays static
                bounds["S"] = (min_seq_len, seq_len, seq_len_step)
                for n in st.inputs:
                    if n in ("tokens", "h", "pre_mix") or n.startswith("engram_ids.") or n.endswith(".topk_idxs"):
                        dynamic[n] = {1: "S"}
                    elif n.endswith(".candidates") and kind in ("chunk", "verify"):  # [B, S, the cache's rows]
                        dynamic[n] = {1: "S"}
                    elif n.endswith(".candidates"):
                        layer = int(n.split(".")[1])
                        if self.cfg.compress_ratios[layer] != 1:
                            raise CompileError(f"{st.name}: a dynamic prefill needs the candidate source {layer} at "
                                               f"compress ratio 1 (its candidates are [B, S, S // ratio])")
                        dynamic[n] = {1: "S", 2: "S"}
            examples = tuple((n, torch.zeros(shapes[n], dtype=fakes[n].dtype)) for n in st.inputs)
            specs = tuple((tuple(int(d) for d in fakes[n].shape), fakes[n].dtype) for n in st.outputs)
            out.append(StageGraph(st.name, st.kind, StepGraph(st.module, examples, st.outputs, dynamic, bounds), per_token,
                                  specs))
        return out


def checkpoint_for(model_cfg: ModelConfig, compile_cfg: CompileConfig, cache_dir: Path | None) -> Path:
    """compile.checkpoint, or the deterministic random checkpoint of compile.seed, made once and
    kept under the cache folder (keyed by the model config and seed) so warm compiles reuse it."""
    if compile_cfg.checkpoint is not None:
        return Path(compile_cfg.checkpoint)
    key = hashlib.sha256(json.dumps([model_cfg.to_dict(), compile_cfg.seed], sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root(cache_dir) / "checkpoints" / key
    if not (path / "model.safetensors.index.json").exists():
        make_checkpoint(model_cfg, path, seed=compile_cfg.seed, force=path.exists())
    return path


def build_model_parts(model_cfg: ModelConfig, compile_cfg: CompileConfig, cache_dir: Path | None = None,
                      probes: bool = False, target: str = "cpu", par: Parallel | None = None, rank: int = 0):
    """ModelParts for `compile_bundle` (probes: see GraphsStepFactory). For the cpu target the
    models run in GEMM order "kernel": every GEMM weight is prepared into the cpu kernels' layout
    (graphs/kernel_weights.py), the executables take the prepared tensors, and the bundle stores
    the checkpoint tensors with the recipes (ModelParts.prepare). Raises CheckpointError /
    ConfigError on bad input.

    No tensor data is read here (graphs/lazy.py): the checkpoint is validated from its headers and
    mapped (`map_checkpoint`), so the models hold views whose pages are read only where something
    computes with them, and the bundle's weights are streamed from the checkpoint files when they
    are written (ModelParts.sources). On cpu the models are for tracing only: the prepared kernel
    weights, and the recipe inputs the models do not hold (the fp32 head and compressors, the bf16
    wo_a), are zero placeholders of their shapes, since the runtime prepares the real ones from the
    stored tensors; the wo_a dequantisation is made per layer while the weights file is written. The
    neuron models compute (the StableHLO checks run them eagerly), so there the bf16 -> fp32 casts
    and the wo_a dequantisation are made here, as before.

    compile.speculative "dspark": the checkpoint's mtp.* tensors join the weights as host weights
    (ModelParts.host_weights), stored from their checkpoint bytes for the runtime's eager drafter;
    ConfigError when the plan cannot verify drafts (config.py check_speculative_plan).

    par, rank: the parts of rank `rank` of a sharded compile (par.tp > 1, cpu target only): its
    models are cut by compiler/parallel.py `shard_model` (their graphs call the collectives), its
    weights are its slices of the checkpoint tensors under their checkpoint names, read and
    dequantised here (a rank's share, not lazily). Raises UserError for a plan shard_model refuses.
    """
    check_speculative_plan(compile_cfg, model_cfg, target, par.tp if par is not None else 1)
    path = checkpoint_for(model_cfg, compile_cfg, cache_dir)
    rows = engram_layout(model_cfg).num_embeddings if model_cfg.engram_layer_ids else ()
    mapped = map_checkpoint(path, model_cfg, rows)
    capacities = plan_buckets(compile_cfg, model_cfg).decode_capacities
    cpu = target == "cpu"
    if compile_cfg.numerics != "exact" and not cpu:
        raise CompileError(f"numerics {compile_cfg.numerics}: the fast kernels are the cpu target's")
    sharded = par is not None and par.tp > 1
    shard = None
    if sharded:
        if not cpu:
            raise CompileError(f"--tp {par.tp}: a sharded compile is implemented for the cpu target only (the neuron "
                               "target's NxD layers are not written yet)")
        check_shardable(model_cfg, par)
        shard = functools.partial(shard_model, par=par, rank=rank, comm=Comm(rank, par.tp), cache=False)
    derived: dict[str, Computed] | None = {} if cpu and not sharded else None
    weights = model_weights(mapped.tensors, model_cfg, derived)
    if sharded:
        # the rank's slices, cut from a model over the mapped tensors, back in their checkpoint dtypes
        ckpt_dtypes = {n: t.dtype for n, t in weights.items()}
        skeleton = shard(build_model(model_cfg, weights, rows, max(capacities)))
        weights = {n: p.detach().to(ckpt_dtypes[n]) for n, p in skeleton.named_parameters()}
    else:
        skeleton = Transformer(model_cfg, rows, max(capacities))  # module structure and parameter dtypes
    casts = load_casts(skeleton, weights)
    recipes: list[Prepare] = kernel_recipes(skeleton, weights) if cpu else []
    del skeleton
    consumed = {n for r in recipes for n in (*r.weights, *r.scales)}
    # cast once so every per-capacity model holds the very same tensors (weights stored once); a
    # weight that only the recipes read is dropped from the models below: a placeholder will do,
    # as its bytes are stored from the checkpoint's (sources below); a rank's slices are no
    # checkpoint bytes, so there the cast slice itself is stored
    held = {n: ((placeholder(tuple(t.shape), casts[n]) if n in consumed and not sharded else t.to(casts[n]))
                if n in casts else t)
            for n, t in weights.items()}
    models = {c: build_model(model_cfg, held, rows, c, shard) for c in capacities}
    first = models[capacities[0]]
    if recipes:
        prepared = _prepared_placeholders(recipes, weights)
        for m in models.values():
            attach_kernel_weights(m, prepared, recipes, drop=True)
    taken = {n: p.detach() for n, p in first.named_parameters()}
    taken.update({n: b for n, b in first.named_buffers() if n.endswith(("kernel_w", "kernel_w_scale"))})
    stored = {n: held[n] for r in recipes for n in (*r.weights, *r.scales)}
    all_weights = {**taken, **stored}
    # the bytes each weight is stored as: the checkpoint's own where the model's tensor is a view of
    # them or a cast of them (stored_dtypes narrows it back), else the deferred wo_a dequantisation
    sources: dict[str, Any] = {n: mapped.regions[n] for n in all_weights
                               if n in mapped.regions and weights.get(n) is mapped.tensors[n]}
    sources.update({n: src for n, src in (derived or {}).items() if n in all_weights})
    host: tuple[str, ...] = ()
    stored_dtypes = {n: weights[n].dtype for n in casts}
    drafter = None
    if compile_cfg.speculative == "dspark":  # the drafter's tensors as the checkpoint stores them
        host = tuple(n for n in mapped.tensors if n.startswith("mtp."))
        all_weights.update({n: mapped.tensors[n] for n in host})
        sources.update({n: mapped.regions[n] for n in host})
        if not sharded:
            drafter = _graph_drafter(models[capacities[-1]], {n: mapped.tensors[n] for n in host}, all_weights,
                                     stored_dtypes, sources)
    params = engram_params(model_cfg) if model_cfg.engram_layer_ids else None
    factory = GraphsStepFactory(model_cfg, models, probes, "kernel" if recipes else "fused", compile_cfg.indexer,
                                (par.tp, par.ep, rank) if sharded else None, compile_cfg.numerics)
    factory.drafter = drafter
    return ModelParts(factory, all_weights,
                      tokenizer_files(), {"engram": params.to_dict() if params else None},
                      stored_dtypes=stored_dtypes, prepare=tuple(recipes), sources=sources,
                      host_weights=host)


def _graph_drafter(model: torch.nn.Module, mtp: dict[str, torch.Tensor], weights: dict[str, Any],
                   stored_dtypes: dict[str, torch.dtype], sources: dict[str, Any]) -> Any:
    """The DSpark drafter a draft bucket traces (graphs/dspark.py DSpark, GEMM order "fused",
    uncached) over the main `model`'s embedding and head and the checkpoint's mtp.* tensors,
    which `weights` then holds as the drafter holds them: the same tensor where the checkpoint's
    dtype is the drafter's; a bf16 head widened to fp32 (stored narrowed back from its checkpoint
    bytes, cast at load); wo_a dequantised to bf16 (stored so: the runtime's eager drafter takes
    it as is, graphs/dspark.py from_checkpoint), its scale left a host weight."""
    from dsneuron.graphs.dspark import DSpark

    drafter = DSpark.from_checkpoint(model, mtp, model.max_seq_len, order="fused", cached=False)
    params = dict(drafter.named_parameters())
    for name, t in mtp.items():
        target = DSpark.param_name(name)
        if target is None:
            continue
        p = params[target].detach()
        if name.endswith("attn.wo_a.weight"):
            weights[name] = p
            sources.pop(name)
        elif p.dtype != t.dtype:
            weights[name], stored_dtypes[name] = p, t.dtype
    return drafter


def _prepared_placeholders(recipes: list[Prepare], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{output name: placeholder} for every recipe output, with the shape and dtype the recipe
    makes (kernels_nki/prepare.py prepared_specs: from the shapes and dtypes alone, nothing read or computed;
    a pass over fake tensors would import torch._dynamo, 1-2 s that a compile whose buckets all
    come from the cache has no other use for). Raises BundleError for a recipe that does not fit
    its weights."""
    return {n: placeholder(shape, dtype) for r in recipes for n, (shape, dtype) in prepared_specs(r, weights).items()}
