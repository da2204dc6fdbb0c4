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
