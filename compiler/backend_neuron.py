"""neuron backend: each bucket's exported step -> torch-neuronx HLO with NKI kernels -> neuronx-cc -> NEFF.

NOT RUN ON HARDWARE. Everything below the SDK seam (`compile_neff`) follows the public sources
cited at each step and has never been executed here (the Neuron SDK is not installable on this
host); the rest (flags, keys, lowering, bundle assembly) is tested with a stand-in for that seam.

Per bucket (the order of compiler/compile.py, so bad input fails before anything expensive):
1. torch.export on the host, as for cpu, with the neuron lowering: a custom op that has an NKI
   kernel (`NKI_KERNELS`) stays one graph node; any other custom op is inlined from its torch
   reference (compiler/lower.py `InlineCustomOps`), so it reaches XLA as ordinary ops.
2. Cache key (compiler/cache.py) from the normalised graph, this bucket's neuronx-cc arguments, the
   SDK versions plus the sources of the NKI kernel modules, and the target.
3. On a miss, `compile_neff`: the exported graph runs on the XLA device under `NkiDispatch`, which
   answers each kernel op by calling its `@nki.jit` kernel; a kernel call on XLA tensors records an
   HLO custom-call that neuronx-cc replaces by the kernel (aws-neuron-sdk:nki/guides/
   framework_custom_op.rst). torch-neuronx turns the trace into an HloModuleProto
   (`torch_neuronx.xla_impl.trace.generate_hlo`, called the way neuronx-distributed's
   trace/model_builder.py calls it), and `neuronx-cc compile --framework XLA` makes the NEFF
   (aws-neuron-sdk:compiler/neuronx-cc/how-to-generate-neff.rst). The kernels' compiled side files
   live in the `nki` package's temporary folders; tracing and compiling happen in one call, so they
   still exist when neuronx-cc reads them (neuron_toolchain.md 1.8).
4. The NEFF header is read back (runtime_min/neff.py): its lnc_size must be the requested --lnc,
   and the manifest records, per bucket, the flags and the header's lnc_size / feature_bits /
   version (`Manifest.compiler["neff"]`, runtime_min/neff.py `NeffRecord`).

Weights stay out of every NEFF: they are graph inputs (compiler/export.py) and live once in
weights.safetensors. Non-weight constants (RoPE tables) are inlined into the NEFF
(`inline_weights_to_neff=True`, the documented default of torch_neuronx.trace). fp8/e8m0 weights
cross the NEFF boundary as uint8 views (`INPUT_VIEWS`): torch-neuronx's MetaNeff dtype table has no
fp8 types (torch_neuronx/xla_impl/trace.py `hlo_metaneff`).

neuronx-cc arguments (`plan_flags`), lowest precedence first: the defaults `--model-type transformer
-O 1 --auto-cast none --lnc 1`, the target of this instance (trn1/trn2, from the EC2 product
name), $NEURON_CC_FLAGS (the SDK's own way to pass flags), then the `flags` given to
`compile_bundle`: {"target": "trn1"|"trn2", "lnc": 1|2, "args": "...", "bucket_args": {stem: "..."}}.
Why these defaults: `-O1` is neuronx-distributed's default and the documented way out of "Too many
instructions after unroll" (aws-neuron-sdk issue 749); `--auto-cast none` because every dtype change
in dsneuron graphs is explicit and neuronx-cc's default casts fp32 matmuls to bf16; `--lnc 1`
because the NKI kernels are written for one NeuronCore (an LNC=2 kernel launch needs a grid split
the kernels do not implement); on trn2 run with NEURON_LOGICAL_NC_CONFIG=1 or compile with --lnc 2.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from rich.console import Console
from torch.overrides import TorchFunctionMode

import dsneuron
from dsneuron.graphs.config import ConfigError, ModelConfig
from dsneuron.runtime_min.bundle import NEURON_INDEX, host_toolchain
from dsneuron.runtime_min.executor_neuron import SDK_DISTRIBUTIONS, sdk_versions
from dsneuron.runtime_min.neff import PRODUCT_NAME, NeffRecord, check_header, read_header
from dsneuron.runtime_min.schema import (TOKENIZER_DIR, WEIGHTS, Bucket, BundleError, Manifest, TensorSpec,
                                         Tokenizer, bucket_file, dtype_name)

from .buckets import PlannedBucket, plan_buckets
from .bundle_writer import BundleWriter, check_output
from .cache import CompileCache, _is_number, cache_key, default_cache_dir, normalised_graph, pre_key
from .compile import ModelParts, _check_weights, _progress, _state_entries, _stored_weights, _weights_digest
from .config import CompileConfig
from .export import CompileError, export_step
from .lower import InlineCustomOps, _custom_name, finish

BACKEND = "neuronx-cc"
TARGETS = ("trn1", "trn2")
# custom op -> "module:function" of its NKI kernel (kernels_nki, issue 7). The function takes the
# op's arguments in order and returns its result. Ops not listed are inlined from their reference:
# the V4.1 indexer's `mqa_logits_bf16` works on bf16 QDQ values, which no FP8/FP4 kernel takes.
NKI_KERNELS = {
    "dsneuron::sparse_attn": "dsneuron.kernels_nki.sparse_attn_nki:sparse_attn_kernel",
    "dsneuron::mqa_logits": "dsneuron.kernels_nki.mqa_logits_nki:mqa_logits_kernel",
    "dsneuron::mqa_logits_sparse": "dsneuron.kernels_nki.mqa_logits_nki:mqa_logits_sparse_kernel",
}
INPUT_VIEWS = {torch.float8_e8m0fnu: torch.uint8, torch.float8_e4m3fn: torch.uint8}
FLAGS_ENV = "NEURON_CC_FLAGS"
DEFAULT_ARGS = ("--model-type", "transformer", "-O", "1", "--auto-cast", "none", "--lnc", "1")
# Flags that take exactly one value, where the last one given wins (as neuronx-cc reads them);
# any other flag is kept at every occurrence (e.g. --tensorizer-options accumulates).
_SINGLE = {"--target", "--lnc", "-O", "--model-type", "--auto-cast", "--auto-cast-type"}
_ALIASES = {"--logical-nc-config": "--lnc", "-lnc": "--lnc", "--optlevel": "-O"}
_OWNED = {"--output", "--framework", "--logfile"}  # set by compile_neff itself
_FLAG_KEYS = {"target", "lnc", "args", "bucket_args"}


# ------------------------------------------------------------------------------------------ flags
_Groups = list[tuple[str, list[str]]]  # (flag name, its value tokens), in command-line order


@dataclass(frozen=True)
class NeuronFlags:
    """The neuronx-cc arguments of every bucket, canonical (`canonical_args`). common: those all
    buckets share (recorded as `compiler.flags`); per_bucket: {bucket file stem: its full list}."""

    common: tuple[str, ...]
    per_bucket: dict[str, tuple[str, ...]]
    lnc: int


def canonical_args(tokens: Sequence[str], where: str) -> tuple[str, ...]:
    """neuronx-cc arguments in one spelling, for the cache key and the manifest: aliases resolved
    (`-O2` = `-O 2` = `--optlevel=2`; `--logical-nc-config` = `-lnc` = `--lnc`), runs of whitespace
    inside a value collapsed, single-valued flags (`_SINGLE`) kept at their last value, flags sorted
    by name (a flag given several times keeps its occurrences in order), and each flag written as one
    token `--name=value` (`-ON` for the level) so that a value starting with "-" stays a value.
    Raises ConfigError naming `where` for a positional argument or a flag the backend sets itself
    (--output, --framework, --logfile)."""
    return _argv(_canonical(_parse(tokens, where)))


def _parse(tokens: Sequence[str], where: str) -> _Groups:
    groups: _Groups = []
    for tok in tokens:
        if tok.startswith("-") and not _is_number(tok):
            name, eq, value = tok.partition("=")
            if len(name) > 2 and name.startswith("-O") and name[2:].isdigit():
                name, eq, value = "-O", "=", name[2:]
            name = _ALIASES.get(name, name)
            if name in _OWNED:
                raise ConfigError(f"{where}: {name} is set by the neuron backend itself; remove it")
            groups.append((name, [" ".join(value.split())] if eq else []))
        elif not groups:
            raise ConfigError(f"{where}: {tok!r} is not a neuronx-cc option (the input file is set by the backend)")
        else:
            groups[-1][1].append(" ".join(tok.split()))
    return groups


def _canonical(groups: _Groups) -> _Groups:
    last = {name: i for i, (name, _) in enumerate(groups) if name in _SINGLE}
    kept = [(name, vals) for i, (name, vals) in enumerate(groups) if name not in _SINGLE or last[name] == i]
    return sorted(kept, key=lambda g: g[0])


def _argv(groups: _Groups) -> tuple[str, ...]:
    out: list[str] = []
    for name, vals in groups:
        if name == "-O" and len(vals) == 1:
            out.append(f"-O{vals[0]}")
        elif len(vals) == 1:
            out.append(f"{name}={vals[0]}")
        else:
            out += [name, *vals]
    return tuple(out)


def plan_flags(overrides: Mapping[str, Any] | None, stems: Sequence[str], environ: Mapping[str, str] | None = None,
               product_name: str | None = None) -> NeuronFlags:
    """Every bucket's neuronx-cc arguments (module docstring for the precedence), validated before
    any work: --target trn1|trn2 present, --lnc 1|2 (2 only on trn2: NCC_EARG001), -O 1|2|3, one
    target and LNC for the whole bundle, `bucket_args` keys among `stems`. Raises ConfigError naming
    the key or flag and the limit."""
    env = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - _FLAG_KEYS)
    if unknown:
        raise ConfigError(f"neuron flags: unknown key {unknown[0]!r} (known: {', '.join(sorted(_FLAG_KEYS))})")
    detected = _instance_target(product_name)
    sources = [(list(DEFAULT_ARGS), "default flags"), (["--target", detected] if detected else [], "instance type"),
               (shlex.split(env.get(FLAGS_ENV, "")), f"${FLAGS_ENV}"),
               (_tokens(overrides.get("args", ""), "neuron flags.args"), "neuron flags.args"),
               ([t for key in ("target", "lnc") if key in overrides for t in (f"--{key}", str(overrides[key]))],
                "neuron flags")]
    common = _canonical([g for tokens, where in sources for g in _parse(tokens, where)])
    bucket_args = overrides.get("bucket_args", {})
    if not isinstance(bucket_args, dict):
        raise ConfigError("neuron flags.bucket_args: expected {bucket name: arguments}")
    stray = sorted(set(bucket_args) - set(stems))
    if stray:
        raise ConfigError(f"neuron flags.bucket_args: {stray[0]!r} is not a bucket of this plan (buckets: {', '.join(stems)})")
    per_bucket, chosen = {}, set()
    for stem in stems:
        where = f"neuron flags for {stem}"
        groups = _canonical(common + _parse(_tokens(bucket_args.get(stem, ""), where), where))
        chosen.add(_validate(groups, where))
        per_bucket[stem] = _argv(groups)
    if len(chosen) > 1:
        raise ConfigError("neuron flags.bucket_args: every bucket of a bundle needs the same --target and --lnc "
                          f"(one host runs the bundle), got {sorted(chosen)}")
    return NeuronFlags(_argv(common), per_bucket, min(chosen)[1] if chosen else 1)


def _validate(groups: _Groups, where: str) -> tuple[str, int]:
    """Check one bucket's canonical flags; returns its (target, lnc)."""
    values = {name: vals[0] if vals else "" for name, vals in groups if name in _SINGLE}
    target, lnc, level = values.get("--target"), values.get("--lnc"), values.get("-O")
    if target is None:
        raise ConfigError(f"{where}: no --target; this host is not a trn1/trn2 instance, so name one: "
                          f"{FLAGS_ENV}='--target trn2' (or flags {{'target': 'trn2'}})")
    if target not in TARGETS:
        raise ConfigError(f"{where}: --target {target} is not one of {', '.join(TARGETS)}")
    if lnc not in ("1", "2"):
        raise ConfigError(f"{where}: --lnc {lnc} must be 1 or 2")
    if lnc == "2" and target != "trn2":
        raise ConfigError(f"{where}: --lnc 2 needs --target trn2 (on {target} only lnc=1 is supported, NCC_EARG001)")
    if level not in ("1", "2", "3"):
        raise ConfigError(f"{where}: -O {level} must be 1, 2 or 3")
    return target, int(lnc)


