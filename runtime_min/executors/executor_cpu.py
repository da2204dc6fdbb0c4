"""cpu executor: run one bucket's AOTInductor package (`.pt2`) with the shared weights.

The package is opened with the C++ loader `torch._C._aoti.AOTIModelPackageLoader`, not
`torch._inductor.aoti_load_package`: the Python wrapper also deserialises any exported programs and
weights a `.pt2` may carry (with torch.load), while the C++ loader only extracts and dlopens the
compiled model. Before loading, the archive's member list is checked to hold nothing but the
AOTInductor model and archive metadata, so no pickle can ride along.

Custom ops lowered as "call" (compiler/lower.py) are dispatched through the registered op at run
time; the ops of the `dsneuron` namespace are registered by importing `dsneuron.kernels_nki`.
"""

from __future__ import annotations

import importlib
import json
import time
import zipfile
from pathlib import Path
from typing import Any, Sequence

import torch

from ..bundle.schema import Bucket, BundleError, engram_columns, written_in_place

_ARCHIVE_META = {"archive_format", "archive_version", ".data/version", "byteorder", ".data/serialization_id"}
#: the modules that register a namespace's ops, imported in order until the op exists (the cpu
#: GEMM kernels are a C++ extension built on first import, so only bundles that call them pay it)
_OP_MODULES = {"dsneuron": ("dsneuron.kernels_nki", "dsneuron.kernels_nki.cpu_gemm", "dsneuron.kernels_nki.cpu_attn",
                           "dsneuron.kernels_nki.cpu_gemm_fast", "dsneuron.runtime_min.executors.collectives")}


def check_archive(path: Path) -> None:
    """Raise BundleError unless `path` is a zip holding only an AOTInductor model and metadata."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except zipfile.BadZipFile:
        raise BundleError(f"{path.name}: not an AOTInductor package (not a zip archive)") from None
    for name in names:
        _, _, inner = name.partition("/")
        if name.endswith("/"):
            continue
        if inner in _ARCHIVE_META or inner.startswith("data/aotinductor/"):
            if not name.endswith((".pkl", ".pt")):
                continue
        raise BundleError(f"{path.name}: unexpected archive member {name!r} (only AOTInductor models are loaded)")


def _argument_count(in_spec: str) -> int | None:
    """Positional arguments of an AOTInductor model from its serialised input pytree spec
    (`[version, {"type": "builtins.tuple", "children_spec": [args tuple, kwargs dict]}]`); None when
    the spec has another form, since it is torch's internal format and only a cross-check here."""
    try:
        args = json.loads(in_spec)[1]["children_spec"][0]
        return len(args["children_spec"]) if args["type"] == "builtins.tuple" else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def register_custom_ops(custom_ops: dict[str, str]) -> None:
    """Make every op lowered as "call" dispatchable; raises BundleError naming an op that is not."""
    for op, mode in custom_ops.items():
        if mode != "call":
            continue
        ns, _, rest = op.partition("::")
        name = rest.split(".")[0]
        for module in _OP_MODULES.get(ns, ()):
            if hasattr(getattr(torch.ops, ns), name):
                break
            importlib.import_module(module)
        if not hasattr(getattr(torch.ops, ns), name):
            raise BundleError(f"the bundle's executables call custom op {op} at run time, but no loaded module "
                              "registers it")


def _load_package(path: Path, what: str, n_weights: int, n_inputs: int):
    """The AOTInductor model of package `path`, checked (`check_archive`) and cross-checked to take
    n_weights + n_inputs arguments (`_check_arguments`); raises BundleError naming `what`."""
    check_archive(path)
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except RuntimeError as e:
        raise BundleError(f"{what}: the AOTInductor loader refused it ({e})") from None
    _check_arguments(loader, what, n_weights, n_inputs)
    return loader


def _check_arguments(loader: Any, what: str, n_weights: int, n_inputs: int) -> None:
    """Raises BundleError when the loaded model does not take n_weights + n_inputs arguments."""
    takes = _argument_count(loader.get_call_spec()[0])
    if takes is not None and takes != n_weights + n_inputs:
        raise BundleError(f"{what}: the executable takes {takes} arguments, the manifest gives it "
                          f"{n_weights} weights + {n_inputs} inputs")


