"""Disk space for the big writes (checkpoint shards, bundle weights, executables): checked before
writing where the size is known, and a full disk met while writing turned into one clear error.

Both raise `DiskFullError` (a UserError: exit code 2 from the CLI) naming the path, the bytes
needed and the bytes free. The writers that call these write into a temporary folder and remove it
on any error, so a full disk leaves nothing half-written at the destination.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from . import UserError

#: the environment variable that moves dsneuron's cache folder
ENV_VAR = "DSNEURON_CACHE_DIR"

#: kept free on top of a write's own size (file system metadata, the manifest, small files)
SLACK_BYTES = 16 * 2**20


def default_cache_dir() -> Path:
    """dsneuron's cache folder (the compile cache, generated checkpoints, built kernels, token
    maps): $DSNEURON_CACHE_DIR if set, else ~/.cache/dsneuron. Not created here."""
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dsneuron"


class DiskFullError(UserError):
    """Not enough free space for a write (checked before it, or ENOSPC / EDQUOT during it)."""


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged writer on the file system that holds `path` (or the nearest
    existing parent folder of it)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_free(path: Path, need: int, what: str) -> None:
    """Raise DiskFullError unless the file system of `path` has `need` bytes (+ SLACK_BYTES) free."""
    free = free_bytes(path)  # of the nearest existing folder, which a write into `path` fills
    if free < need + SLACK_BYTES:
        raise DiskFullError(f"not enough disk space for {what} in {Path(path).absolute()}: it needs "
                            f"{_mib(need)} (+ {_mib(SLACK_BYTES)} slack), {_mib(free)} free; free some space or "
                            "choose another folder")


def _is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # safetensors (Rust) reports the OS error in its message rather than as an OSError
    text = str(e)
    return f"os error {errno.ENOSPC}" in text or "No space left on device" in text


@contextmanager
def disk_full_is_an_error(path: Path, need: int, what: str) -> Iterator[None]:
    """Within this block, a full disk (ENOSPC or EDQUOT, from Python or from safetensors) while
    writing `what` to `path` becomes a DiskFullError naming the bytes needed and free."""
    try:
        yield
    except Exception as e:
        if not _is_disk_full(e):
            raise
        raise DiskFullError(f"disk full while writing {what} to {Path(path).absolute()}: it needs {_mib(need)}, "
                            f"{_mib(free_bytes(path))} free now; free some space or choose another folder") from None


def check_output_file(path: Path, flag: str) -> None:
    """Raise UserError unless the file `path` (given as `flag`, e.g. "--json") can be written: its
    folder exists and is writable, and it is no folder itself. Called before the work whose figures
    it will hold, so that minutes of work are not lost to a typo."""
    path = Path(path)
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: its folder {path.parent} does not exist")
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder; give a file path")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise UserError(f"{flag} {path}: no permission to write it")