def _tokens(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return [t for v in value for t in shlex.split(v)]
    raise ConfigError(f"{where}: expected a string of neuronx-cc arguments, got {type(value).__name__}")


def _instance_target(product_name: str | None) -> str | None:
    """trn1/trn2 when this host is such an instance (EC2 product name, e.g. "trn2.48xlarge")."""
    if product_name is None:
        try:
            product_name = PRODUCT_NAME.read_text().strip()
        except OSError:
            return None
    family = product_name.split(".")[0]
    return "trn1" if family in ("trn1", "trn1n") else "trn2" if family == "trn2" else None


# ------------------------------------------------------------------------------------------ toolchain, kernels
def neuron_toolchain() -> dict[str, Any]:
    """The manifest's toolchain for a neuron bundle: the host entries (`cpu_isa` empty: a NEFF holds
    no host code) and the SDK versions."""
    return {**host_toolchain(), "cpu_isa": [], **sdk_versions()}


def kernel_sources(table: Mapping[str, str] | None = None) -> dict[str, str]:
    """{op: "module:function sha256-of-module-source"} for every kernel of `table` (default
    NKI_KERNELS), without importing the kernel modules (they import `nki`): the source is read and
    parsed. Raises CompileError naming a module that does not exist or does not define the function
    at its top level."""
    out = {}
    for op, entry in (NKI_KERNELS if table is None else table).items():
        module, _, function = entry.partition(":")
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            raise CompileError(f"NKI kernel of {op}: module {module} not found (kernels_nki, issue 7)")
        source = Path(spec.origin).read_bytes()
        if function not in _top_level_names(source):
            raise CompileError(f"NKI kernel of {op}: {module} defines no top-level {function}")
        out[op] = f"{entry} {hashlib.sha256(source).hexdigest()}"
    return out


def _top_level_names(source: bytes) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def key_toolchain(toolchain: Mapping[str, Any], kernels: Mapping[str, str]) -> dict[str, Any]:
    """What a NEFF depends on besides graph, flags and target: the torch/SDK versions and the
    kernel sources. Not the compiling host's CPU or Python: a shared cache serves every host."""
    return {**{k: toolchain.get(k) for k in ("torch", *SDK_DISTRIBUTIONS)}, "nki_kernels": dict(kernels)}


def require_compiler() -> str:
    """Path of the neuronx-cc executable; BundleError when it is not on PATH."""
    exe = shutil.which("neuronx-cc")
    if exe is None:
        raise BundleError(f"neuronx-cc is not on PATH; install it from the AWS Neuron pip index ({NEURON_INDEX}) "
                          "and activate that environment (or add /opt/aws/neuron/bin to PATH)")
    return exe


# ------------------------------------------------------------------------------------------ lowering
def lowering(kernels: Mapping[str, str]) -> InlineCustomOps:
    """The export-time lowering of the neuron target: ops of `kernels` stay calls (their NKI kernel
    replaces them at trace time), every other custom op is inlined from its reference."""
    mode = InlineCustomOps()
    mode.called.update({op: f"NKI kernel {entry.split()[0]}" for op, entry in kernels.items()})
    return mode


class NkiDispatch(TorchFunctionMode):
    """While active, a call of a custom op of `table` ({op: "module:function"}) runs its NKI kernel,
    imported on first use; with lnc > 1 the kernel is launched as `kernel[lnc]` (the launch degree
    must equal the logical core size, neuron_toolchain.md 1.2)."""

    def __init__(self, table: Mapping[str, str], lnc: int):
        super().__init__()
        self.table, self.lnc = dict(table), lnc
        self._kernels: dict[str, Any] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = _custom_name(func)
        if name not in self.table:
            return func(*args, **(kwargs or {}))
        if name not in self._kernels:
            module, _, attr = self.table[name].partition(":")
            kernel = getattr(importlib.import_module(module), attr)
            self._kernels[name] = kernel[self.lnc] if self.lnc > 1 else kernel
        return self._kernels[name](*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------ the SDK seam
def compile_neff(program: torch.export.ExportedProgram, out: Path, args: Sequence[str], lnc: int,
                 kernels: Mapping[str, str]) -> None:
    """Trace `program` on the XLA device with the NKI kernels and compile it with neuronx-cc into the
    NEFF `out` (written whole, then renamed). Needs the Neuron SDK; NOT RUN ON HARDWARE here.

    args: this bucket's canonical neuronx-cc arguments; kernels: {op: "module:function ..."}.
    Raises CompileError when torch-neuronx changes the input/output interface (an input pruned by
    XLA would shift every later input of the NEFF) or neuronx-cc fails (with the end of its log).
    """
    from torch_neuronx.xla_impl import trace as xla_trace  # the SDK, imported only here

    exe = require_compiler()
    sig = program.graph_signature
    user = set(sig.user_inputs)
    examples = tuple(torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype)
                     for n in program.graph.nodes if n.op == "placeholder" and n.name in user)
    table = {op: entry.split()[0] for op, entry in kernels.items()}
    with tempfile.TemporaryDirectory(prefix=f".{out.stem}.", dir=out.parent) as tmp:
        with NkiDispatch(table, lnc):
            hlo = xla_trace.generate_hlo(program.module(), examples, {}, inline_weights_to_neff=True,
                                         return_weights=False, output_aliased_tensor=False, cpu_backend=True)
        got = [tuple(t.shape) for t in hlo.metaneff.input_tensors]
        want = [tuple(e.shape) for e in examples]
        if got != want or len(hlo.metaneff.output_tensors) != len(sig.user_outputs):
            raise CompileError(f"{out.stem}: torch-neuronx traced inputs {got} and {len(hlo.metaneff.output_tensors)} "
                               f"outputs; the bucket passes {want} and expects {len(sig.user_outputs)}")
        graph = Path(tmp) / "graph.hlo"
        graph.write_bytes(hlo.hlo_module.SerializeToString())
        neff, log = Path(tmp) / out.name, Path(tmp) / "log-neuron-cc.txt"
        cmd = [exe, "compile", str(graph), "--framework", "XLA", *args, "--output", str(neff), f"--logfile={log}"]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0 or not neff.is_file():
            tail = (log.read_text(errors="replace") if log.is_file() else proc.stderr or proc.stdout)[-2000:]
            raise CompileError(f"{out.stem}: neuronx-cc exited with {proc.returncode}: {tail}")
        os.replace(neff, out)


# ------------------------------------------------------------------------------------------ pipeline
def compile_bundle(model_cfg: ModelConfig, compile_cfg: CompileConfig, out: Path, parts: ModelParts, *,
                   force: bool = False, cache_dir: Path | None = None, flags: dict[str, Any] | None = None,
                   console: Console | None = None) -> Path:
    """compiler/compile.py `compile_bundle` for target "neuron" (it routes here after check_target):
    one NEFF per bucket, weights and tokenizer as on cpu; returns `out`.

    Before any work: the bucket plan, the neuronx-cc arguments of every bucket (`plan_flags`), the
    NKI kernel modules, the neuronx-cc executable and the output folder are checked. Raises
    ConfigError, CompileError, BundleError, OutputExistsError as compiler/compile.py does.
    """
    console = console or Console(stderr=True)
    plan = plan_buckets(compile_cfg, model_cfg)
    rels = {pb: bucket_file(pb.kind, pb.batch, pb.length, "neuron") for pb in plan.buckets}
    nflags = plan_flags(flags, [Path(r).stem for r in rels.values()])
    kernels = kernel_sources()
    require_compiler()
    out = Path(out)
    check_output(out, force)
    _check_weights(parts.weights)
    stored, load_casts = _stored_weights(parts.weights, parts.stored_dtypes)
    tok_files = [Path(p) for p in parts.tokenizer_files]
    if not tok_files or tok_files[0].name != "tokenizer.json" or not all(p.is_file() for p in tok_files):
        raise ConfigError(f"tokenizer files {[str(p) for p in tok_files]}: need an existing tokenizer.json first")
    try:
        json.dumps(parts.host_params, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CompileError(f"host preprocessing parameters are not plain JSON data ({e})") from None

    toolchain = neuron_toolchain()
    key_tc = key_toolchain(toolchain, kernels)
    cache = CompileCache(cache_dir if cache_dir is not None else default_cache_dir())
    state = _state_entries(parts.steps, plan)
    fingerprint = getattr(parts.steps, "fingerprint", None)
    fp = fingerprint() if callable(fingerprint) else None
    wdigest = _weights_digest(parts.weights)
    buckets: list[Bucket] = []
    custom_ops: dict[str, str] = {}
    weight_views: dict[str, str] = {}
    neffs: dict[str, dict[str, Any]] = {}
    compiled = 0
    with BundleWriter(out, force) as writer, _progress(console) as progress:
        tasks = {pb: progress.add_task(pb.label, status="waiting", total=1) for pb in plan.buckets}
        for pb in plan.buckets:
            t0, rel = time.perf_counter(), rels[pb]
            stem = Path(rel).stem
            args = nflags.per_bucket[stem]
            prekey = pre_key(fp, dataclasses.asdict(pb), wdigest, list(args), key_tc, "neuron", BACKEND) if fp else None
            record = cache.get_alias(prekey) if prekey else None
            how = "cached"
            if record is None:
                progress.update(tasks[pb], status="exporting")
                record, program = _export(parts, pb, kernels)
                record["graph_key"] = cache_key(normalised_graph(program), list(args), key_tc, "neuron", BACKEND)
                artifact = cache.get(record["graph_key"])
                if artifact is None:
                    progress.update(tasks[pb], status="compiling")
                    compile_neff(program, writer.path(rel), args, nflags.lnc, kernels)
                    artifact = cache.put(record["graph_key"], writer.path(rel))
                    how, compiled = "compiled", compiled + 1
                if prekey:
                    cache.put_alias(prekey, record)
                record["artifact"] = artifact
            if how == "cached":
                writer.copy_in(record["artifact"], rel)
            neffs[rel] = _neff_record(writer.path(rel), args, nflags.lnc).to_dict()
            custom_ops.update(record["custom_ops"])
            weight_views.update(record["views"])
            buckets.append(Bucket(kind=pb.kind, batch=pb.batch, seq_len=pb.seq_len, capacity=pb.capacity, file=rel,
                                  weights=tuple(record["weights"]),
                                  inputs=tuple(TensorSpec.from_dict(x, "inputs") for x in record["inputs"]),
                                  outputs=tuple(TensorSpec.from_dict(x, "outputs") for x in record["outputs"]),
                                  cache_key=record["graph_key"]))
            progress.update(tasks[pb], status=f"{how} in {time.perf_counter() - t0:.1f} s", completed=1)
        used = {n for b in buckets for n in b.weights}
        writer.write_weights({n: t for n, t in stored.items() if n in used})
        for p in tok_files:
            writer.copy_in(p, f"{TOKENIZER_DIR}/{p.name}")
        manifest = Manifest(
            target="neuron", toolchain=toolchain,
            compiler={"backend": BACKEND, "flags": list(nflags.common), "custom_ops": dict(sorted(custom_ops.items())),
                      "nki_kernels": {op: entry.split()[0] for op, entry in kernels.items()}, "neff": neffs},
            model_config=model_cfg.to_dict(), compile_config=compile_cfg.to_dict(),
            tokenizer=Tokenizer(files=tuple(f"{TOKENIZER_DIR}/{p.name}" for p in tok_files),
                                bos_token_id=model_cfg.bos_token_id, eos_token_id=model_cfg.eos_token_id,
                                pad_token_id=model_cfg.eos_token_id, add_bos=True),
            host_preprocessing=dict(parts.host_params), state=state, buckets=tuple(buckets), files={},
            weights_file=WEIGHTS, created_by=f"dsneuron {dsneuron.__version__}",
            load_casts={n: d for n, d in load_casts.items() if n in used}, weight_views=dict(sorted(weight_views.items())))
        path = writer.commit(manifest)
    console.print(f"bundle written to {path} ({compiled} compiled, {len(buckets) - compiled} from the cache at {cache.root})")
    return path


def _export(parts: ModelParts, pb: PlannedBucket, kernels: Mapping[str, str]) -> tuple[dict[str, Any], torch.export.ExportedProgram]:
    """Export one bucket with the neuron lowering; returns (the bucket's manifest facts, the program)."""
    graph = parts.steps.prefill(pb.batch, pb.seq_len, pb.capacity) if pb.kind == "prefill" \
        else parts.steps.decode(pb.batch, pb.capacity)
    mode = lowering(kernels)
    exported = export_step(graph, parts.weights, pb.label, INPUT_VIEWS, mode)
    record = {"weights": list(exported.weights), "inputs": [s.to_dict() for s in exported.inputs],
              "outputs": [s.to_dict() for s in exported.outputs],
              "views": {n: dtype_name(d) for n, d in exported.views.items()},
              "custom_ops": finish(exported.program, mode, pb.label)}
    return record, exported.program


def _neff_record(path: Path, args: tuple[str, ...], lnc: int) -> NeffRecord:
    """The manifest record of a NEFF just compiled or taken from the cache; its header must be
    whole and carry the requested logical core size (else BundleError: never bundle a bad NEFF)."""
    header = read_header(path)
    check_header(header, path.stat().st_size, path.name, allowed_feature_bits=header.feature_bits, lnc=lnc,
                 lnc_source=f"requested with --lnc {lnc}")
    return NeffRecord.of(header, args)
