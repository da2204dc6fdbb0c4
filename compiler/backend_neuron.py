"""neuron backend: each bucket's exported step -> StableHLO (torch-mlir) -> [NKI kernels bound, HLO] -> neuronx-cc -> NEFF.

NOT RUN ON HARDWARE. Everything of the SDK seam (`compile_neff`: binding the NKI kernels,
neuronx-cc) follows the public sources cited at each step and has never been executed here (the
Neuron SDK is not installable on this host); it is tested with a stand-in compiler and a stand-in
for the one call that needs `nki`. The rest (flags, keys, lowering, StableHLO, the kernel adapters)
runs here, the StableHLO on XLA:CPU (runtime_min/executors/executor_stablehlo.py, tests/test_stablehlo.py).

`NeffBackend` and `StableHLOBackend` (the `--stablehlo-only` compile) are the neuron side of
compiler/compile.py's bundle loop (its `Backend` interface); everything else of a compile (export, cache, weights, tokenizer, manifest, atomic write) is that
loop's. Per bucket:
1. torch.export on the host with the neuron lowering (`lowering`, compiler/lower.py KernelCalls):
   a custom op that has an NKI kernel (`NKI_KERNELS`) runs its adapter around the kernel's own op
   (`dsneuron::nki_*`, kernels_nki/neuron_adapters.py: pad, uint8 views, format constant, result
   slice), which stays one graph node; any other custom op is inlined from its torch reference. The
   export uses the neuron spelling (kernels_nki/formats.py): no float8 dtype (trn1/trn2 have no OCP
   e4m3fn, neuronx-cc NCC_EVRF051) and no float64 (Trainium computes none).
2. Cache key ingredients (`key_ingredients`): this bucket's neuronx-cc arguments (or
   "--stablehlo-only"), torch, torch-mlir, the SDK versions and the sources of the NKI kernel and
   adapter modules (`kernel_sources`).
3. On a miss: compiler/stablehlo.py lowers the program to one StableHLO module, each kernel call a
   `stablehlo.composite` whose decomposition is its torch reference. With --stablehlo-only that
   module, as a portable artifact, is the bucket's file. Else `compile_neff`: the composites become
   the HLO custom-call neuronx-cc replaces by the NKI kernel (`bind_kernels`), XLA's importer
   converts the module to an HloModuleProto, and `neuronx-cc compile --framework XLA` makes the
   NEFF (aws-neuron-sdk:compiler/neuronx-cc/how-to-generate-neff.rst).
4. The file is read back: a StableHLO module's facts (compiler.stablehlo) or the NEFF header
   (runtime_min/executors/neff.py): its lnc_size must be the requested --lnc, and the manifest records, per
   bucket, the flags and the header's lnc_size / feature_bits / version (`Manifest.compiler["neff"]`).

Weights stay out of every module and NEFF: they are arguments (compiler/export.py) and live once in
weights.safetensors. Non-weight constants (RoPE tables) are constants of the module. fp8/e8m0
weights cross the boundary as uint8 views (`INPUT_VIEWS`).

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
import importlib.util
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch._library.custom_ops import OPDEFS

from dsneuron.graphs.config import ConfigError
from dsneuron.kernels_nki.neuron_adapters import BINDINGS, NkiBinding
from dsneuron.runtime_min.bundle.bundle import NEURON_INDEX, STABLEHLO_BACKEND, host_toolchain
from dsneuron.runtime_min.bundle.schema import BundleError
from dsneuron.runtime_min.executors.executor_neuron import SDK_DISTRIBUTIONS, sdk_versions
from dsneuron.runtime_min.executors.neff import PRODUCT_NAME, NeffRecord, check_header, read_header

from .cache import is_number
from .export import CompileError
from .lower import KernelCalls
from .stablehlo import (COMPOSITE_PREFIX, TARGET_VERSION, KernelOp, StableHlo, artifact_text, lower_program,
                        parse_module, rebind_composites, require_torch_mlir, stablehlo_versions)

BACKEND = "neuronx-cc"
TARGETS = ("trn1", "trn2")
#: manifest `compiler.stablehlo[file].format` of a --stablehlo-only bucket
ARTIFACT_FORMAT = "stablehlo-portable-artifact"
#: a bucket's module is also written as text beside its artifact up to this many bytes
TEXT_LIMIT = 2 << 20
#: the HLO custom-call target neuronx-cc replaces by an NKI kernel (aws-neuron-sdk:nki/guides/framework_custom_op.rst)
NKI_CUSTOM_CALL = "AwsNeuronCustomNativeKernel"
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
        if tok.startswith("-") and not is_number(tok):
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
def lowering() -> KernelCalls:
    """The export-time lowering of the neuron target: each op of NKI_KERNELS runs its adapter around
    its kernel's op (kernels_nki/neuron_adapters.py), which stays one graph node, the composite of
    compiler/stablehlo.py; every other custom op is inlined from its reference."""
    return KernelCalls(NKI_KERNELS)


def kernel_ops(kernels: Mapping[str, Mapping[str, str]]) -> dict[str, KernelOp]:
    """{"dsneuron::nki_*": KernelOp} for the bindings of NKI_KERNELS, with the kernel hashes of
    `kernels` (`kernel_sources`): what compiler/stablehlo.py makes composites of."""
    out = {}
    for op, binding in NKI_KERNELS.items():
        out[binding.op] = KernelOp(binding.op, binding.kernel, kernels[op]["kernel_sha256"], OPDEFS[binding.op]._init_fn)
    return out


def stablehlo_toolchain() -> dict[str, Any]:
    """The manifest's toolchain for a StableHLO bundle: the host entries (`cpu_isa` empty: the
    module holds no host code), torch-mlir's version and its StableHLO versions."""
    versions = stablehlo_versions()
    return {**host_toolchain(), "cpu_isa": [], "torch_mlir": metadata.version("torch-mlir"),
            "stablehlo": {"artifact": TARGET_VERSION, **versions}}


