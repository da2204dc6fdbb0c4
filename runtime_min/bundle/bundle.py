"""Open a bundle: verify everything before anything runs, then hand out weights and executables.

`open_bundle` checks, in this order, and raises BundleError naming the first problem:
1. the folder and its manifest.json exist; the manifest is UTF-8 JSON, its format and schema
   version are known (checked before any other field is read), every field parses, the bucket set
   is one a session can run, and its seal matches its content (schema.py: a hand-edited manifest is
   refused);
   with a verify key, the bundle's signature checks out (runtime_min/bundle/signing.py);
2. the dsneuron that wrote it is of this runtime's release line (`check_creator`: the same
   major.minor version, any patch);
3. the target can run here (`check_target(target, "run")`; cpu: always; neuron: torch-neuronx imports;
   a `--stablehlo-only` neuron bundle runs its modules on XLA:CPU, runtime_min/executors/executor_stablehlo.py,
   which needs jax, checked when an executable loads);
4. the toolchain is compatible (below);
5. every file the manifest lists exists with the recorded size and sha256, and every file the bundle
   uses (weights, tokenizer, bucket executables) is listed. Executables are code: none is loaded
   before all checksums match.

Toolchain compatibility on the cpu target: an AOTInductor package is a shared object linked against
libtorch, so the torch release (major.minor.patch, the local build tag such as "+cpu" ignored) must
equal the compiling one; the machine architecture must match; and the host must offer every ISA
extension the compiling host had, because the generated code is built with -march=native. The
Python version is recorded but not checked: the executables do not link libpython.
On the neuron target none of these host rules apply: a NEFF holds no host code and runs on the
NeuronCores through the Neuron runtime, and a StableHLO module is compiled for this host when loaded. Its rules (the SDK release that compiled it, and each
NEFF's header against this host's logical core size) are checked by runtime_min/executors/executor_neuron.py
when a session is made, before any NEFF is loaded.

Nothing on this path unpickles: the manifest is JSON, weights are safetensors, the tokenizer is
JSON, and executables are loaded by the backend's own loader (see executor_cpu.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from dsneuron.kernels_nki.prepare import prepare_tensors

from .schema import MANIFEST, PARALLEL, BundleError, Manifest, parse_dtype, shard_record

# Import names of the Neuron SDK per use; AWS serves them from its own pip index (the PyPI packages
# of these names are placeholders). Compiling NEFFs runs neuronx-cc (neuronxcc) on the StableHLO that
# torch-mlir makes (a dsneuron dependency) and binds the NKI kernels (nki); running a bundle loads
# its NEFFs through torch_neuronx alone (runtime_min/executors/executor_neuron.py).
NEURON_PACKAGES = {"compile": ("neuronxcc", "nki"), "run": ("torch_neuronx",)}
NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"
TARGETS = ("cpu", "neuron")
USES = ("compile", "run")
_ISA = re.compile(r"^(sse\w*|ssse3|avx\w*|fma\w*|f16c|bmi\d|amx\w*|asimd\w*|sve\w*|bf16|i8mm|fphp)$")


def host_toolchain() -> dict[str, object]:
    """Versions and CPU features of this host, as the manifest records them."""
    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "cpu_isa": cpu_isa()}


def cpu_isa() -> list[str]:
    """Sorted ISA extension flags of this CPU (x86 `flags` / arm `Features` of /proc/cpuinfo; [] elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return sorted({f for f in value.split() if _ISA.match(f)})
    return []


def missing_packages(target: str, use: str = "compile") -> list[str]:
    """Import names that `use` ("compile" or "run") of `target` needs and this host lacks
    ([] = available). cpu needs a torch built with AOTInductor for both; neuron: `NEURON_PACKAGES`.
    Raises BundleError for an unknown target, ValueError for an unknown use."""
    if use not in USES:
        raise ValueError(f"use must be one of {USES}, got {use!r}")
    if target == "cpu":
        return [] if hasattr(torch._C, "_aoti") else ["torch (built with AOTInductor)"]
    if target == "neuron":
        return [p for p in NEURON_PACKAGES[use] if importlib.util.find_spec(p) is None]
    raise BundleError(f"unknown target {target!r} (known: {', '.join(TARGETS)})")


def check_target(target: str, use: str = "compile") -> None:
    """Raise BundleError naming the missing packages when this host cannot `use` ("compile" or
    "run") `target`: compiling checks every tool, running only what loads the executables."""
    missing = missing_packages(target, use)
    if missing:
        where = f"; they come from the AWS Neuron pip index ({NEURON_INDEX})" if target == "neuron" else ""
        doing = "for compiling" if use == "compile" else "for running bundles"
        raise BundleError(f"target {target!r} is not available on this host {doing}: missing Python packages "
                          f"{', '.join(missing)}{where}")


def check_toolchain(recorded: dict[str, object], host: dict[str, object] | None = None, target: str = "cpu") -> None:
    """Raise BundleError when `target` executables built with `recorded` cannot run on `host`
    (default: this host); the rules are the module docstring's (none for neuron here)."""
    if target != "cpu":
        return
    host = host_toolchain() if host is None else host
    want, have = _release(str(recorded.get("torch"))), _release(str(host["torch"]))
    if want != have:
        raise BundleError(f"bundle was compiled with torch {recorded.get('torch')}, this host has torch {host['torch']}; "
                          f"AOTInductor executables need the same torch release ({want}): recompile the bundle here")
    if recorded.get("machine") != host["machine"]:
        raise BundleError(f"bundle was compiled for machine {recorded.get('machine')!r}, this host is {host['machine']!r}")
    lacking = sorted(set(recorded.get("cpu_isa") or []) - set(host["cpu_isa"]))  # type: ignore[arg-type]
    if lacking:
        raise BundleError(f"this CPU lacks ISA extensions the bundle's executables may use: {', '.join(lacking)} "
                          "(compiled with -march=native on another CPU); recompile the bundle on this host")


_CREATOR = re.compile(r"dsneuron (\d+)\.(\d+)\.(\d+)(?:[.+-]\S*)?")


def check_creator(created_by: str, runtime: str | None = None) -> None:
    """Raise BundleError unless the bundle was written by a dsneuron of this runtime's release
    line: the same major.minor version (`runtime`, default this package's), any patch. Before 1.0
    a minor release may change what the manifest does not spell out (the C++ kernels' argument
    contracts, the stage wiring, the prepared layouts), so a bundle is only as good as the
    dsneuron that wrote it; patch releases keep all of these."""
    import dsneuron

    runtime = runtime or dsneuron.__version__
    mine = _CREATOR.fullmatch(f"dsneuron {runtime}")
    found = _CREATOR.fullmatch(created_by)
    line = f"{mine.group(1)}.{mine.group(2)}" if mine else runtime
    if found is None:
        raise BundleError(f"{MANIFEST}: created_by is {created_by!r}, not 'dsneuron X.Y.Z'; this runtime (dsneuron "
                          f"{runtime}) runs bundles of dsneuron {line}.x only: recompile the bundle")
    if mine is None or found.group(1, 2) != mine.group(1, 2):
        raise BundleError(f"bundle was written by {created_by}; this runtime (dsneuron {runtime}) runs bundles of "
                          f"dsneuron {line}.x only: recompile the bundle with this version")


def _release(version: str) -> str:
    return version.split("+")[0]


def verify_files(root: Path, manifest: Manifest) -> None:
    """Every listed file matches its size and sha256; every file the bundle uses is listed."""
    used = [*manifest.weights_files, *manifest.tokenizer.files, *(f for b in manifest.buckets for f in b.files)]
    for rel in used:
        if rel not in manifest.files:
            raise BundleError(f"{MANIFEST}: {rel} is used by the bundle but has no checksum in the manifest")
    for rel, meta in manifest.files.items():
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise BundleError(f"{MANIFEST}: file path {rel!r} leaves the bundle folder")
        path = root / rel
        if not path.is_file():
            raise BundleError(f"bundle file {rel} is missing from {root}")
        size = path.stat().st_size
        if size != meta["size"]:
            raise BundleError(f"bundle file {rel} has {size} bytes, the manifest records {meta['size']} (tampered or truncated)")
        if file_sha256(path) != meta["sha256"]:
            raise BundleError(f"bundle file {rel} does not match its sha256 in the manifest (tampered or corrupted)")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks (bundle checksums and compile-cache markers)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Bundle:
    """A verified bundle: its folder and manifest."""

    root: Path
    manifest: Manifest

    def load_weights(self) -> dict[str, torch.Tensor]:
        """All tensors the buckets take: the weights file's (safetensors) with the manifest's load
        casts, then its weight views, applied, and the outputs of its prepare recipes; the names
        each bucket uses are checked.

        The tensors kept as stored are views of one memory map of the file, so only the pages a
        run touches become resident (an embedding row per token). Each prepare recipe reads its
        stored tensors through a map of its own, closed once the recipe's outputs are made: pages
        touched while preparing leave this process's resident set with it, instead of staying
        mapped next to their prepared copy (tiny: 0.55 GiB of file pages otherwise).
        """
        m = self.manifest
        taken = {n for b in m.buckets for n in (*b.weights, *(w for st in b.stages for w in st.weights))}
        consumed = {n for p in m.prepare for n in (*p.weights, *p.scales)}
        where: dict[str, str] = {}  # tensor name -> the weights file that holds it
        weights = {}
        for rel in m.weights_files:
            with safe_open(str(self.root / rel), framework="pt") as f:
                for n in f.keys():
                    if n in where:
                        raise BundleError(f"{rel}: holds tensor {n!r}, which {where[n]} holds too")
                    where[n] = rel
                    if n in taken or n not in consumed:
                        weights[n] = self._loaded(f, n)
        what = m.weights_file if len(m.weights_files) == 1 else "the weights files"
        for n in (*m.load_casts, *m.weight_views):
            if n not in where:
                key = "load_casts" if n in m.load_casts else "weight_views"
                raise BundleError(f"{what}: has no tensor {n!r}, which manifest {key} names")
        for p in m.prepare:
            missing = [n for n in (*p.weights, *p.scales) if n not in where]
            if missing:
                raise BundleError(f"{what}: has no tensor {missing[0]!r}, which manifest prepare names")
            stored = {}
            for rel in dict.fromkeys(where[n] for n in (*p.weights, *p.scales)):
                with safe_open(str(self.root / rel), framework="pt") as f:
                    stored.update({n: self._loaded(f, n) for n in (*p.weights, *p.scales) if where[n] == rel})
            try:
                weights.update(prepare_tensors(p, stored))
            except ValueError as e:
                raise BundleError(f"manifest {e}") from None
            del stored
        for b in m.buckets:
            for file, names_in in ((b.file, b.weights), *((st.file, st.weights) for st in b.stages)):
                missing = [n for n in names_in if n not in weights]
                if missing:
                    raise BundleError(f"{what}: has no tensor {missing[0]!r}, which {file} takes")
        return weights

    def stored_tensors(self, want: Callable[[str], bool]) -> dict[str, torch.Tensor]:
        """The tensors of the weights file(s) whose names `want` accepts, as stored (checkpoint dtypes:
        no load cast, view or prepare recipe applied), each a view of a memory map of its file: what
        host-side code reads, e.g. the DSpark drafter of a bundle compiled with `--speculative
        dspark` (its mtp.* tensors, the embedding and the head)."""
        out: dict[str, torch.Tensor] = {}
        for rel in self.manifest.weights_files:
            with safe_open(str(self.root / rel), framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in f.keys() if want(n)})
        return out

    @property
    def speculative(self) -> str:
        """The drafter the bundle carries (compile's `--speculative`): "none" or "dspark"."""
        return self.manifest.compile_config.get("speculative", "none")

    def _loaded(self, f: Any, name: str) -> torch.Tensor:
        """Tensor `name` of the open safetensors file `f`, with its manifest load cast, then view."""
        t = f.get_tensor(name)
        if name in self.manifest.load_casts:
            t = t.to(parse_dtype(self.manifest.load_casts[name], f"load_casts[{name!r}]"))
        if name in self.manifest.weight_views:
            t = t.view(parse_dtype(self.manifest.weight_views[name], f"weight_views[{name!r}]"))
        return t

    @property
    def tokenizer_file(self) -> Path:
        """The bundle's tokenizer.json (the first tokenizer file of the manifest)."""
        files = self.manifest.tokenizer.files
        if not files or Path(files[0]).name != "tokenizer.json":
            raise BundleError(f"{MANIFEST}: tokenizer.files must start with a tokenizer.json (got {list(files)})")
        return self.root / files[0]


