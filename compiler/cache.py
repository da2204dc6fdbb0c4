"""The compile cache: one compiled executable per key, shared by every bundle built on this host.

Key = sha256 over (a) the normalised lowered graph: one line per node with its op, target, argument
names/literals and output shape/dtype/stride, plus the graph signature, the range of every dynamic
dimension (an executable built for 1..16 tokens must not serve 1..64) and a digest of every
embedded constant; stack traces, source paths and line numbers live only in node metadata and never
enter it, so two checkouts in different folders give the same key; (b) the backend flags, normalised
so that order and whitespace do not matter; (c) toolchain versions (python, torch, machine, cpu ISA
extensions); (d) the target and the backend name.

Layout under the root (default ~/.cache/dsneuron, env DSNEURON_CACHE_DIR, or --cache-dir):
    entries/<key>/<artifact>   the executable
    entries/<key>/COMPLETE     completion marker: JSON with the artifact's name, size and sha256
    aliases/<prekey>.json      optional front index: a pre-export key -> the graph key plus what the
                               manifest needs about the bucket (see `pre_key`)
An entry is written in a private temporary folder and renamed into place in one step; a folder
without its marker, or whose artifact does not match the marker, is not an entry (a miss). Two
processes compiling the same key both succeed: the first rename wins, the second discards its copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from dsneuron import UserError
from dsneuron.disk import ENV_VAR, default_cache_dir, disk_full_is_an_error
from dsneuron.runtime_min.bundle.bundle import file_sha256

MARKER = "COMPLETE"
_KEY_FORMAT = 2  # bump when the key's ingredients change


def cache_root(cache_dir: Path | None) -> Path:
    """The compile cache folder: `cache_dir`, or `default_cache_dir()` when None, created if missing.
    Raises UserError when that path exists and is not a folder, or cannot be created or written."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if root.exists() and not root.is_dir():
        raise UserError(f"compile cache {root} is not a folder (set --cache-dir or ${ENV_VAR} to a folder)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"compile cache {root}: cannot create it ({e.strerror}; set --cache-dir or ${ENV_VAR})") from None
    if not os.access(root, os.W_OK | os.X_OK):  # an existing folder: the compile writes into it
        raise UserError(f"compile cache {root}: no permission to write in it (set --cache-dir or ${ENV_VAR})")
    return root


def normalise_flags(flags: dict[str, Any] | str | list[str]) -> list[str]:
    """Backend flags in canonical form: one "name value" string per flag occurrence, sorted.

    A dict (Inductor config) gives "key=json(value)". A command-line string or token list (neuronx-cc)
    is split shell-style; a token starting with "-" (and not a number) opens a flag and following
    non-flag tokens are its value ("--lnc 2", "--lnc=2" and "--lnc  2" agree; runs of whitespace
    inside a quoted value count as one space). A flag given several times keeps every occurrence, in
    order: some compiler options accumulate (neuronx-cc --tensorizer-options), so dropping one is a
    flag change and must change the key; for single-valued flags this only costs a recompile.
    Sorting by flag name (stable) makes the order of different flags irrelevant.
    """
    if isinstance(flags, dict):
        return sorted(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in flags.items())
    tokens = shlex.split(flags) if isinstance(flags, str) else [t for f in flags for t in shlex.split(f)]
    groups: list[tuple[str, list[str]]] = []
    for tok in tokens:
        if tok.startswith("-") and not is_number(tok):
            name, eq, value = tok.partition("=")
            groups.append((name, [" ".join(value.split())] if eq else []))
        elif not groups:
            groups.append(("", [tok]))
        else:
            groups[-1][1].append(" ".join(tok.split()))
    # shell quoting keeps "--opt 'a b'" (one value) apart from "--opt a b" (two)
    return [shlex.join([name, *vals] if name else vals) for name, vals in sorted(groups, key=lambda g: g[0])]


def is_number(token: str) -> bool:
    """"-1" or "-0.5" is a value, not a flag."""
    try:
        float(token)
    except ValueError:
        return False
    return True


def normalised_graph(program: torch.export.ExportedProgram) -> str:
    """The graph as text without any source location (see the module docstring)."""
    sig = program.graph_signature
    lines = [f"signature {spec.kind.name} {_arg_name(spec.arg)} {spec.target}" for spec in sig.input_specs]
    lines += [f"output {spec.kind.name} {_arg_name(spec.arg)}" for spec in sig.output_specs]
    lines += sorted(f"range {sym} [{r.lower}, {r.upper}]" for sym, r in program.range_constraints.items())
    used = {n.name for n in program.graph.nodes if n.op == "placeholder" and n.users}
    values = {**program.state_dict, **program.constants}
    for spec in sig.input_specs:
        if spec.kind.name in ("BUFFER", "CONSTANT_TENSOR") and _arg_name(spec.arg) in used:
            value = values.get(spec.target)
            lines.append(f"constant {spec.target} " + (_tensor_digest(value) if isinstance(value, torch.Tensor) else repr(type(value))))
    lines += _graph_lines(program.graph_module, "")
    return "\n".join(lines)


def _graph_lines(gm: torch.fx.GraphModule, prefix: str) -> list[str]:
    """One line per node; subgraphs of higher-order ops (get_attr of a GraphModule) are inlined."""
    lines = []
    for node in gm.graph.nodes:
        lines.append(f"{prefix}{node.op} {node.name} {_target(node.target)} {_fmt(node.args)} {_fmt(node.kwargs)} :: {_meta(node)}")
        if node.op == "get_attr":
            sub = getattr(gm, str(node.target), None)
            if isinstance(sub, torch.fx.GraphModule):
                lines += _graph_lines(sub, prefix + "  ")
            elif isinstance(sub, torch.Tensor):
                lines.append(f"{prefix}  = {_tensor_digest(sub)}")
    return lines


def cache_key(graph_text: str, flags: dict[str, Any] | str | list[str], toolchain: dict[str, Any], target: str, backend: str) -> str:
    """sha256 hex of the key ingredients (module docstring)."""
    body = json.dumps({"format": _KEY_FORMAT, "graph": graph_text, "flags": normalise_flags(flags),
                       "toolchain": toolchain, "target": target, "backend": backend}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def pre_key(fingerprint: str, bucket: dict[str, Any], weights_digest: str, flags: dict[str, Any] | str | list[str],
            toolchain: dict[str, Any], target: str, backend: str) -> str:
    """A key computable before export, for the front index that lets an unchanged bucket skip
    torch.export (which is most of a warm compile). `fingerprint` comes from the model side and must
    change whenever the step graphs could (e.g. the sha256 of the model's source files and config);
    the compiler's own sources, the bucket shape, the weights' names/shapes/dtypes, flags, toolchain
    and target are added here. Without a fingerprint there is no pre-key and every bucket is exported."""
    body = json.dumps({"format": _KEY_FORMAT, "fingerprint": fingerprint, "bucket": bucket, "weights": weights_digest,
                       "compiler": source_digest(Path(__file__).parent), "flags": normalise_flags(flags),
                       "toolchain": toolchain, "target": target, "backend": backend}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def source_digest(*folders: Path, exclude: Callable[[Path], bool] | None = None) -> str:
    """sha256 over the relative paths and contents of the .py files under `folders` (not their
    location, so two checkouts agree), leaving out those whose folder-relative path `exclude` names."""
    h = hashlib.sha256()
    for folder in folders:
        for p in sorted(Path(folder).rglob("*.py")):
            if exclude is not None and exclude(p.relative_to(folder)):
                continue
            h.update(p.relative_to(folder).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _valid_artifact(entry: Path) -> Path | None:
    """The artifact of a cache entry folder when its marker matches it (name, size, sha256), else None."""
    try:
        marker = json.loads((entry / MARKER).read_text())
        artifact = entry / marker["artifact"]
        ok = artifact.is_file() and artifact.stat().st_size == marker["size"] and file_sha256(artifact) == marker["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    return artifact if ok else None


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` runs (of any user): the owner test of temporary folders named by pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: a stage executable's build folder in the cache root: ".build.<pid of the building process>-<random>"
BUILD_PREFIX = ".build."


class CompileCache:
    """get/put of compiled artifacts by key under `root` (created on first put)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.hits = 0
        self.misses = 0

    def build_folder(self) -> tempfile.TemporaryDirectory:
        """A temporary folder in the root for one build, named by this process, after removing the
        build folders of processes that no longer run (a worker killed by SIGTERM or SIGKILL
        cannot remove its own)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for p in self.root.glob(f"{BUILD_PREFIX}*"):
            m = re.fullmatch(rf"{re.escape(BUILD_PREFIX)}(\d+)-.*", p.name)
            if m and not pid_alive(int(m.group(1))):
                shutil.rmtree(p, ignore_errors=True)
        return tempfile.TemporaryDirectory(prefix=f"{BUILD_PREFIX}{os.getpid()}-", dir=self.root)

    def _entry(self, key: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError(f"cache key must be a sha256 hex digest, got {key!r}")
        return self.root / "entries" / key

    def get(self, key: str) -> Path | None:
        """The cached artifact of `key`, or None. Counts a hit or a miss; an entry whose marker is
        missing or does not match its artifact is a miss."""
        artifact = _valid_artifact(self._entry(key))
        if artifact is not None:
            self.hits += 1
            return artifact
        self.misses += 1
        return None

    def put(self, key: str, artifact: Path) -> Path:
        """Copy `artifact` into the entry of `key` atomically; returns the cached path (the one a
        concurrent writer put there first, if it won the race). Raises DiskFullError (nothing
        left behind) when the disk fills."""
        entry = self._entry(key)
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.{uuid.uuid4().hex[:8]}.", dir=entry.parent))
        try:
            with disk_full_is_an_error(tmp, artifact.stat().st_size, f"compile cache entry {artifact.name}"):
                shutil.copyfile(artifact, tmp / artifact.name)
                marker = {"artifact": artifact.name, "size": (tmp / artifact.name).stat().st_size,
                          "sha256": file_sha256(tmp / artifact.name)}
                (tmp / MARKER).write_text(json.dumps(marker))
            if entry.exists() and _valid_artifact(entry) is None:
                # a leftover or a corrupted entry: renamed away first (one rename, so a concurrent
                # compile sees either it or none), then replaced by this complete one
                stale = entry.parent / f".stale.{key[:16]}.{uuid.uuid4().hex[:8]}"
                try:
                    os.rename(entry, stale)
                except OSError:  # another process moved or replaced it already
                    pass
                shutil.rmtree(stale, ignore_errors=True)
            try:
                os.rename(tmp, entry)
            except OSError:  # another process renamed its complete entry first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return entry / json.loads((entry / MARKER).read_text())["artifact"]


    def get_alias(self, prekey: str) -> dict[str, Any] | None:
        """The front-index record of `prekey` when its graph entries are complete, else None (a
        miss). A record names one "graph_key" (its "artifact" is added) or, for a staged bucket,
        {stage kind: graph key} in "kinds" (the "artifacts" {kind: path} are added)."""
        self._entry(prekey)  # validates the form
        try:
            record = json.loads((self.root / "aliases" / f"{prekey}.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict):
            return None
        keys = record.get("kinds") if isinstance(record.get("kinds"), dict) else {"": record.get("graph_key")}
        artifacts = {}
        for kind, key in keys.items():
            artifact = self.get(key) if isinstance(key, str) and re.fullmatch(r"[0-9a-f]{64}", key) else None
            if artifact is None:
                return None
            artifacts[kind] = artifact
        if "kinds" in record:
            return {**record, "artifacts": artifacts}
        return {**record, "artifact": artifacts[""]}

    def put_alias(self, prekey: str, record: dict[str, Any]) -> None:
        """Write the front-index record atomically (temporary file, then rename)."""
        self._entry(prekey)
        folder = self.root / "aliases"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{prekey}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.write_text(json.dumps(record, sort_keys=True))
        os.replace(tmp, folder / f"{prekey}.json")


def _arg_name(arg: Any) -> str:
    return getattr(arg, "name", repr(arg))


def _target(target: Any) -> str:
    """A node target as text that is the same in every process: op names, never a repr holding a
    memory address (a higher-order op such as while_loop is an object whose repr has one)."""
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    name = getattr(target, "__qualname__", None)
    if name is None:
        raise TypeError(f"cache key: no stable name for the graph target {target!r} ({type(target).__name__})")
    return f"{getattr(target, '__module__', '')}.{name}"


def _fmt(value: Any) -> str:
    if isinstance(value, torch.fx.Node):
        return f"%{value.name}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_fmt(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, torch.Tensor):
        return f"tensor{_tensor_digest(value)}"
    return repr(value)


def _meta(node: torch.fx.Node) -> str:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    parts = []
    for v in vals:
        if isinstance(v, torch.Tensor):
            parts.append(f"{v.dtype} {tuple(v.shape)} {tuple(v.stride())}")
        else:
            parts.append(type(v).__name__)
    return "; ".join(parts)


def _tensor_digest(t: torch.Tensor) -> str:
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.to(torch.uint8) if flat.dtype == torch.bool else flat.view(torch.uint8)
    h = hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:32]
    return f"<{t.dtype} {tuple(t.shape)} {h}>"
