"""Staged buckets (runtime_min/bundle/schema.py): one executable per stage kind and bucket, made in parallel.

A staged bucket runs its model's stages in order (graphs/stages.py); stages of one kind share one
executable, exported from the kind's first stage and reused by every stage of that kind with its
own weights. So a bucket needs as many executables as its model has stage kinds, whatever its
number of layers, and `StagedCompile` makes them like this:

1. `plan` each bucket: on a front-index hit (compiler/cache.py `pre_key`) its record comes from the
   cache and nothing is exported; otherwise its stage graphs are built and one task is queued per
   stage kind;
2. `run` the tasks, in forked worker processes, one per core: each exports its stage graph with the
   backend's lowering, keys it, and compiles it into the compile cache unless the key is there
   already. An export and an AOTInductor compile are single-threaded Python plus one g++ run, so
   processes are what uses the cores. The workers are forked, not spawned, so they inherit the
   model and the stage graphs in memory (nothing is serialised), and they run torch
   single-threaded (the parent's OpenMP pool must not be entered in a fork);
3. `bucket`: the manifest entry, with the executables copied from the cache into the bundle and
   the record written to the front index.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from dsneuron.runtime_min.bundle.schema import (DATA_INPUTS, PROBE_PREFIX, Bucket, Stage, TensorSpec, bucket_file,
                                                dtype_name)

from .buckets import PlannedBucket
from .bundle_writer import BundleWriter
from .cache import CompileCache, cache_key, normalised_graph
from .export import CompileError, StageGraph, bind_weights, export_step
from .lower import finish


@dataclass
class _Task:
    """One executable to make: the stage graph of a kind's first stage in a bucket, and every
    bucket that runs it (more than one for a per-token kind: all buckets of its batch size)."""

    bucket: PlannedBucket
    kind: str
    graph: StageGraph
    label: str
    buckets: list[PlannedBucket] = field(default_factory=list)


@dataclass
class StagedCompile:
    """The staged buckets of one compile (module docstring). parts: compile.ModelParts; backend:
    compile.Backend; key_parts: (flags, toolchain, target) of the cache keys."""

    parts: Any
    backend: Any
    cache: CompileCache
    key_parts: tuple
    records: dict[PlannedBucket, dict[str, Any]] = field(default_factory=dict)
    tasks: list[_Task] = field(default_factory=list)
    owners: dict[tuple, _Task] = field(default_factory=dict)
    compiled: int = 0
    #: the backend's warm-up (an optional `warm_up() -> Thread` of the backend), started by the first
    #: bucket to compile and joined before the workers are forked
    warming: threading.Thread | None = None

    def plan(self, pb: PlannedBucket, prekey: str | None, folder: str, per_token_len: int | None = None) -> bool:
        """Queue what bucket `pb` needs; returns True when its record came from the front index.
        per_token_len: the token range of the per-token stage kinds of pb's batch size (the largest
        prefill of that batch), whose executables every bucket of that batch size shares; None
        compiles them at pb's own shape."""
        record = self.cache.get_alias(prekey) if prekey else None
        if record is not None:
            self.records[pb] = record
            return True
        if self.warming is None and hasattr(self.backend, "warm_up"):
            self.warming = self.backend.warm_up()
        graphs = self.parts.steps.stages(pb.kind, pb.batch, pb.seq_len, pb.capacity, pb.min_seq_len, pb.seq_len_step,
                                         per_token_len)
        ext = Path(bucket_file(pb.kind, pb.batch, pb.length, self.key_parts[2])).suffix
        stages, views, specs, outputs = [], {}, {}, {}
        # a verify bucket's stages but its head are the chunk bucket's of its shape: one task makes both
        shares = replace(pb, kind="chunk") if pb.kind == "verify" else pb
        for sg in graphs:
            # a per-token kind is one task per batch size, the others one per bucket
            owner = ("per-token", pb.batch, sg.kind) if sg.per_token else (shares, sg.kind)
            if owner not in self.owners:
                self.owners[owner] = _Task(pb, sg.kind, sg, f"{pb.batch_label if sg.per_token else pb.label} {sg.name}")
                self.tasks.append(self.owners[owner])
            if pb not in self.owners[owner].buckets:
                self.owners[owner].buckets.append(pb)
            names, _ = bind_weights(sg.graph.module, self.parts.weights, sg.name, module_order=True)
            views.update({n: dtype_name(self.backend.input_views[self.parts.weights[n].dtype]) for n in names
                          if self.parts.weights[n].dtype in self.backend.input_views})
            stages.append({"name": sg.name, "kind": sg.kind, "file": f"{folder}/{sg.kind}{ext}", "weights": list(names),
                           "inputs": [n for n, _ in sg.graph.inputs], "outputs": list(sg.graph.outputs),
                           "per_token": sg.per_token})
            specs.update({n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for n, t in sg.graph.inputs})
            outputs.update({n: {"shape": list(shape), "dtype": dtype_name(dtype)}
                            for n, (shape, dtype) in zip(sg.graph.outputs, sg.output_specs)})
        E, C = _engram_cols(graphs)
        inputs = [{"name": "tokens", "shape": [pb.batch, pb.seq_len], "dtype": "int64"},
                  *({"name": n, "shape": [pb.batch], "dtype": "int64"} for n in DATA_INPUTS[pb.kind][1:-1]),
                  {"name": "engram_ids", "shape": [pb.batch, pb.seq_len, E, C], "dtype": "int64"}]
        if pb.kind != "prefill":
            inputs += [{"name": n, **specs[n]} for n in self.parts.steps.init_state(pb.batch, pb.capacity)]
        self.records[pb] = {"stages": stages, "inputs": inputs, "views": views, "prekey": prekey, "wiring": outputs}
        return False

    def run(self, workers: int, progress: Callable[[int, int], None]) -> None:
        """Make every queued executable (module docstring, step 2), `workers` at a time; calls
        progress(done, total) as they finish. Raises what a task raises."""
        global _RUNNING
        if self.warming is not None:
            self.warming.join()
        _RUNNING = self
        try:
            # the block halves first (the largest graphs; a source's attention more than a consumer's)
            order = sorted(range(len(self.tasks)), key=lambda i: (not self.tasks[i].kind.startswith(("attn", "ffn")),
                                                                  -len(self.tasks[i].kind)))
            results = run_forked(len(self.tasks), _make, workers, progress, order)
        finally:
            _RUNNING = None
        for task, res in zip(self.tasks, results):
            for pb in task.buckets:
                rec = self.records[pb]
                rec.setdefault("kinds", {})[task.kind] = res["key"]
                rec.setdefault("custom_ops", {}).update(res["custom_ops"])
            self.compiled += res["compiled"]

    def bucket(self, pb: PlannedBucket, writer: BundleWriter, folder: str) -> Bucket:
        """The manifest entry of `pb` (module docstring, step 3)."""
        record = self.records[pb]
        if "outputs" not in record:  # made here: its outputs' specs come from the bucket's trace
            specs = record.pop("wiring")
            state = [s["name"] for s in record["inputs"][len(DATA_INPUTS[pb.kind]):]] or \
                list(self.parts.steps.init_state(pb.batch, pb.capacity))
            probes = [n for st in record["stages"] for n in st["outputs"] if n.startswith(PROBE_PREFIX)]
            # a cache a decode stage writes in place is no stage's output: the bucket returns its input
            specs.update({x["name"]: {"shape": x["shape"], "dtype": x["dtype"]} for x in record["inputs"]
                          if x["name"] not in specs})
            record["outputs"] = [{"name": n, **specs[n]} for n in ("logits", *state, *probes)]
            prekey = record.pop("prekey")
            if prekey:
                self.cache.put_alias(prekey, record)
        for kind, key in record["kinds"].items():
            rel = f"{folder}/{kind}{Path(record['stages'][0]['file']).suffix}"
            if not writer.path(rel).exists():
                artifact = self.cache.get(key)
                if artifact is None:
                    raise CompileError(f"{pb.label}: executable {kind} is missing from the compile cache")
                writer.copy_in(artifact, rel)
        key = hashlib.sha256(json.dumps(record["kinds"], sort_keys=True).encode()).hexdigest()
        stages = tuple(Stage.from_dict({k: v for k, v in st.items() if k != "kind"}, "stages") for st in record["stages"])
        return Bucket(kind=pb.kind, batch=pb.batch, seq_len=pb.seq_len, capacity=pb.capacity, file=folder, weights=(),
                      inputs=tuple(TensorSpec.from_dict(x, "inputs") for x in record["inputs"]),
                      outputs=tuple(TensorSpec.from_dict(x, "outputs") for x in record["outputs"]),
                      cache_key=key, stages=stages, min_seq_len=pb.min_seq_len, seq_len_step=pb.seq_len_step)


