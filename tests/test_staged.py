"""compiler/staged.py: the backend's warm-up is started by the first bucket that misses the cache
and finished before the workers are forked; compiler/backend_cpu.py's warm-up probes the ISAs."""

from __future__ import annotations

import threading
import time

import pytest

from dsneuron.compiler import backend_cpu
from dsneuron.compiler.buckets import PlannedBucket
from dsneuron.compiler.cache import CompileCache
from dsneuron.compiler.staged import StagedCompile

PB = PlannedBucket(kind="decode", batch=1, seq_len=1, capacity=8)


class _Stop(Exception):
    """Raised by the stand-in model where planning would build the stage graphs."""


class _Steps:
    def stages(self, *args, **kwargs):
        raise _Stop


class _Parts:
    steps = _Steps()


class _Backend:
    def __init__(self):
        self.started = 0

    def warm_up(self) -> threading.Thread:
        self.started += 1
        thread = threading.Thread(target=lambda: None)
        thread.start()
        return thread


def test_a_cache_hit_starts_no_warm_up_and_the_first_miss_starts_one(tmp_path, monkeypatch):
    backend = _Backend()
    sc = StagedCompile(_Parts(), backend, CompileCache(tmp_path), ({}, {}, "cpu"))
    monkeypatch.setattr(sc.cache, "get_alias", lambda prekey: {"kinds": {}})
    assert sc.plan(PB, "0" * 64, "buckets/decode_b1_s8")
    assert backend.started == 0, "a bucket from the cache started the warm-up"
    monkeypatch.setattr(sc.cache, "get_alias", lambda prekey: None)
    for _ in range(2):
        with pytest.raises(_Stop):
            sc.plan(PB, "0" * 64, "buckets/decode_b1_s8")
    assert backend.started == 1


def test_run_finishes_the_warm_up_before_the_workers_start(tmp_path):
    done = threading.Event()

    def slow():
        time.sleep(0.3)
        done.set()

    sc = StagedCompile(_Parts(), _Backend(), CompileCache(tmp_path), ({}, {}, "cpu"))
    sc.warming = threading.Thread(target=slow)
    sc.warming.start()
    sc.run(2, lambda done, total: None)
    assert done.is_set()


def test_cpu_warm_up_leaves_the_isa_answer_in_this_process():
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    valid_vec_isa_list.cache_clear()
    backend_cpu.warm_up().join()
    assert valid_vec_isa_list.cache_info().currsize == 1


def _pid(_: int) -> int:
    import os
    return os.getpid()


def test_workers_are_forked_until_jax_is_up_then_tasks_run_here():
    """No fork after a threaded runtime is up (JAX warns a fork then "will likely lead to a
    deadlock"): before jax's XLA client starts the tasks run in forked workers (other pids), after
    it in this process. The check runs in a fresh interpreter, so this test's process state (jax
    imported or not by earlier tests) does not decide it."""
    import subprocess
    import sys

    code = ("import os, jax.numpy as jnp\n"
            "from dsneuron.compiler import staged\n"
            "from tests.test_staged import _pid\n"
            "before = staged.run_forked(2, _pid, 2, lambda d, t: None)\n"
            "assert staged.threaded_runtimes() == [], staged.threaded_runtimes()\n"
            "jnp.ones(2).block_until_ready()\n"
            "assert staged.threaded_runtimes() == ['jax']\n"
            "after = staged.run_forked(2, _pid, 2, lambda d, t: None)\n"
            "print(os.getpid() in before, after == [os.getpid()] * 2)\n")
    from pathlib import Path
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
    assert "fork" not in out.stderr