#: omp_pause_resource_all's "hard" kind: free the thread pool itself (OpenMP 5.0, omp_pause_resource_t)
_OMP_PAUSE_HARD = 2


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP worker threads (`omp_pause_resource_all(omp_pause_hard)`,
    OpenMP 5.0 section 3.2.44, in the libgomp that torch ships); returns True when freed, False
    where there is no such libgomp. The executables' parallel regions then get a pool of their own
    thread's. Call it on the thread that loaded a bundle before another thread runs the steps
    (`dsneuron serve`'s engine): libgomp counts the threads of every pool, and with the loading
    thread's pool alive the stepping thread's team outnumbers the CPUs, so its workers sleep after
    about a hundred spins instead of 300,000 and each of a decode step's ~100 parallel regions waits
    for a futex wake-up. Measured on tiny (2 cores): a GEMV took 582 against 454 us with and without
    the idle pool, and a served stream decoded at 0.69x `dsneuron run`."""
    import ctypes

    libs = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    if not libs:
        return False
    try:
        pause = ctypes.CDLL(str(libs[0])).omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    return pause(_OMP_PAUSE_HARD) == 0


class CpuExecutable:
    """One loaded bucket (a runtime_min/core/runner.py Executable). `run(inputs)` takes the data+state
    inputs of `bucket.inputs` (the weights are bound at construction) and returns the outputs of
    `bucket.outputs`. Construction raises
    BundleError when the archive holds more than a model (`check_archive`), the loader refuses it,
    or the model takes another number of arguments than the manifest's weights + inputs."""

    def __init__(self, path: Path, bucket: Bucket, weights: list[torch.Tensor]):
        self.bucket = bucket
        self.weights = weights
        self._loader = _load_package(path, bucket.file, len(weights), len(bucket.inputs))

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """inputs: tensors matching `bucket.inputs` exactly (shape, dtype); raises ValueError otherwise,
        since the compiled code indexes memory by the static shapes."""
        self.bucket.check_inputs(inputs)
        return self._loader.boxed_run([*self.weights, *inputs])


class StagedExecutable:
    """A staged bucket (schema.py): one loaded package per stage kind, run stage by stage. Same
    interface as CpuExecutable; `weights` maps every weight name a stage takes to its tensor. A
    state tensor that the bucket returns but no stage outputs is one a stage writes in place: `run`
    gives the stages a copy of it, so the caller's inputs are never changed.
    Construction raises BundleError as CpuExecutable does, per stage file.

    A call with valid_len (prefill, chunk, verify) runs the per-token stages on the rows up to its
    largest valid_len only (`_run_rows`).

    stage_seconds: None, or a dict that `run` then adds each stage's wall seconds to, keyed by
    stage name (`layers.3.ffn`): the benchmark's per-stage table (bench/bundle.py)."""

    def __init__(self, root: Path, bucket: Bucket, weights: dict[str, torch.Tensor]):
        self.bucket = bucket
        self.stage_seconds: dict[str, float] | None = None
        loaders: dict[str, Any] = {}
        self._stages = []
        for st in bucket.stages:
            if st.file not in loaders:
                loaders[st.file] = _load_package(root / st.file, st.file, len(st.weights), len(st.inputs))
            else:  # a file shared by stages of one kind: each stage must fit its signature too
                _check_arguments(loaders[st.file], f"stage {st.name} ({st.file})", len(st.weights), len(st.inputs))
            # a per-token stage runs on the valid rows alone where its outputs can be put back at the
            # call's rows (`_run_rows`): the embedding's h is made from the tokens, so it runs whole
            rows_only = st.per_token and bucket.min_seq_len > 0 and set(st.outputs) <= {*st.inputs, "logits"}
            self._stages.append((loaders[st.file], [weights[n] for n in st.weights], st.inputs, st.outputs, rows_only))
        # copied before the stages run, so that the caller's tensors stay as they were (a Step keeps
        # its input state)
        self._written = written_in_place(bucket)
        self._columns = any(n.startswith("engram_ids.") for st in bucket.stages for n in st.inputs)
        self._last = any("last" in st.inputs for st in bucket.stages)

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """As CpuExecutable.run: inputs of `bucket.inputs`, outputs of `bucket.outputs`."""
        return self.run_tapped(inputs, ())[0]

    def run_tapped(self, inputs: list[torch.Tensor], taps: Sequence[str], skip: Sequence[str] = ()
                   ) -> tuple[list[torch.Tensor | None], dict[str, dict[str, torch.Tensor]]]:
        """`run`, plus the inputs each stage named in `taps` was given: {stage name: {wiring name:
        tensor}} (a speculative verify reads the stream entering the DSpark target layers and the
        head's inputs, runtime_min/core/speculative.py). The stages named in `skip` do not run and
        their outputs come back None: a verify runs the head at every position itself, so the
        bucket's own head (one position a row, a read of the whole vocabulary projection) would be
        wasted. Raises KeyError for a stage the bucket lacks; ValueError when a stage that runs
        takes a skipped stage's output."""
        names = {st.name for st in self.bucket.stages}
        missing = [t for t in (*taps, *skip) if t not in names]
        if missing:
            raise KeyError(f"{self.bucket.file}: no stage {missing[0]!r} to tap or skip")
        unmade: set[str] = set()  # the values a skipped stage would have written last
        for st in self.bucket.stages:
            if st.name in skip:
                unmade |= set(st.outputs)
            elif unmade & set(st.inputs):
                raise ValueError(f"{self.bucket.file}: stage {st.name} takes an output of a skipped stage")
            else:
                unmade -= set(st.outputs)
        self.bucket.check_inputs(inputs)
        env = {spec.name: t for spec, t in zip(self.bucket.inputs, inputs)}
        env.update({n: env[n].clone() for n in self._written})
        if self._columns:
            env.update(engram_columns(env["engram_ids"]))
        if self._last:  # the position the head reads (schema.py DERIVED_INPUTS)
            env["last"] = env["valid_len"] - 1 if "valid_len" in env else torch.zeros_like(env["pos"])
        timed = self.stage_seconds
        tapped: dict[str, dict[str, torch.Tensor]] = {}
        # the token rows a call computes in its per-token stages: up to its largest valid_len
        S = env["tokens"].size(1) if "tokens" in env else 0
        rows = int(env["valid_len"].max()) if "valid_len" in env and S else S
        for st, (loader, weights, names_in, names_out, per_token) in zip(self.bucket.stages, self._stages):
            if st.name in taps:
                tapped[st.name] = {n: env[n] for n in names_in}
            if st.name in skip:
                continue
            t0 = time.perf_counter() if timed is not None else 0.0
            if per_token and 0 < rows < S:
                env.update(_run_rows(loader, weights, names_in, names_out, env, rows, S))
            else:
                env.update(zip(names_out, loader.boxed_run([*weights, *[env[n] for n in names_in]])))
            if timed is not None:
                timed[st.name] = timed.get(st.name, 0.0) + time.perf_counter() - t0
        return [None if spec.name in unmade else env[spec.name] for spec in self.bucket.outputs], tapped

    def run_stage(self, name: str, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Run the stage `name` alone on `values` (its wiring inputs by name) -> its outputs (the
        head at another position of the same stream). Raises KeyError for an unknown stage."""
        for st, (loader, weights, names_in, *_) in zip(self.bucket.stages, self._stages):
            if st.name == name:
                return loader.boxed_run([*weights, *[values[n] for n in names_in]])
        raise KeyError(f"{self.bucket.file}: no stage {name!r}")


def _run_rows(loader: Any, weights: list[torch.Tensor], names_in: Sequence[str], names_out: Sequence[str],
              env: dict[str, torch.Tensor], rows: int, S: int) -> dict[str, torch.Tensor]:
    """A per-token stage (schema.Stage.per_token) of a call of S token rows run on its first `rows`
    (the largest valid_len: the rows past it are padding, which no valid position reads) -> its
    outputs at S rows again: an output that is also a token-row input (the stream h, pre_mix)
    keeps that input's padding rows as they came in, the head's logits at every position [B, S, V]
    get zeros there. (A verify of 1 + 5 tokens runs at 8, the step of tiny's chunk graphs, so its
    MoE halves, engram and head did a third more work than anything reads.) Each kept row has the
    bits the full call gives it: a per-token stage computes a row from that row alone (the
    kernels' batch invariance, docs/numerics.md)."""
    cut = {n: env[n][:, :rows].contiguous() for n in names_in if env[n].dim() >= 2 and env[n].size(1) == S}
    outs = loader.boxed_run([*weights, *[cut.get(n, env[n]) for n in names_in]])
    full = {}
    for n, t in zip(names_out, outs):
        if n in cut:
            t = torch.cat([t, env[n][:, rows:]], dim=1)
        elif n == "logits" and t.dim() == 3:
            t = torch.cat([t, t.new_zeros(t.size(0), S - rows, t.size(2))], dim=1)
        full[n] = t
    return full