# ------------------------------------------------------------------------------------------ the SDK seam
def nki_kernel_config(kernel: str, operand_types: Sequence[str], result_types: Sequence[str],
                      attributes: Mapping[str, Any], lnc: int) -> str:
    """The backend_config of one NKI kernel call (the kernel "module:function" at these operand
    and result types, with these constant arguments, launched on `lnc` cores), which the `nki`
    package writes when it compiles the kernel for a framework (aws-neuron-sdk:nki/guides/
    framework_custom_op.rst; nkipy nkipy/core/nki_op.py passes `backend_config_b64` of nki 0.4+'s
    compiled kernel). NOT WRITTEN: it needs the Neuron SDK's `nki`, which this project has never
    run; raises CompileError naming what is missing."""
    raise CompileError(f"binding the NKI kernel {kernel} into the module needs the Neuron SDK's nki package (AWS Neuron "
                       f"pip index, {NEURON_INDEX}) and its framework API, which dsneuron has not been run against: "
                       "compile with --stablehlo-only on this host")


def bind_kernels(module: StableHlo, lnc: int, kernel_config: Any = None) -> int:
    """Replace, in place, every kernel composite of `module` ("dsneuron.nki.<kernel>",
    compiler/stablehlo.py) by a `stablehlo.custom_call` to NKI_CUSTOM_CALL over the same operands,
    the HLO custom-call that neuronx-cc replaces by the NKI kernel named in its backend_config
    (aws-neuron-sdk:nki/guides/framework_custom_op.rst); returns how many. kernel_config(kernel,
    operand types, result types, attributes, lnc) -> backend_config (default `nki_kernel_config`,
    which needs the SDK). Raises CompileError as kernel_config does."""
    return rebind_composites(module, COMPOSITE_PREFIX, NKI_CUSTOM_CALL, lnc, kernel_config or nki_kernel_config)


def hlo_module_proto(module: StableHlo) -> bytes:
    """The module as a serialized XLA HloModuleProto, neuronx-cc's documented input (`neuronx-cc
    compile <hlo.pb> --framework XLA`, aws-neuron-sdk:compiler/neuronx-cc/how-to-generate-neff.rst),
    converted by XLA's own StableHLO importer (jaxlib, the `test` extra). Results come as one tuple,
    as a framework's traced HLO returns them. Raises CompileError when the conversion fails or
    jaxlib is missing."""
    try:
        from jax._src.lib import _jax
    except ImportError as e:
        raise CompileError(f"converting StableHLO to neuronx-cc's HloModuleProto needs jaxlib ({e}); "
                           "pip install jaxlib==0.10.2") from None
    try:
        computation = _jax.mlir.mlir_module_to_xla_computation(module.text, use_tuple_args=False, return_tuple=True)
    except Exception as e:  # jaxlib's own error type
        raise CompileError(f"XLA could not convert the StableHLO module to HLO: {str(e).splitlines()[0][:300]}") from None
    return computation.as_serialized_hlo_module_proto()


