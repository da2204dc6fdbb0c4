"""Atomic bundle writing: build the whole bundle in a temporary sibling folder, then rename it into place.

- The output folder must not exist, unless `force`; with `force` the old bundle stays in place,
  untouched, until the new one is complete, and is then swapped out (SIGINT and SIGTERM are held
  back during the two renames, so neither Ctrl-C nor the CLI's SIGTERM handler can separate them).
- The nearest existing folder above the output must be a writable folder (the temporary folder is
  made beside the output), and an existing output must not be a mount point (it is renamed); this
  and the rules above are checked before any work.
- A folder that holds only placeholder files (`README.md`, `.gitignore`, `.gitkeep`; the repository
  tracks `artifacts/README.md`) counts as empty; those files are carried into the new bundle, unlisted.
  A non-empty folder that is not a bundle (no manifest.json, nor the parallel.json of a sharded
  bundle) is never replaced, even with `force`.
- An exception, KeyboardInterrupt or SystemExit (the CLI turns SIGTERM into one) before `commit`
  removes the temporary folder; temporary folders of
  processes that died (SIGKILL) are removed by the next writer of the same output.
- manifest.json is written last, with the sha256 and size of every other file; runtime_min refuses
  any folder without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import shutil
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from dsneuron import UserError
from dsneuron.disk import check_free, disk_full_is_an_error
from dsneuron.graphs import safetensors_format as sf
from dsneuron.graphs.lazy import CHUNK_BYTES, tensor_chunks
from dsneuron.runtime_min.bundle.schema import (MANIFEST, PARALLEL, WEIGHT_SHARD_BYTES, WEIGHTS, Manifest,
                                                weight_shard_names)

from .cache import file_sha256, pid_alive

PLACEHOLDERS = frozenset({"README.md", ".gitignore", ".gitkeep"})


class OutputError(UserError):
    """The output folder cannot be written: its parent is not a folder or not writable."""


class OutputExistsError(OutputError):
    """The output folder exists (and --force was not given, or it is not a bundle)."""


def check_output(out: Path, force: bool) -> None:
    """Raise OutputError unless `out` may be written (module docstring): OutputExistsError for an
    existing output, OutputError when the nearest existing folder above it is not a writable
    folder. Called before any work."""
    above = Path(out).absolute().parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise OutputError(f"output {out}: {above} is not a folder; choose another --out")
    if not os.access(above, os.W_OK | os.X_OK):
        raise OutputError(f"output {out}: no permission to write in {above}; choose another --out")
    if (out.absolute().parent / PARALLEL).is_file():
        raise OutputError(f"output {out} is inside the sharded bundle {out.absolute().parent} (beside its {PARALLEL}): "
                          "recompile the sharded bundle as a whole, or choose another --out")
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputExistsError(f"output {out} exists and is not a folder; choose another --out")
    if os.path.ismount(out):
        raise OutputError(f"output {out} is a mount point: the bundle is built beside it and renamed into place, "
                          f"which a mount point cannot be; choose a folder inside it, e.g. --out {out / 'bundle'}")
    entries = {p.name for p in out.iterdir()}
    if entries <= PLACEHOLDERS:
        return
    if MANIFEST not in entries and PARALLEL not in entries:
        raise OutputExistsError(f"output folder {out} exists and is not a dsneuron bundle (no {MANIFEST}); "
                                "refusing to replace it, even with --force; choose another --out")
    if not force:
        raise OutputExistsError(f"output folder {out} already holds a bundle; pass --force to replace it "
                                "(the old bundle stays intact until the new one is complete)")


class BundleWriter:
    """Context manager: files go into `self.tmp`; `commit(manifest)` finishes and renames into `out`."""

    def __init__(self, out: Path, force: bool):
        self.out = Path(out).absolute()
        self.force = force
        self.tmp: Path | None = None
        self.committed = False
        #: {rel: (sha256, size, mtime_ns)} of the files hashed while written
        self._digests: dict[str, tuple[str, int, int]] = {}

    def __enter__(self) -> "BundleWriter":
        check_output(self.out, self.force)
        tmp = self.out.with_name(f".{self.out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            _remove_dead_leftovers(self.out)
            tmp.mkdir()
        except OSError as e:
            raise OutputError(f"output {self.out}: cannot create its folder in {self.out.parent} ({e.strerror})") from None
        self.tmp = tmp
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.committed and self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def path(self, rel: str) -> Path:
        """Absolute path of bundle-relative `rel` inside the temporary folder (parents created)."""
        assert self.tmp is not None, "use BundleWriter as a context manager"
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def copy_in(self, src: Path, rel: str) -> None:
        """Copy file `src` into the bundle as `rel`; raises DiskFullError when the disk fills."""
        dst = self.path(rel)
        with disk_full_is_an_error(self.out / rel, Path(src).stat().st_size, f"{rel} of the bundle"):
            shutil.copyfile(src, dst)

    def write_weights(self, weights: Mapping[str, Any], rel: str = WEIGHTS) -> None:
        """Stream `weights` {name: tensor or weight source (graphs/lazy.py)} into the safetensors
        file `rel` (no pickle), one tensor at a time in pieces of CHUNK_BYTES, hashing the bytes as
        they are written; `commit` takes that sha256 instead of reading the file again. The bytes
        are those of `safetensors.torch.save_file(weights)` without metadata (the layout of
        graphs/safetensors_format.py). A tensor must be a contiguous CPU tensor and not share
        storage with another; a source is read only here, chunk by chunk, so the write holds one
        chunk (or one computed tensor) at a time.
        Raises DiskFullError, before writing, when the disk has not their size free, or when it
        fills while writing; ValueError for a dtype without a safetensors name, a non-contiguous
        tensor, or a source that yields another number of bytes than its shape and dtype take."""
        path = self.path(rel)
        specs, nbytes = {}, {}
        for name, w in weights.items():
            if w.dtype not in sf.NAMES:
                raise ValueError(f"weight {name}: dtype {w.dtype} has no safetensors name")
            if isinstance(w, torch.Tensor) and (not w.is_contiguous() or w.device.type != "cpu"):
                raise ValueError(f"weight {name}: the weights file takes contiguous CPU tensors")
            specs[name] = (sf.NAMES[w.dtype], tuple(w.shape))
            nbytes[name] = math.prod(w.shape) * sf.DTYPES[specs[name][0]][1]
        prefix, order = sf.layout(specs)
        need = len(prefix) + sum(nbytes.values())
        check_free(self.out.parent, need, f"the bundle's {rel}")
        digest = hashlib.sha256(prefix)
        # each piece is hashed on a second thread while this one writes it (both release the GIL):
        # the weights file costs the longer of the two instead of their sum
        with disk_full_is_an_error(self.out / rel, need, f"the bundle's {rel}"), open(path, "wb") as f, \
                ThreadPoolExecutor(1, thread_name_prefix="dsneuron-sha256") as hasher:
            f.write(prefix)
            for name in order:
                w = weights[name]
                written = 0
                for piece in (tensor_chunks(w, CHUNK_BYTES) if isinstance(w, torch.Tensor) else w.chunks(CHUNK_BYTES)):
                    hashed = hasher.submit(digest.update, piece)
                    f.write(piece)
                    hashed.result()  # before the next piece: a source may reuse its buffer
                    written += len(piece)
                if written != nbytes[name]:
                    raise ValueError(f"weight {name}: its source gave {written} bytes, {specs[name][0]} "
                                     f"{list(specs[name][1])} takes {nbytes[name]}")
        # a bundle is meant to be shared like any output (safetensors made the file owner-only)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(path, 0o666 & ~mask)
        st = path.stat()
        self._digests[rel] = (digest.hexdigest(), st.st_size, st.st_mtime_ns)

    def write_weight_shards(self, weights: Mapping[str, Any], shard_bytes: int = WEIGHT_SHARD_BYTES) -> tuple[str, ...]:
        """Write `weights` (as `write_weights`) into weights.safetensors when their bytes fit in
        `shard_bytes` and return (); else into weights-<i>-of-<n>.safetensors files of at most
        shard_bytes each (a tensor larger than that alone in its file), tensors in name order, and
        return those names (Manifest.weight_files)."""
        groups: list[dict[str, Any]] = [{}]
        held = 0
        for name in sorted(weights):
            w = weights[name]
            size = math.prod(w.shape) * w.dtype.itemsize
            if groups[-1] and held + size > shard_bytes:
                groups.append({})
                held = 0
            groups[-1][name] = w
            held += size
        if len(groups) == 1:
            self.write_weights(weights)
            return ()
        names = weight_shard_names(len(groups))
        for rel, group in zip(names, groups):
            self.write_weights(group, rel)
        return tuple(names)

    def commit(self, manifest: Manifest, sign: Callable[[Path], Any] | None = None) -> Path:
        """Checksum every file, write manifest.json, call sign(folder) when given (the signature
        is made before the bundle appears at `out`), then move the bundle into place. Returns `out`."""
        assert self.tmp is not None
        files = {}
        for p in sorted(self.tmp.rglob("*")):
            if p.is_file():
                rel = p.relative_to(self.tmp).as_posix()
                st = p.stat()
                known = self._digests.get(rel)
                # hashed while written, unless the file changed since
                sha = known[0] if known and known[1:] == (st.st_size, st.st_mtime_ns) else file_sha256(p)
                files[rel] = {"sha256": sha, "size": st.st_size}
        manifest = dataclasses.replace(manifest, files=files)
        text = manifest.to_json()
        with disk_full_is_an_error(self.tmp / MANIFEST, len(text), MANIFEST):
            (self.tmp / MANIFEST).write_text(text)
        if sign is not None:
            sign(self.tmp)
        return self._move_into_place()

    def commit_top(self, name: str, text: str) -> Path:
        """Write `text` as the folder's top file `name` and move the folder into place: the commit
        of a sharded bundle (compiler/sharded_bundle.py), whose rank bundles inside it were each
        committed with their own manifest. Returns `out`."""
        assert self.tmp is not None
        with disk_full_is_an_error(self.tmp / name, len(text), name):
            (self.tmp / name).write_text(text)
        return self._move_into_place()

    def _move_into_place(self) -> Path:
        check_output(self.out, self.force)  # the folder may have appeared while we compiled
        old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        keep = [p for p in self.out.iterdir() if p.name in PLACEHOLDERS] if self.out.is_dir() else []
        for p in keep:
            shutil.copy2(p, self.tmp / p.name)
        _swap(self.tmp, self.out, old)
        self.committed = True
        shutil.rmtree(old, ignore_errors=True)
        return self.out


def _swap(new: Path, out: Path, old: Path) -> None:
    """Move `out` (if any) to `old` and `new` to `out`, with SIGINT and SIGTERM held back in between."""
    blocked = hasattr(signal, "pthread_sigmask")
    if blocked:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        had_old = out.exists()
        if had_old:
            try:
                os.rename(out, old)
            except OSError as e:  # e.g. an immutable folder: nothing has changed yet
                raise OutputError(f"output {out} cannot be replaced ({e.strerror}); choose another --out (a compile "
                                  "of the same model takes its executables from the compile cache)") from None
        try:
            os.rename(new, out)
        except BaseException:
            if had_old:
                os.rename(old, out)
            raise
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _remove_dead_leftovers(out: Path) -> None:
    """Remove temporary/old siblings of `out` left by processes that no longer run; an old bundle
    whose swap was cut short (by SIGKILL) is put back when `out` is missing."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old)-(\d+)-[0-9a-f]{{8}}$")
    for p in out.parent.iterdir():
        m = pattern.match(p.name)
        if not m or pid_alive(int(m.group(2))):
            continue
        if m.group(1) == "old" and not out.exists():
            os.rename(p, out)
        else:
            shutil.rmtree(p, ignore_errors=True)
