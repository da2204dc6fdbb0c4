"""Shared pytest fixtures. Keep each fixture small, documented and session-scoped when it is costly."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsneuron.compiler.config import CompileConfig, load_config
from dsneuron.graphs.config import ModelConfig

# every AOTInductor executable a test runs (in this process or a CLI child) checks its inputs'
# shapes against the ranges it was compiled for: a per-token executable called with one token, or
# a prefill executable with more tokens than its range, fails instead of reading past its buffers
os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"


@pytest.fixture(scope="session")
def micro_cfg() -> ModelConfig:
    """The packaged `micro` model config."""
    return load_config("micro")[0]


@pytest.fixture(scope="session")
def micro_checkpoint(tmp_path_factory: pytest.TempPathFactory, micro_cfg: ModelConfig) -> Path:
    """One random micro checkpoint (seed 0, default shard size) written once per session.

    Read-only for tests: a test that corrupts a checkpoint works on a copy or on symlinks to it.
    """
    from dsneuron.graphs.checkpoint_make import make_checkpoint

    return make_checkpoint(micro_cfg, tmp_path_factory.mktemp("ckpt") / "micro", seed=0)


@pytest.fixture(scope="session")
def micro_golden(micro_cfg: ModelConfig, micro_checkpoint: Path):
    """The eager golden model on the micro checkpoint, context capacity = micro's max_seq_len (64)."""
    from dsneuron.graphs.golden import Golden

    return Golden(micro_cfg, micro_checkpoint, load_config("micro")[1].max_seq_len)


@dataclass
class MicroBundle:
    """A compiled micro bundle and what it was built from."""

    path: Path
    model_cfg: ModelConfig
    compile_cfg: CompileConfig
    cache: Path


@pytest.fixture(scope="session")
def micro_bundle(tmp_path_factory: pytest.TempPathFactory, micro_checkpoint: Path) -> MicroBundle:
    """A probe bundle (`compile --probes`) of micro with one prefill bucket (batch 1, seq_len 16) and
    one decode bucket (batch 1, capacity 64), compiled once per session: two AOTInductor compiles,
    about 4-5 minutes on 2 cores. Shared by the main-job, compare and bucket-regression tests."""
    from dsneuron.compiler.compile import build_steps_for_config, compile_bundle

    model_cfg, compile_cfg, _ = load_config("micro")
    compile_cfg = dataclasses.replace(compile_cfg, batch_sizes=(1,), prefill_seq_lens=(16,), decode_context_lens=(64,),
                                      chunked_prefill=False,  # its chunk bucket: tests/test_chunked_prefill.py (slow)
                                      checkpoint=str(micro_checkpoint))
    root = tmp_path_factory.mktemp("micro_bundle")
    parts = build_steps_for_config(model_cfg, compile_cfg, root / "cache", probes=True)
    out = compile_bundle(model_cfg, compile_cfg, root / "bundle", parts, cache_dir=root / "cache")
    return MicroBundle(out, model_cfg, compile_cfg, root / "cache")


@pytest.fixture(scope="session")
def portable_ops():
    """The cpu kernels' portable C++ layer, built beside the host's AVX2 one under the namespace
    dsneuron_generic (a cold build takes ~25 s once per machine, then it is cached); skipped on a
    host that runs the portable build already."""
    import torch

    from dsneuron.kernels_nki import cpu_gemm

    if cpu_gemm.VARIANT != "avx2":
        pytest.skip("the host runs the portable build already")
    cpu_gemm.build("generic", "dsneuron_generic")
    return torch.ops.dsneuron_generic
