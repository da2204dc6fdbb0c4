"""Shared pytest fixtures. Keep each fixture small, documented and session-scoped when it is costly."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsneuron.compiler.config import load_config
from dsneuron.graphs.config import ModelConfig


@pytest.fixture(scope="session")
def micro_cfg() -> ModelConfig:
    """The packaged `micro` model config."""
    return load_config("micro")[0]


@pytest.fixture(scope="session")
def micro_checkpoint(tmp_path_factory: pytest.TempPathFactory, micro_cfg: ModelConfig) -> Path:
    """One random micro checkpoint (seed 0, default shard size) written once per session.

    Read-only for tests: a test that corrupts a checkpoint works on a copy or on symlinks to it.
    """
    from dsneuron.graphs.checkpoint import make_checkpoint

    return make_checkpoint(micro_cfg, tmp_path_factory.mktemp("ckpt") / "micro", seed=0)


@pytest.fixture(scope="session")
def micro_golden(micro_cfg: ModelConfig, micro_checkpoint: Path):
    """The eager golden model on the micro checkpoint, context capacity = micro's max_seq_len (64)."""
    from dsneuron.graphs.golden import Golden

    return Golden(micro_cfg, micro_checkpoint, load_config("micro")[1].max_seq_len)