#: the StagedCompile whose tasks are running, read by the forked workers
_RUNNING: StagedCompile | None = None
#: the task function of the running `run_forked`, read by its forked workers
_TASK: Callable[[int], Any] | None = None


def run_forked(total: int, task: Callable[[int], Any], workers: int, progress: Callable[[int, int], None],
               order: list[int] | None = None) -> list[Any]:
    """[task(0), ..., task(total - 1)], made by `workers` forked processes (in this process with
    one worker or one task, or once a threaded runtime is up: `threaded_runtimes`), started in
    `order` (default ascending); calls progress(done, total)
    as they finish. Forked, not spawned: the workers inherit everything in memory, the model
    included, and run torch single-threaded (`_worker_init`). Raises what a task raises, after
    stopping the other workers."""
    global _TASK
    if workers <= 1 or total <= 1 or threaded_runtimes():
        results = []
        for i in range(total):
            results.append(task(i))
            progress(i + 1, total)
        return results
    _TASK = task
    ctx = multiprocessing.get_context("fork")
    pool = concurrent.futures.ProcessPoolExecutor(min(workers, total), mp_context=ctx, initializer=_worker_init)
    try:
        futures = {pool.submit(_run_task, i): i for i in (order or range(total))}
        results = [None] * total
        for done, f in enumerate(concurrent.futures.as_completed(futures), 1):
            results[futures[f]] = f.result()
            progress(done, total)
    except BaseException:
        # Ctrl-C, SIGTERM or a failed task: stop the workers now instead of letting the pool
        # finish (or hang on) its queue
        for proc in list((pool._processes or {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        _TASK = None
    pool.shutdown()
    return results


def threaded_runtimes() -> list[str]:
    """The runtimes of this process that own threads a fork would copy in an unknown state: JAX
    once its XLA client is up (runtime_min/executors/executor_stablehlo.py starts it), whose own warning says
    a fork then "will likely lead to a deadlock". torch's OpenMP pool is not one of them: the
    workers never enter it (`_worker_init`)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return []
    try:
        from jax._src import xla_bridge  # no public query for "a backend is initialised"
        up = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        up = True  # a jax without that query: assume its threads run
    return ["jax"] if up else []


def _run_task(i: int) -> Any:
    return _TASK(i)


def _worker_init() -> None:
    """A worker runs torch single-threaded and leaves Ctrl-C to the parent, which terminates it;
    SIGTERM gets its default action back (the CLI's handler, inherited through fork, would turn the
    parent's terminate() into an exception inside the task and let the worker take the next one)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(1)


def _make(i: int) -> dict[str, Any]:
    """Export, key and (on a cache miss) compile task i of the running StagedCompile."""
    sc = _RUNNING
    task = sc.tasks[i]
    flags, toolchain, target = sc.key_parts
    mode = sc.backend.lowering()
    exported = export_step(task.graph.graph, sc.parts.weights, task.label, sc.backend.input_views, mode,
                           module_order=True)
    custom_ops = finish(exported.program, mode, task.label)
    key = cache_key(normalised_graph(exported.program), flags, toolchain, target, sc.backend.name)
    compiled = False
    if sc.cache.get(key) is None:
        ext = Path(bucket_file(task.bucket.kind, task.bucket.batch, task.bucket.length, target)).suffix
        with sc.cache.build_folder() as tmp:
            out = Path(tmp) / f"{task.kind}{ext}"  # the archive's folder is named after the file
            sc.backend.compile(exported.program, out, out.stem)
            sc.cache.put(key, out)
        compiled = True
    return {"key": key, "custom_ops": custom_ops, "compiled": compiled}


def _engram_cols(graphs: list[StageGraph]) -> tuple[int, int]:
    """(E, C) of the engram_ids input: one column per engram stage input engram_ids.e, C from its shape."""
    cols = {n: t for sg in graphs for n, t in sg.graph.inputs if n.startswith("engram_ids.")}
    return len(cols), (next(iter(cols.values())).shape[-1] if cols else 0)


def default_workers() -> int:
    """Worker processes: one per core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
