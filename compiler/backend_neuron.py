"""neuron backend: each bucket's exported step -> torch-neuronx HLO with NKI kernels -> neuronx-cc -> NEFF.

NOT RUN ON HARDWARE. Everything below the SDK seam (`compile_neff`) follows the public sources
cited at each step and has never been executed here (the Neuron SDK is not installable on this
host); the rest (flags, keys, lowering, the kernel adapters) is tested with a stand-in for that
seam and, for the adapters, with the NumPy stand-in of `nki`.

`NeuronBackend` is the neuron side of compiler/compile.py's bundle loop (its `Backend` interface);
everything else of a compile (export, cache, weights, tokenizer, manifest, atomic write) is that
loop's. Per bucket:
1. torch.export on the host with the neuron lowering (`lowering`): a custom op that has an NKI
   kernel (`NKI_KERNELS`) stays one graph node; any other custom op is inlined from its torch
   reference (compiler/lower.py `InlineCustomOps`), so it reaches XLA as ordinary ops. The export
   uses the XLA spelling (`xla_spelling`, kernels_nki/formats.py): FP8/FP4 bytes and UE8M0 scales
   are decoded and activations rounded to e4m3 in integer/fp32 arithmetic, so the graph holds no
   float8 dtype (torch-xla has none; trn1/trn2 have no OCP e4m3fn, neuronx-cc NCC_EVRF051) and no
   op torch-xla runs on the host. What follows up to the HLO runs on XLA:CPU in
   compiler/xla_check.py (tests/test_xla.py, scripts/xla-check).
2. Cache key ingredients (`NeuronBackend.key_ingredients`): this bucket's neuronx-cc arguments, the
   torch/SDK versions and the sources of the NKI kernel and adapter modules (`kernel_sources`).
3. On a miss, `compile_neff`: the exported graph runs on the XLA device under `NkiDispatch`, which
   answers each kernel op by calling its `@nki.jit` kernel through the op's adapter
   (kernels_nki/neuron_adapters.py: pad, uint8 views, format constant, result slice); a kernel call
   on XLA tensors records an HLO custom-call that neuronx-cc replaces by the kernel
   (aws-neuron-sdk:nki/guides/framework_custom_op.rst). torch-neuronx turns the trace into an
   HloModuleProto (`torch_neuronx.xla_impl.trace.generate_hlo`, called the way
   neuronx-distributed's trace/model_builder.py calls it), and `neuronx-cc compile --framework XLA`
   makes the NEFF (aws-neuron-sdk:compiler/neuronx-cc/how-to-generate-neff.rst). The kernels'
   compiled side files live in the `nki` package's temporary folders; tracing and compiling happen
   in one call, so they still exist when neuronx-cc reads them (neuron_toolchain.md 1.8).
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
import hashlib
import importlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode

from dsneuron.graphs.config import ConfigError
from dsneuron.kernels_nki.neuron_adapters import BINDINGS, NkiBinding
from dsneuron.runtime_min.bundle import NEURON_INDEX, host_toolchain
from dsneuron.runtime_min.executor_neuron import SDK_DISTRIBUTIONS, sdk_versions
from dsneuron.runtime_min.neff import PRODUCT_NAME, NeffRecord, check_header, read_header
from dsneuron.runtime_min.schema import BundleError

from .cache import _is_number
from .export import CompileError
from .lower import InlineCustomOps, _custom_name

BACKEND = "neuronx-cc"
TARGETS = ("trn1", "trn2")
# custom op -> its NKI kernel and the adapter calling it from the op's arguments
# (kernels_nki/neuron_adapters.py). Ops not listed are inlined from their reference: the V4.1
# indexer's `mqa_logits_bf16` works on bf16 QDQ values, which no FP8/FP4 kernel takes.
NKI_KERNELS: dict[str, NkiBinding] = dict(BINDINGS)
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


def kernel_sources(table: Mapping[str, NkiBinding] | None = None) -> dict[str, dict[str, str]]:
    """{op: {"kernel": "module:function", "kernel_sha256": ..., "adapter": "module:function",
    "adapter_sha256": ...}} for every binding of `table` (default NKI_KERNELS): the sha256 of each
    module's source, which a NEFF depends on. The kernel module is not imported (it imports `nki`):
    its source is read and parsed. Raises CompileError naming a module that does not exist or a
    kernel module that does not define the function at its top level."""
    out = {}
    for op, binding in (NKI_KERNELS if table is None else table).items():
        module, _, function = binding.kernel.partition(":")
        source = _module_source(module, f"NKI kernel of {op}")
        if function not in _top_level_names(source):
            raise CompileError(f"NKI kernel of {op}: {module} defines no top-level {function}")
        adapter = binding.call.__module__
        out[op] = {"kernel": binding.kernel, "kernel_sha256": hashlib.sha256(source).hexdigest(),
                   "adapter": f"{adapter}:{binding.call.__qualname__}",
                   "adapter_sha256": hashlib.sha256(_module_source(adapter, f"adapter of {op}")).hexdigest()}
    return out


def _module_source(module: str, what: str) -> bytes:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        raise CompileError(f"{what}: module {module} not found")
    return Path(spec.origin).read_bytes()


def _top_level_names(source: bytes) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def key_toolchain(toolchain: Mapping[str, Any], kernels: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """What a NEFF depends on besides graph, flags and target: the torch/SDK versions and the
    kernel and adapter sources (`kernel_sources`). Not the compiling host's CPU or Python: a shared
    cache serves every host."""
    return {**{k: toolchain.get(k) for k in ("torch", *SDK_DISTRIBUTIONS)},
            "nki_kernels": {op: dict(entry) for op, entry in kernels.items()}}


def require_compiler() -> str:
    """Path of the neuronx-cc executable; BundleError when it is not on PATH."""
    exe = shutil.which("neuronx-cc")
    if exe is None:
        raise BundleError(f"neuronx-cc is not on PATH; install it from the AWS Neuron pip index ({NEURON_INDEX}) "
                          "and activate that environment (or add /opt/aws/neuron/bin to PATH)")
    return exe


# ------------------------------------------------------------------------------------------ lowering
def lowering(kernels: Mapping[str, Mapping[str, str]]) -> InlineCustomOps:
    """The export-time lowering of the neuron target: ops of `kernels` (`kernel_sources`) stay calls
    (their NKI kernel replaces them at trace time), every other custom op is inlined from its reference."""
    mode = InlineCustomOps()
    mode.called.update({op: f"NKI kernel {entry['kernel']}" for op, entry in kernels.items()})
    return mode


class NkiDispatch(TorchFunctionMode):
    """While active, a call of a custom op of `table` ({op: NkiBinding}) runs its NKI kernel through
    the binding's adapter; the kernel is imported on first use and, with lnc > 1, launched as
    `kernel[lnc]` (the launch degree must equal the logical core size, neuron_toolchain.md 1.2).
    A ValueError of the adapter or kernel (arguments the kernel cannot take) becomes a CompileError
    naming the op and the kernel."""

    def __init__(self, table: Mapping[str, NkiBinding], lnc: int):
        super().__init__()
        self.table, self.lnc = dict(table), lnc
        self._kernels: dict[str, Any] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = _custom_name(func)
        binding = self.table.get(name) if name else None
        if binding is None:
            return func(*args, **(kwargs or {}))
        if name not in self._kernels:
            module, _, attr = binding.kernel.partition(":")
            kernel = getattr(importlib.import_module(module), attr)
            self._kernels[name] = kernel[self.lnc] if self.lnc > 1 else kernel
        try:
            return binding.call(self._kernels[name], *args, **(kwargs or {}))
        except ValueError as e:
            raise CompileError(f"{name}: its NKI kernel {binding.kernel} cannot take these arguments: {e}") from None


def device_module(program: torch.export.ExportedProgram, device: torch.device) -> torch.nn.Module:
    """`program` as a module that runs on `device` (the XLA device): its parameters, buffers and
    lifted constants moved there, and every creation op's `device=` (torch.export records the
    tracing host's, "cpu") retargeted, so no op mixes host and device tensors. Parameters of a
    float8 dtype stay on the host: they are the step's own parameters that export_step swapped for
    inputs, never read, and the XLA bridge has no float8 types."""
    from .export import FLOAT8_DTYPES

    module = program.module()
    for node in module.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device):
            node.kwargs = {**node.kwargs, "device": device}
    module.recompile()
    for sub in module.modules():
        for group in (sub._parameters, sub._buffers):
            for attr, t in list(group.items()):
                if t is not None and t.dtype not in FLOAT8_DTYPES:
                    moved = t.detach().to(device)
                    group[attr] = torch.nn.Parameter(moved, requires_grad=False) if group is sub._parameters else moved
        for attr, t in list(vars(sub).items()):  # lifted tensor constants are plain attributes
            if isinstance(t, torch.Tensor) and t.device != device:
                setattr(sub, attr, t.to(device))
    return module


# ------------------------------------------------------------------------------------------ the SDK seam
def compile_neff(program: torch.export.ExportedProgram, out: Path, args: Sequence[str], lnc: int,
                 bindings: Mapping[str, NkiBinding]) -> None:
    """Trace `program` on the XLA device with the NKI kernels and compile it with neuronx-cc into the
    NEFF `out` (written whole, then renamed). Needs the Neuron SDK; NOT RUN ON HARDWARE here.

    args: this bucket's canonical neuronx-cc arguments; bindings: {op: NkiBinding} (`NkiDispatch`).
    Raises CompileError when a kernel cannot take its op's arguments, when torch-neuronx changes the
    input/output interface (an input pruned by XLA would shift every later input of the NEFF) or
    when neuronx-cc fails (with the end of its log).
    """
    import torch_xla  # the SDK's torch-xla; imported only here
    from torch_neuronx.xla_impl import trace as xla_trace

    exe = require_compiler()
    sig = program.graph_signature
    user = set(sig.user_inputs)
    examples = tuple(torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype)
                     for n in program.graph.nodes if n.op == "placeholder" and n.name in user)
    with tempfile.TemporaryDirectory(prefix=f".{out.stem}.", dir=out.parent) as tmp:
        with NkiDispatch(bindings, lnc):
            # the module retargeted to the XLA device (`device_module`), as the XLA check runs it here
            hlo = xla_trace.generate_hlo(device_module(program, torch_xla.device()), examples, {}, inline_weights_to_neff=True,
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


# ------------------------------------------------------------------------------------------ the backend
class NeuronBackend:
    """The neuron target for compiler/compile.py `compile_bundle`; the methods are its `Backend`
    interface's. Per bucket (by file stem): the canonical neuronx-cc arguments are the cache key's
    flags and the NEFF record's; the key's toolchain is `key_toolchain`.

    Made before any work, from the `flags` overrides and the plan's bucket file stems: plans and
    validates every bucket's neuronx-cc arguments (`plan_flags`), hashes the NKI kernel and adapter
    modules of NKI_KERNELS (`kernel_sources`) and finds neuronx-cc. Raises ConfigError,
    CompileError or BundleError naming the problem.
    """

    target = "neuron"
    name = BACKEND
    input_views = INPUT_VIEWS
    # torch-xla has no float8 types and trn1/trn2 no OCP e4m3fn (neuronx-cc EVRF051)
    xla_spelling = True
    cacheable = True

    def __init__(self, flags: Mapping[str, Any] | None, stems: Sequence[str]):
        self.flags = plan_flags(flags, stems)
        self.bindings = dict(NKI_KERNELS)
        self.kernels = kernel_sources(self.bindings)
        require_compiler()
        self.toolchain = neuron_toolchain()
        self._key_toolchain = key_toolchain(self.toolchain, self.kernels)

    def lowering(self) -> InlineCustomOps:
        return lowering(self.kernels)

    def key_ingredients(self, stem: str) -> tuple[list[str], dict[str, Any]]:
        return list(self.flags.per_bucket[stem]), self._key_toolchain

    def compile(self, program: torch.export.ExportedProgram, out: Path, stem: str) -> None:
        compile_neff(program, out, self.flags.per_bucket[stem], self.flags.lnc, self.bindings)

    def bucket_facts(self, path: Path, stem: str) -> dict[str, Any]:
        """The NEFF's manifest record; its header must be whole and carry the requested logical
        core size (else BundleError: never bundle a bad NEFF)."""
        header = read_header(path)
        lnc = self.flags.lnc
        check_header(header, path.stat().st_size, path.name, allowed_feature_bits=header.feature_bits, lnc=lnc,
                     lnc_source=f"requested with --lnc {lnc}")
        return NeffRecord.of(header, self.flags.per_bucket[stem]).to_dict()

    def compiler_record(self, custom_ops: dict[str, str], facts: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {"backend": BACKEND, "flags": list(self.flags.common), "custom_ops": custom_ops,
                "nki_kernels": {op: entry["kernel"] for op, entry in self.kernels.items()}, "neff": facts}