def read_manifest(root: Path) -> Manifest:
    """The parsed and validated manifest of the bundle folder `root` (`Manifest.from_json`), without
    checking target, toolchain or files. Raises BundleError naming `root` when it is not a folder
    or has no manifest.json, and naming the manifest when it cannot be read or is not UTF-8 text;
    `dsneuron run` and `dsneuron inspect` both come through here, so they word these alike."""
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise BundleError(f"bundle folder {root} {what}")
    mpath = root / MANIFEST
    if not mpath.is_file() and (root / PARALLEL).is_file():
        raise BundleError(f"{root} is a sharded bundle ({PARALLEL}, one rank bundle in each rank-<r>-of-<world> "
                          "folder): `dsneuron run` runs it, `dsneuron inspect` takes one rank folder (`compare` takes one-process bundles)")
    if not mpath.is_file():
        raise BundleError(f"{root} is not a dsneuron bundle: it has no {MANIFEST} (an interrupted compile leaves none)")
    try:
        data = mpath.read_bytes()
    except OSError as e:
        raise BundleError(f"{mpath}: cannot be read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BundleError(f"{MANIFEST}: not UTF-8 text (invalid byte 0x{data[e.start]:02x} at offset {e.start})") from None
    return Manifest.from_json(text)


#: compiler.backend of a `--stablehlo-only` neuron bundle, whose modules runtime_min/executors/executor_stablehlo.py
#: runs on XLA:CPU (a check of the neuron path on a host without Trainium)
STABLEHLO_BACKEND = "stablehlo"


def is_stablehlo(manifest: Manifest) -> bool:
    """Whether the bundle holds StableHLO modules (`dsneuron compile --target neuron --stablehlo-only`)."""
    return manifest.compiler.get("backend") == STABLEHLO_BACKEND


def open_bundle(path: str | Path, verify_key: str | Path | None = None, inspect: bool = False,
                shard: tuple[int, int, int] | None = None) -> Bundle:
    """Load and verify a bundle folder (module docstring); raises BundleError naming the first problem.
    verify_key: a PEM public key; the bundle must then carry a signature by its private key over
    its files as they are (runtime_min/bundle/signing.py), checked right after the manifest parses.
    inspect: open to describe or sign it, not to run it (`dsneuron inspect`, `sign`): a rank
    folder of a sharded bundle opens on its own. A StableHLO bundle's target and toolchain are not
    checked here (its executor needs only jax, checked when a module loads).
    shard: (tp, ep, rank) of the process that opens a rank bundle of a sharded bundle
    (runtime_min/sharded.py); its manifest's compiler.shard must be that plan and rank. A rank
    bundle opened without it, or an ordinary bundle opened with it, is refused (unless inspect)."""
    root = Path(path).absolute()
    manifest = read_manifest(root)
    recorded = manifest.compiler.get("shard")
    want = None if shard is None else shard_record(*shard)
    if recorded != want and not (inspect and shard is None):
        if want is None:
            raise BundleError(f"{root} is rank {recorded.get('rank')} of a sharded bundle of {recorded.get('tp')} "
                              f"ranks: `dsneuron run` the folder above it ({root.parent}), which starts every rank")
        raise BundleError(f"{root}: compiled as {recorded or 'one process'}, opened as rank {want['rank']} of "
                          f"tp={want['tp']}, ep={want['ep']}")
    if verify_key is not None:
        from .signing import verify_bundle

        verify_bundle(root, Path(verify_key))
    if manifest.target not in TARGETS:
        raise BundleError(f"{MANIFEST}: unknown target {manifest.target!r} (known: {', '.join(TARGETS)})")
    check_creator(manifest.created_by)
    if not is_stablehlo(manifest):
        check_target(manifest.target, "run")
        check_toolchain(manifest.toolchain, target=manifest.target)
    verify_files(root, manifest)
    return Bundle(root, manifest)
