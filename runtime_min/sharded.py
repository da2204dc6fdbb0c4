"""Running a sharded bundle (runtime_min/bundle/schema.py ShardedManifest): one process per rank.

`read_sharded(root)` reads parallel.json and checks every rank folder's manifest.json against the
sha256 it records, before any rank starts. `launch(root, sharded, job, kwargs)` then runs the ranks:

- under torchrun (WORLD_SIZE and RANK in the environment) this process is rank RANK: the world size
  must be the bundle's (refused naming both), the gloo process group comes from env:// and rank 0
  prints;
- otherwise it spawns `world` processes (torch.multiprocessing, spawn), gloo over 127.0.0.1 on a
  free port, os.cpu_count() // world threads each; rank 0 sends its output to this process, which
  prints it, and the first rank that fails stops the others.

Each rank joins the group, loads its rank bundle with `Session.load(..., shard=(tp, ep, rank))` and
calls job(session, out, **kwargs), where out(stream, text) ("stdout" or "stderr") prints on rank 0
and is silent on the others. The ranks run the same steps in the same order (the executables'
collectives meet because every rank gets the same gathered logits, so the same tokens): every
rank takes rank 0's job arguments (its sampler seed too), broadcast once the group is up.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from dsneuron import UserError

from .bundle.bundle import file_sha256
from .bundle.schema import MANIFEST, PARALLEL, BundleError, ShardedManifest, rank_dir

#: out(stream, text): rank 0's output, stream "stdout" or "stderr"
Out = Callable[[str, str], None]
#: job(session, out, **kwargs), run by every rank on its loaded runtime_min/session.py Session
Job = Callable[..., None]


class RankFailed(RuntimeError):
    """A rank of a sharded run died or raised something other than a UserError: the message names
    each such rank and its error or exit code (`dsneuron run` prints it as one line, exit code 1)."""


def read_sharded(root: Path) -> ShardedManifest | None:
    """The ShardedManifest of `root`, None when it is no sharded bundle (no parallel.json). Raises
    BundleError for a malformed parallel.json, a missing rank bundle or one whose manifest.json is
    not the one parallel.json records."""
    path = Path(root) / PARALLEL
    if not path.is_file():
        return None
    try:
        sharded = ShardedManifest.from_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: cannot be read ({e})") from None
    for rank, sha in enumerate(sharded.manifest_sha256):
        manifest = Path(root) / rank_dir(rank, sharded.world) / MANIFEST
        if not manifest.is_file():
            raise BundleError(f"{root}: rank {rank}'s bundle {manifest.parent.name} is missing (no {MANIFEST}); "
                              "recompile the sharded bundle")
        if file_sha256(manifest) != sha:
            raise BundleError(f"{manifest}: not the rank bundle this sharded bundle was written with ({PARALLEL} "
                              "records another manifest sha256); recompile the sharded bundle")
    return sharded


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now, for a gloo rendezvous of spawned ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quiet(stream: str, text: str) -> None:
    pass


def _run_rank(rank: int, sharded: ShardedManifest, root: str, init: str, verify_key: str | None, job: Job,
              kwargs: dict[str, Any], out: Out) -> None:
    from .session import Session

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=sharded.world)
    try:
        agreed = [kwargs]
        dist.broadcast_object_list(agreed, src=0)  # torchrun's processes each parsed their own arguments
        kwargs = agreed[0]
        session = Session.load(Path(root) / rank_dir(rank, sharded.world), verify_key,
                               shard=(sharded.tp, sharded.ep, rank))
        job(session, out if rank == 0 else _quiet, **kwargs)
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, args: dict[str, Any], messages) -> None:
    torch.set_num_threads(args["threads"])
    out: Out = lambda stream, text: messages.put(("out", stream, text))  # noqa: E731
    try:
        _run_rank(rank, args["sharded"], args["root"], f"tcp://127.0.0.1:{args['port']}", args["verify_key"],
                  args["job"], args["kwargs"], out)
    except KeyboardInterrupt:  # Ctrl-C reached the whole process group: the parent reports it
        sys.exit(130)
    except BaseException as e:  # the parent names it and stops the other ranks
        if not isinstance(e, (UserError, SystemExit)):
            traceback.print_exc()
        user = isinstance(e, UserError)
        messages.put(("error", rank, user, str(e) if user else f"{type(e).__name__}: {e}"))
        sys.exit(1)


def launch(root: Path, sharded: ShardedManifest, job: Job, kwargs: dict[str, Any], out: Out,
           verify_key: Path | None = None, term_to_rank0: bool = False) -> None:
    """Run `job` on every rank of the sharded bundle `root` (module docstring); rank 0's output goes
    to out(stream, text). term_to_rank0: a SIGTERM of this process is passed to rank 0 alone,
    which ends the job for every rank (`dsneuron serve` drains), instead of stopping the ranks.
    Raises BundleError for a torchrun world size that is not the bundle's, a rank's UserError as
    its own (every rank meets the same bad input), RankFailed naming each rank that failed
    otherwise."""
    import torch.multiprocessing as mp

    env = os.environ
    key = None if verify_key is None else str(verify_key)
    if "WORLD_SIZE" in env and "RANK" in env:
        world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        if world != sharded.world:
            raise BundleError(f"launched with WORLD_SIZE={world}, but {root} was compiled for {sharded.world} ranks "
                              f"(tp={sharded.tp}, ep={sharded.ep}): launch {sharded.world} processes, e.g. torchrun "
                              f"--nproc-per-node {sharded.world}, or run it without torchrun")
        _run_rank(rank, sharded, str(root), "env://", key, job, kwargs, out)
        return
    args = {"sharded": sharded, "root": str(Path(root).absolute()), "port": free_port(), "verify_key": key, "job": job,
            "kwargs": kwargs, "threads": max(1, (os.cpu_count() or 1) // sharded.world)}
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(r, args, messages)) for r in range(sharded.world)]
    errors: dict[int, tuple[bool, str]] = {}
    stopped: set[int] = set()  # ranks this process terminated: they did not fail by themselves
    previous = None
    if term_to_rank0 and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: procs[0].pid and os.kill(procs[0].pid, signal.SIGTERM))
    try:
        for p in procs:
            p.start()
        while True:
            try:
                msg = messages.get(timeout=0.1)
            except queue.Empty:
                if errors or any(p.exitcode for p in procs):  # a failed rank leaves the others waiting
                    break
                if all(p.exitcode == 0 for p in procs):
                    break
                continue
            if msg[0] == "out":
                out(msg[1], msg[2])
            else:
                errors[msg[1]] = (msg[2], msg[3])
    finally:  # after a success every rank has exited; else the survivors wait for the failed one
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for r, p in enumerate(procs):
            if p.is_alive():
                p.terminate()
                stopped.add(r)
            p.join()
    user = [msg for _, (is_user, msg) in sorted(errors.items()) if is_user]
    if user:
        raise UserError(user[0])
    bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode and r not in stopped}
    if bad:
        said = "; ".join(f"rank {r}: {errors[r][1] if r in errors else f'exit code {code}'}" for r, code in bad.items())
        raise RankFailed(f"sharded run of {root}: {said}" + (f" (stopped the other ranks: {sorted(stopped)})"
                                                             if stopped else ""))
