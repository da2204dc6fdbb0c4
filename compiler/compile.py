"""The compile pipeline: config + model -> bucket plan -> export -> lower -> backend (cached) -> bundle.

`compile_bundle` is the whole job behind `dsneuron compile`, for every target; `build_steps_for_config`
is the one place where the real model is wired in (tests pass a stand-in StepFactory instead).

Order of work, so that bad input fails before anything expensive: target availability, bucket plan
(kernel constraints), the target's backend (its flags and tools), output folder, weights and
tokenizer inputs; then per bucket: export (with the backend's custom-op lowering active,
compiler/lower.py), cache lookup, compile on a miss, the backend's per-bucket manifest facts; then
the weights file, tokenizer copies, manifest, atomic rename.

One loop drives both targets through `Backend`, the few things that differ per target: the export
lowering and input views, the cache key ingredients of a bucket, compiling one bucket, per-bucket
manifest facts and the manifest's `compiler` section. `CpuBackend` (AOTInductor, compiler/
backend_cpu.py), `backend_neuron.NeffBackend` (neuronx-cc with NKI kernels) and
`backend_neuron.StableHLOBackend` (the neuron target stopped at StableHLO) implement it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import torch
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

import dsneuron
from dsneuron.graphs.config import ConfigError, ModelConfig
from dsneuron.runtime_min.bundle.bundle import check_target, host_toolchain
from dsneuron.runtime_min.bundle.schema import (CHUNK_SCHEMA_VERSION, IN_PLACE_SCHEMA_VERSION, NUMERICS_SCHEMA_VERSION,
                                                SCHEMA_VERSION, SPECULATIVE_SCHEMA_VERSION, TOKENIZER_DIR, WEIGHT_FILES_SCHEMA_VERSION,
                                                WEIGHT_SHARD_BYTES, WEIGHTS, Bucket, BundleError, Manifest, StateEntry,
                                                TensorSpec, Tokenizer, bucket_file, dtype_name, shard_record,
                                                written_in_place)

from . import backend_cpu, backend_neuron
from .buckets import BucketPlan, PlannedBucket, plan_buckets
from .bundle_writer import BundleWriter, check_output
from .cache import CompileCache, cache_key, cache_root, normalised_graph, pre_key
from .config import CompileConfig
from .export import CompileError, ModelParts, StepFactory, StepGraph, export_step
from .lower import InlineCustomOps, finish, inline_mode
from .staged import StagedCompile, default_workers, run_forked

__all__ = ["Backend", "CpuBackend", "ModelParts", "StepFactory", "StepGraph", "build_steps_for_config", "compile_bundle",
           "make_backend"]


def build_steps_for_config(model_cfg: ModelConfig, compile_cfg: CompileConfig, cache_dir: Path | None = None,
                           probes: bool = False, target: str = "cpu") -> ModelParts:
    """The real model's parts for `target`: the checkpoint of compile.checkpoint (or the
    deterministic one of compile.seed, made once under the cache folder), graphs.steps modules over
    shared weights (cpu: in the kernels' GEMM order, with the load-time recipes), the tokenizer
    files and the engram hashing parameters (see compiler/model_steps.py). probes: every step also
    returns its stage tensors (a probe bundle for `dsneuron compare`)."""
    from .model_steps import build_model_parts

    return build_model_parts(model_cfg, compile_cfg, cache_dir, probes, target)


class Backend(Protocol):
    """What `compile_bundle` needs from a target; one instance per compile, made before any work.

    target: the bundle's target ("cpu", "neuron"); name: the manifest's `compiler.backend`, also a
    cache key ingredient; toolchain: the manifest's `toolchain`; input_views: {weight dtype: dtype}
    of weights passed to the executable as same-width views (compiler/export.py); neuron_spelling:
    export with FP8 decodes and roundings in integer arithmetic and no float64 (kernels_nki/formats.py).
    A backend may also define warm_up() -> threading.Thread: set-up that every compile of a process
    shares, started when the first staged bucket misses the cache and joined before the compile
    workers are forked (compiler/staged.py), so that they inherit it.
    """

    target: str
    name: str
    toolchain: dict[str, Any]
    input_views: Mapping[torch.dtype, torch.dtype]
    neuron_spelling: bool

    def lowering(self) -> InlineCustomOps:
        """A fresh export-time lowering mode for one bucket (compiler/lower.py)."""

    def key_ingredients(self, stem: str) -> tuple[Any, dict[str, Any]]:
        """(flags, toolchain) of the cache keys of the bucket whose file stem is `stem`."""

    def compile(self, program: torch.export.ExportedProgram, out: Path, stem: str) -> None:
        """Compile one bucket's lowered program into the executable file `out`."""

    def bucket_facts(self, path: Path, stem: str) -> dict[str, Any] | None:
        """What the manifest records about the executable at `path` (compiled or cached), or None.
        A backend may also define side_files(path) -> {name: bytes}: files written beside it."""

    def compiler_record(self, custom_ops: dict[str, str], facts: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The manifest's `compiler` section from {op: "inline"|"call"} and {bucket file: facts}."""


class CpuBackend:
    """The cpu target: AOTInductor packages for this host (compiler/backend_cpu.py); the methods are
    `Backend`'s. flags: Inductor config overrides on top of backend_cpu.DEFAULT_FLAGS, one set for
    every bucket; the cache keys take the host toolchain whole (the package runs on this CPU only)."""

    target = "cpu"
    name = backend_cpu.BACKEND
    input_views = backend_cpu.INPUT_VIEWS
    neuron_spelling = False  # Inductor's float8 casts are the fastest spelling on this CPU

    def __init__(self, flags: dict[str, Any] | None):
        self.flags = backend_cpu.effective_flags(flags)
        self.toolchain = host_toolchain()

    def lowering(self) -> InlineCustomOps:
        return inline_mode(self.target)

    def key_ingredients(self, stem: str) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.flags, self.toolchain

    def warm_up(self) -> threading.Thread:
        """Start the per-process set-up of every compile in a thread (backend_cpu.warm_up)."""
        return backend_cpu.warm_up()

    def compile(self, program: torch.export.ExportedProgram, out: Path, stem: str) -> None:
        backend_cpu.compile_cpu(program, out, self.flags)

    def bucket_facts(self, path: Path, stem: str) -> None:
        return None

    def compiler_record(self, custom_ops: dict[str, str], facts: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {"backend": self.name, "flags": self.flags, "custom_ops": custom_ops}


def check_stablehlo_only(target: str) -> None:
    """Raise BundleError unless `--stablehlo-only` can go with `target` (neuron), CompileError when
    torch-mlir is not importable."""
    if target != "neuron":
        raise BundleError(f"--stablehlo-only goes with --target neuron (got --target {target})")
    from .stablehlo import require_torch_mlir

    require_torch_mlir()


def make_backend(target: str, flags: dict[str, Any] | None, stems: Sequence[str], stablehlo_only: bool = False) -> Backend:
    """The backend of `target` for the buckets with file stems `stems`; raises what the backend's
    checks raise (neuron: ConfigError for bad flags, CompileError, BundleError without neuronx-cc
    unless stablehlo_only); BundleError for an unknown target or stablehlo_only off neuron."""
    if stablehlo_only:
        check_stablehlo_only(target)
    if target == "cpu":
        return CpuBackend(flags)
    if target == "neuron":
        return (backend_neuron.StableHLOBackend if stablehlo_only else backend_neuron.NeffBackend)(flags, stems)
    raise BundleError(f"unknown target {target!r} (known: cpu, neuron)")


def compile_bundle(model_cfg: ModelConfig, compile_cfg: CompileConfig, out: Path, parts: ModelParts, *,
                   target: str = "cpu", force: bool = False, cache_dir: Path | None = None,
                   flags: dict[str, Any] | None = None, console: Console | None = None,
                   sign_key: Path | None = None, stablehlo_only: bool = False, label: str | None = None,
                   weight_shard_bytes: int = WEIGHT_SHARD_BYTES, bucket_workers: int | None = None) -> Path:
    """Compile every bucket of the plan for `target` and write the bundle atomically into `out`;
    returns `out`. sign_key: a PEM elliptic-curve private key; the bundle is then signed
    (runtime_min/bundle/signing.py) before it appears at `out`.

    flags: backend option overrides, part of every cache key: Inductor config keys on cpu
    (compiler/backend_cpu.py); on neuron {"target", "lnc", "args", "bucket_args"}
    (compiler/backend_neuron.py `plan_flags`).
    stablehlo_only: with target "neuron", stop at each bucket's StableHLO module (compiler/stablehlo.py;
    torch-mlir, not the Neuron SDK): the bundle runs on XLA:CPU as a check (executor_stablehlo.py).
    cache_dir: compile cache root (default: $DSNEURON_CACHE_DIR or ~/.cache/dsneuron).
    label: what the closing line says was done (default "bundle written to <out>").
    weight_shard_bytes: the weights go into files of at most this many bytes of tensors
    (runtime_min/bundle/schema.py Manifest.weight_files; one weights.safetensors when they fit in one).
    bucket_workers: processes that export and compile single-graph buckets (default: one per core
    on neuron, 1 on cpu, whose buckets are staged).
    Raises ConfigError (bad plan or flags), BundleError (target or its tools unavailable),
    OutputExistsError (out exists without force), CompileError (model wiring, a kernel that cannot
    take its op's shapes), and lets KeyboardInterrupt through after removing the partial bundle;
    the old bundle in `out` is untouched by any failure.
    """
    console = console or Console(stderr=True)
    if not stablehlo_only:  # a StableHLO-only compile needs torch-mlir, not the SDK (make_backend checks it)
        check_target(target, "compile")
    if sign_key is not None:  # a bad key fails now, not after the compile
        from dsneuron.runtime_min.bundle.signing import check_private_key

        check_private_key(sign_key)
    plan = bucket_plan(compile_cfg, model_cfg, parts.steps, target)
    staged = is_staged(parts.steps, target)
    # a staged target's buckets run stage by stage, but for the drafter's: one graph of its own
    in_stages = {pb: staged and pb.kind != "draft" for pb in plan.buckets}
    rels = {pb: bucket_file(pb.kind, pb.batch, pb.length, "neuron-stablehlo" if stablehlo_only else target)
            for pb in plan.buckets}
    rels = {pb: rel.rsplit(".", 1)[0] if in_stages[pb] else rel  # the folder of its stage executables
            for pb, rel in rels.items()}
    stems = {pb: Path(rel).name.split(".")[0] for pb, rel in rels.items()}
    backend = make_backend(target, flags, list(stems.values()), stablehlo_only)
    out = Path(out)
    check_output(out, force)
    _check_weights(parts.weights)
    stored, load_casts = _stored_weights(parts.weights, parts.stored_dtypes, parts.sources)
    tok_files = [Path(p) for p in parts.tokenizer_files]
    if not tok_files or tok_files[0].name != "tokenizer.json" or not all(p.is_file() for p in tok_files):
        raise ConfigError(f"tokenizer files {[str(p) for p in tok_files]}: need an existing tokenizer.json first")
    try:
        json.dumps(parts.host_params, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CompileError(f"host preprocessing parameters are not plain JSON data ({e})") from None

    cache = CompileCache(cache_root(cache_dir))
    state = _state_entries(parts.steps, plan)
    fingerprint = getattr(parts.steps, "fingerprint", None)
    fp = fingerprint() if callable(fingerprint) else None
    host = set(parts.host_weights)
    wdigest = _weights_digest({n: t for n, t in parts.weights.items() if n not in host})
    buckets: list[Bucket] = []
    sc: StagedCompile | None = None
    custom_ops: dict[str, str] = {}
    weight_views: dict[str, str] = {}
    facts: dict[str, dict[str, Any]] = {}
    compiled = 0
    # the per-token stages of a batch size take any token count up to its largest prefill
    per_token_lens: dict[int, int] = {}
    for p in plan.buckets:
        if p.kind == "prefill":
            per_token_lens[p.batch] = max(per_token_lens.get(p.batch, 0), p.seq_len)
    with BundleWriter(out, force) as writer, _progress(console) as progress:
        tasks = {pb: progress.add_task(pb.label, status="waiting", total=1) for pb in plan.buckets}
        records: dict[PlannedBucket, dict[str, Any]] = {}
        todo: list[tuple[PlannedBucket, str | None]] = []  # single-graph buckets to export (prekey)
        for pb in plan.buckets:
            task, rel, stem = tasks[pb], rels[pb], stems[pb]
            key_flags, key_toolchain = backend.key_ingredients(stem)
            shape = {**dataclasses.asdict(pb),
                     **({"per_token_len": per_token_lens.get(pb.batch)} if in_stages[pb] else {})}
            prekey = pre_key(fp, shape, wdigest, key_flags, key_toolchain, target, backend.name) if fp else None
            if in_stages[pb]:
                if sc is None:
                    sc = StagedCompile(parts, backend, cache, (key_flags, key_toolchain, target))
                progress.update(task, status="planning")
                hit = sc.plan(pb, prekey, rel, per_token_lens.get(pb.batch))
                progress.update(task, status="cached" if hit else "waiting to compile", completed=hit)
                continue
            record = cache.get_alias(prekey) if prekey else None
            if record is None:
                todo.append((pb, prekey))
            else:
                records[pb] = {**record, "how": "cached"}
        if todo:
            t0 = time.perf_counter()
            # the neuron buckets (export and lowering: single-threaded Python) in a process per core;
            # the cpu target's single-graph path (stand-in models in tests) in this process
            workers = bucket_workers if bucket_workers is not None else \
                min(default_workers(), len(todo)) if target == "neuron" else 1

            def make(i: int) -> dict[str, Any]:
                pb, prekey = todo[i]
                return _make_bucket(parts, pb, backend, cache, prekey, stems[pb], tmp=writer.path(rels[pb]))

            def show(done: int, total: int) -> None:
                for pb, _ in todo:
                    if pb not in records:
                        progress.update(tasks[pb], status=f"{done} of {total} buckets made, {workers} processes, "
                                                          f"{time.perf_counter() - t0:.0f} s")
            for (pb, _), record in zip(todo, run_forked(len(todo), make, workers, show)):
                records[pb] = record
                compiled += record["how"] == "compiled"
        for pb in plan.buckets:
            if in_stages[pb]:
                continue
            record, rel, stem = records[pb], rels[pb], stems[pb]
            writer.copy_in(Path(record["artifact"]), rel)
            fact = backend.bucket_facts(writer.path(rel), stem)
            if fact is not None:
                facts[rel] = fact
            for side, data in getattr(backend, "side_files", lambda path: {})(writer.path(rel)).items():
                writer.path(f"{Path(rel).parent}/{side}").write_bytes(data)
            custom_ops.update(record["custom_ops"])
            weight_views.update(record["views"])
            buckets.append(Bucket(kind=pb.kind, batch=pb.batch, seq_len=pb.seq_len, capacity=pb.capacity, file=rel,
                                  weights=tuple(record["weights"]),
                                  inputs=tuple(TensorSpec.from_dict(x, "inputs") for x in record["inputs"]),
                                  outputs=tuple(TensorSpec.from_dict(x, "outputs") for x in record["outputs"]),
                                  cache_key=record["graph_key"]))
            progress.update(tasks[pb], status=record["how"], completed=1)
        if sc is not None:
            todo = {pb for t in sc.tasks for pb in t.buckets}
            t0 = time.perf_counter()
            workers = min(default_workers(), len(sc.tasks))

            def show(done: int, total: int) -> None:
                status = f"{done} of {total} executables made, {workers} processes, {time.perf_counter() - t0:.0f} s"
                if isinstance(progress, _LogProgress):  # the executables are shared: one line, not one per bucket
                    progress.note(f"{', '.join(sorted(pb.label for pb in todo))}: {status}")
                    return
                for pb in todo:
                    progress.update(tasks[pb], status=status)
            sc.run(workers, show)
            compiled += sc.compiled
            for pb in plan.buckets:
                if not in_stages[pb]:
                    continue
                buckets.append(sc.bucket(pb, writer, rels[pb]))
                custom_ops.update(sc.records[pb]["custom_ops"])
                weight_views.update(sc.records[pb]["views"])
                progress.update(tasks[pb], completed=1)
        order = {(pb.kind, pb.batch, pb.length): i for i, pb in enumerate(plan.buckets)}
        buckets.sort(key=lambda b: order[(b.kind, b.batch, b.length)])  # the plan's order, staged or not
        used = {n for b in buckets for n in (*b.weights, *(w for st in b.stages for w in st.weights))}
        recipes = tuple(r for r in parts.prepare if set(r.outputs) & used)
        made = {n for r in recipes for n in r.outputs}
        keep = (used - made) | {n for r in recipes for n in (*r.weights, *r.scales)} | host
        weight_files = writer.write_weight_shards({n: t for n, t in stored.items() if n in keep}, weight_shard_bytes)
        for p in tok_files:
            writer.copy_in(p, f"{TOKENIZER_DIR}/{p.name}")
        manifest = Manifest(
            target=target, toolchain=backend.toolchain,
            compiler={**backend.compiler_record(dict(sorted(custom_ops.items())), facts),
                      **({"gemm_order": parts.steps.order} if hasattr(parts.steps, "order") else {}),
                      **({"indexer": parts.steps.indexer} if hasattr(parts.steps, "indexer") else {}),
                      **({"shard": shard_record(*parts.steps.shard)}
                         if getattr(parts.steps, "shard", None) else {})},
            model_config=model_cfg.to_dict(), compile_config=compile_cfg.to_dict(),
            tokenizer=Tokenizer(files=tuple(f"{TOKENIZER_DIR}/{p.name}" for p in tok_files),
                                bos_token_id=model_cfg.bos_token_id, eos_token_id=model_cfg.eos_token_id,
                                pad_token_id=model_cfg.eos_token_id, add_bos=True),
            host_preprocessing=dict(parts.host_params), state=state, buckets=tuple(buckets), files={},
            weights_file=WEIGHTS, created_by=f"dsneuron {dsneuron.__version__}",
            load_casts={n: d for n, d in load_casts.items() if n in used}, weight_views=dict(sorted(weight_views.items())),
            prepare=recipes, weight_files=weight_files, numerics=compile_cfg.numerics,
            schema_version=max(WEIGHT_FILES_SCHEMA_VERSION if weight_files else SCHEMA_VERSION,
                               CHUNK_SCHEMA_VERSION if plan.chunk else SCHEMA_VERSION,
                               SPECULATIVE_SCHEMA_VERSION if plan.verify or plan.draft else SCHEMA_VERSION,
                               NUMERICS_SCHEMA_VERSION if compile_cfg.numerics != "exact" else SCHEMA_VERSION,
                               IN_PLACE_SCHEMA_VERSION if any(map(written_in_place, buckets)) else SCHEMA_VERSION))
        from dsneuron.runtime_min.bundle.signing import sign_bundle

        path = writer.commit(manifest, None if sign_key is None else lambda folder: sign_bundle(folder, sign_key))
    # a per-token executable is copied into every bucket of its batch size: count it once
    n_exe = (len({k for rec in sc.records.values() for k in rec["kinds"].values()}) if sc else 0) + \
        sum(not in_stages[pb] for pb in plan.buckets)
    console.print(f"{label or f'bundle written to {path}'} ({compiled} of {n_exe} executables compiled, {n_exe - compiled} from "
                  f"the cache at {cache.root})")
    return path


def _make_bucket(parts: ModelParts, pb: PlannedBucket, backend: Backend, cache: CompileCache, prekey: str | None,
                 stem: str, tmp: Path) -> dict[str, Any]:
    """Export one single-graph bucket, key it and, on a cache miss, compile it into the cache
    (through `tmp`, its place in the unfinished bundle); returns its record (compiler/cache.py's
    front index entry) with "artifact" (the cached file) and "how" ("compiled" | "cached by graph").
    Runs in a forked worker (staged.run_forked) or in the compiling process."""
    key_flags, key_toolchain = backend.key_ingredients(stem)
    record, program = export_bucket(parts, pb, backend)
    record["graph_key"] = cache_key(normalised_graph(program), key_flags, key_toolchain, backend.target, backend.name)
    artifact = cache.get(record["graph_key"])
    how = "cached"
    if artifact is None:
        backend.compile(program, tmp, stem)
        artifact = cache.put(record["graph_key"], tmp)
        tmp.unlink()
        how = "compiled"
    if prekey:
        cache.put_alias(prekey, record)
    return {**record, "artifact": str(artifact), "how": how}


def dynamic_prefill_step(model_cfg: ModelConfig) -> int:
    """The token step of a dynamic prefill: the lcm of the compress ratios (as the static prefill
    buckets are multiples of it) and of the candidate source's ratio times candidate_block_size,
    so the graph has no floor division of the token count (the compressed groups and the
    candidate blocks tile it exactly); the export's example is the largest length, so no
    dimension is specialised at 1 (compiler/export.py). A prompt is padded up to the next
    multiple, exact by the model's padding invariance."""
    ratios = [r for r in model_cfg.compress_ratios[:model_cfg.n_layers] if r]
    if model_cfg.candidate_source_layer >= 0:
        ratios.append(model_cfg.compress_ratios[model_cfg.candidate_source_layer] * model_cfg.candidate_block_size)
    return max(2, math.lcm(*ratios or [1]))


def is_staged(steps: Any, target: str) -> bool:
    """Whether `target` compiles the buckets of `steps` (a StepFactory) stage by stage: the cpu
    target, for a factory that splits its steps into stages."""
    return target == "cpu" and callable(getattr(steps, "stages", None))


def bucket_plan(compile_cfg: CompileConfig, model_cfg: ModelConfig, steps: Any, target: str) -> BucketPlan:
    """The buckets `compile_bundle` compiles for `target`: the config's plan (plan_buckets, which
    raises ConfigError), with one dynamic prefill bucket per batch size where the target is staged,
    chunk buckets where compile.chunked_prefill asks for them and `steps` can build them, and, for
    speculative decoding, verify buckets (1 + dspark_block_size tokens; on a staged target the chunk
    buckets' shapes, their head at every position) and, where `steps` holds the drafter, its draft
    buckets (one graph each, on a staged target too)."""
    plan = plan_buckets(compile_cfg, model_cfg)
    staged = is_staged(steps, target)
    if staged:
        plan = plan.with_dynamic_prefill(dynamic_prefill_step(model_cfg))
    if compile_cfg.chunked_prefill and (staged or callable(getattr(steps, "chunk", None))):
        plan = plan.with_chunks()
    if compile_cfg.speculative == "dspark" and (plan.chunk if staged else callable(getattr(steps, "verify", None))):
        plan = plan.with_verify(1 + model_cfg.dspark_block_size)
    if compile_cfg.speculative == "dspark" and getattr(steps, "drafter", None) is not None:
        plan = plan.with_draft(model_cfg.dspark_block_size)
    return plan


def step_graph(steps: Any, pb: PlannedBucket) -> StepGraph:
    """The single-graph step of bucket `pb` (prefill, decode, chunk, verify or draft) from a
    StepFactory. Raises CompileError for a bucket kind the factory has no graph of."""
    if pb.kind == "prefill":
        return steps.prefill(pb.batch, pb.seq_len, pb.capacity)
    if pb.kind == "decode":
        return steps.decode(pb.batch, pb.capacity)
    if not callable(getattr(steps, pb.kind, None)):
        raise CompileError(f"{pb.label}: this model's steps have no {pb.kind} graph")
    return getattr(steps, pb.kind)(pb.batch, pb.seq_len, pb.capacity)


def export_bucket(parts: ModelParts, pb: PlannedBucket, backend: Backend) -> tuple[dict[str, Any], torch.export.ExportedProgram]:
    """Export one bucket with the backend's lowering; returns (the bucket's manifest facts as plain
    data, the program). The facts are what the cache's front index stores."""
    graph = step_graph(parts.steps, pb)
    mode = backend.lowering()
    exported = export_step(graph, parts.weights, pb.label, backend.input_views, mode,
                           neuron_spelling=backend.neuron_spelling)
    record = {"weights": list(exported.weights), "inputs": [s.to_dict() for s in exported.inputs],
              "outputs": [s.to_dict() for s in exported.outputs],
              "views": {n: dtype_name(d) for n, d in exported.views.items()},
              "custom_ops": finish(exported.program, mode, pb.label)}
    return record, exported.program


def _weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """sha256 of the weights' names, shapes and dtypes (not their values: those are inputs)."""
    spec = [(n, list(t.shape), dtype_name(t.dtype)) for n, t in weights.items()]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()


class _LogProgress:
    """Progress for a console that is not a terminal (nohup, CI, `> log`): one flushed line per
    status change as it happens, where rich's live display would print only at the end."""

    def __init__(self, console: Console):
        self.console, self.names, self.status = console, [], []

    def __enter__(self) -> "_LogProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, description: str, status: str, total: int = 1) -> int:
        self.names.append(description)
        self.status.append(None)
        self.update(len(self.names) - 1, status=status)
        return len(self.names) - 1

    def update(self, task: int, status: str | None = None, completed: int | None = None) -> None:
        if status is not None and status != self.status[task]:
            self.status[task] = status
            self.note(f"{self.names[task]}: {status}")

    def note(self, line: str) -> None:
        """Print one line now (flushed)."""
        self.console.print(line, highlight=False, soft_wrap=True)
        self.console.file.flush()


def _progress(console: Console) -> Progress | _LogProgress:
    if not console.is_terminal:
        return _LogProgress(console)
    return Progress(SpinnerColumn(), TextColumn("{task.description:<18}"), TextColumn("{task.fields[status]}"),
                    TimeElapsedColumn(), console=console, transient=False)


def _check_weights(weights: dict[str, torch.Tensor]) -> None:
    """Weights must be contiguous and not alias each other (safetensors stores each exactly once)."""
    seen: dict[tuple[int, int], str] = {}
    for name, t in weights.items():
        if not t.is_contiguous():
            raise CompileError(f"weight {name}: not contiguous; the bundle stores and passes weights contiguous")
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if t.numel() and key in seen:
            raise CompileError(f"weight {name}: shares storage with {seen[key]}; pass tied weights once")
        seen[key] = name


def _stored_weights(weights: dict[str, torch.Tensor], stored_dtypes: dict[str, torch.dtype],
                    sources: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """(what to write per weight: a tensor or a weight source, {name: dtype name the runtime casts
    back to}); nothing is read from a weight that has a source. Raises CompileError when a
    narrowing is not exact (the stored bytes must reproduce the model's tensor), or when a source
    names no weight or differs from its weight in shape or from its stored dtype."""
    sources = sources or {}
    unknown = sorted(set(stored_dtypes) - set(weights)) or sorted(set(sources) - set(weights))
    if unknown:
        what = "stored_dtypes" if unknown[0] in stored_dtypes else "sources"
        raise CompileError(f"{what} names {unknown[0]!r}, which is not a weight")
    stored, casts = {}, {}
    for name, t in weights.items():
        want = stored_dtypes.get(name, t.dtype)
        src = sources.get(name)
        if src is not None:
            if tuple(src.shape) != tuple(t.shape) or src.dtype != want:
                raise CompileError(f"weight {name}: its source is {dtype_name(src.dtype)} {list(src.shape)}, the weight "
                                   f"is stored as {dtype_name(want)} {list(t.shape)}")
            stored[name] = src
            if want != t.dtype:
                casts[name] = dtype_name(t.dtype)
            continue
        if want == t.dtype:
            stored[name] = t
            continue
        narrow = t.to(want)
        if not torch.equal(narrow.to(t.dtype), t):
            raise CompileError(f"weight {name}: storing {dtype_name(t.dtype)} as {dtype_name(want)} is not exact")
        stored[name], casts[name] = narrow, dtype_name(t.dtype)
    return stored, casts


def _state_entries(steps: StepFactory, plan: BucketPlan) -> tuple[StateEntry, ...]:
    """The state layout with fill values, from init_state at the smallest bucket; every state tensor
    must be one constant (the runtime rebuilds it from the manifest) and keep its name, dtype and
    order at every capacity."""
    def at(capacity: int) -> dict[str, torch.Tensor]:
        return steps.init_state(plan.batch_sizes[0], capacity)

    first = at(plan.decode_capacities[0])
    entries = []
    for name, t in first.items():
        flat = t.reshape(-1)
        if flat.numel() and not bool((flat == flat[0]).all()):  # NaN fails too: it equals nothing
            raise CompileError(f"state {name}: init_state is not one constant (non-NaN) value; the runtime "
                               "re-creates states from a fill value per tensor")
        fill = float(flat[0]) if flat.numel() else 0.0
        entries.append(StateEntry(name, dtype_name(t.dtype), fill))
    for c in plan.decode_capacities[1:]:
        other = at(c)
        if [(n, t.dtype) for n, t in other.items()] != [(n, t.dtype) for n, t in first.items()]:
            raise CompileError(f"init_state at capacity {c}: state names, order or dtypes differ from capacity "
                               f"{plan.decode_capacities[0]}")
    return tuple(entries)