def compile_neff(module: StableHlo, out: Path, args: Sequence[str], lnc: int) -> None:
    """Bind the kernels (`bind_kernels`), convert `module` to HLO (`hlo_module_proto`) and compile it
    with `neuronx-cc compile <hlo.pb> --framework XLA <args>` into the NEFF `out` (written whole,
    then renamed). Needs the Neuron SDK; NOT RUN ON HARDWARE here.

    Why HLO and not StableHLO into neuronx-cc: the compiler's documented command line takes an
    HloModuleProto (how-to-generate-neff.rst); TorchNeuron hands StableHLO to the compiler inside
    its own process, through no documented file format or flag. args: this bucket's canonical
    neuronx-cc arguments. Raises CompileError when a kernel cannot be bound or neuronx-cc fails
    (with the end of its log).
    """
    exe = require_compiler()
    bind_kernels(module, lnc)
    with tempfile.TemporaryDirectory(prefix=f".{out.stem}.", dir=out.parent) as tmp:
        graph = Path(tmp) / "model.hlo.pb"
        graph.write_bytes(hlo_module_proto(module))
        neff, log = Path(tmp) / out.name, Path(tmp) / "log-neuron-cc.txt"
        cmd = [exe, "compile", str(graph), "--framework", "XLA", *args, "--output", str(neff), f"--logfile={log}"]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0 or not neff.is_file():
            tail = (log.read_text(errors="replace") if log.is_file() else proc.stderr or proc.stdout)[-2000:]
            raise CompileError(f"{out.stem}: neuronx-cc exited with {proc.returncode}: {tail}")
        os.replace(neff, out)


# ------------------------------------------------------------------------------------------ the backend
class _NeuronLowering:
    """What the two neuron backends share: the NKI kernel sources and their ops (`kernel_sources`,
    hashed into the cache keys), the neuron lowering of the kernel calls, and the StableHLO module
    of a bucket. Not a backend by itself: `StableHLOBackend` and `NeffBackend` are."""

    target = "neuron"
    input_views = INPUT_VIEWS
    # trn1/trn2 have no OCP e4m3fn (neuronx-cc EVRF051) and no float64
    neuron_spelling = True

    def __init__(self) -> None:
        self.kernels = kernel_sources()
        self._kernel_ops = kernel_ops(self.kernels)

    def lowering(self) -> KernelCalls:
        return lowering()

    def lower(self, program: torch.export.ExportedProgram, stem: str):
        """The bucket's StableHLO module (compiler/stablehlo.py `lower_program`), its NKI kernel
        calls as this backend's kernel composites; raises as `lower_program`."""
        return lower_program(program, self._kernel_ops, stem)

    def side_files(self, path: Path) -> dict[str, bytes]:
        return {}

    def _record(self, custom_ops: dict[str, str]) -> dict[str, Any]:
        return {"backend": self.name, "custom_ops": custom_ops,
                "nki_kernels": {op: entry["kernel"] for op, entry in self.kernels.items()}}


class StableHLOBackend(_NeuronLowering):
    """The neuron target stopped at StableHLO (`compile --target neuron --stablehlo-only`), for
    compiler/compile.py `compile_bundle`; the methods are its `Backend` interface's. Each bucket's
    file is its StableHLO module (compiler/stablehlo.py) as a portable artifact that any host with
    dsneuron's install can run on XLA:CPU. Needs torch-mlir, not the Neuron SDK. The cache keys take
    "--stablehlo-only" and the torch, torch-mlir and StableHLO versions with the NKI kernel hashes.
    Raises ConfigError when given neuronx-cc flags, BundleError when torch-mlir is missing."""

    name = STABLEHLO_BACKEND

    def __init__(self, flags: Mapping[str, Any] | None, stems: Sequence[str]):
        super().__init__()
        if flags:
            raise ConfigError("neuron flags: --stablehlo-only runs no neuronx-cc, so it takes no neuronx-cc flags")
        require_torch_mlir()
        self.toolchain = stablehlo_toolchain()
        self._key_toolchain = {"torch": self.toolchain["torch"], "torch_mlir": self.toolchain["torch_mlir"],
                               "stablehlo": self.toolchain["stablehlo"]["artifact"],
                               "nki_kernels": {op: dict(e) for op, e in self.kernels.items()}}
        self._texts: dict[str, str | None] = {}

    def key_ingredients(self, stem: str) -> tuple[list[str], dict[str, Any]]:
        return ["--stablehlo-only"], self._key_toolchain

    def compile(self, program: torch.export.ExportedProgram, out: Path, stem: str) -> None:
        tmp = out.with_name(f".{out.name}.part")
        tmp.write_bytes(self.lower(program, stem).artifact())
        os.replace(tmp, out)

    def bucket_facts(self, path: Path, stem: str) -> dict[str, Any]:
        """The manifest record of the bucket's module: format, version, its facts
        (compiler/stablehlo.py ModuleFacts) and its text file when one is written (`side_files`)."""
        module = parse_module(artifact_text(path.read_bytes()))
        facts = module.facts()
        text = module.text if facts.text_bytes <= TEXT_LIMIT else None
        self._texts[path.name] = text
        return {"format": ARTIFACT_FORMAT, "version": TARGET_VERSION, "facts": facts.to_dict(),
                "text": f"{path.name.removesuffix('.mlirbc')}.mlir" if text is not None else None}

    def side_files(self, path: Path) -> dict[str, bytes]:
        """Files written beside the bucket's file at `path` (after `bucket_facts`): its module as
        text when at most TEXT_LIMIT bytes."""
        text = self._texts.get(path.name)
        return {} if text is None else {f"{path.name.removesuffix('.mlirbc')}.mlir": text.encode()}

    def compiler_record(self, custom_ops: dict[str, str], facts: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {**self._record(custom_ops), "flags": ["--stablehlo-only"], "stablehlo": facts}


class NeffBackend(_NeuronLowering):
    """The neuron target to NEFFs, for compiler/compile.py `compile_bundle`; the methods are its
    `Backend` interface's. Each bucket is lowered to StableHLO (compiler/stablehlo.py) and its file
    is the NEFF neuronx-cc makes of it (the Neuron SDK: NOT RUN on this project's hosts).

    Made before any work, from the `flags` overrides and the plan's bucket file stems: plans and
    validates every bucket's neuronx-cc arguments (`plan_flags`) and finds neuronx-cc. Raises
    ConfigError, CompileError or BundleError naming the problem. The cache keys take the
    neuronx-cc arguments and `key_toolchain`.
    """

    name = BACKEND

    def __init__(self, flags: Mapping[str, Any] | None, stems: Sequence[str]):
        super().__init__()
        self.flags = plan_flags(flags, stems)
        require_compiler()
        self.toolchain = {**neuron_toolchain(), "torch_mlir": metadata.version("torch-mlir")}
        self._key_toolchain = key_toolchain(self.toolchain, self.kernels)

    def key_ingredients(self, stem: str) -> tuple[list[str], dict[str, Any]]:
        return list(self.flags.per_bucket[stem]), self._key_toolchain

    def compile(self, program: torch.export.ExportedProgram, out: Path, stem: str) -> None:
        compile_neff(self.lower(program, stem), out, self.flags.per_bucket[stem], self.flags.lnc)

    def bucket_facts(self, path: Path, stem: str) -> dict[str, Any]:
        """The NEFF's manifest record; its header must be whole and carry the requested logical
        core size (else BundleError: never bundle a bad NEFF)."""
        header = read_header(path)
        lnc = self.flags.lnc
        check_header(header, path.stat().st_size, path.name, allowed_feature_bits=header.feature_bits, lnc=lnc,
                     lnc_source=f"requested with --lnc {lnc}")
        return NeffRecord.of(header, self.flags.per_bucket[stem]).to_dict()

    def compiler_record(self, custom_ops: dict[str, str], facts: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {**self._record(custom_ops), "flags": list(self.flags.common), "neff": facts}
