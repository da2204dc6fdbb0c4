"""A sharded bundle: one ordinary bundle per rank of a parallel plan, and parallel.json naming them.

    parallel.json         runtime_min/bundle/schema.py ShardedManifest: tp, ep, world, each rank's manifest sha256
    rank-<r>-of-<world>/  rank r's bundle (runtime_min/bundle/schema.py), compiled by `compile_bundle`

Each rank's bundle comes from that rank's parts (compiler/model_steps.py build_model_parts with
`par` and `rank`): its executables hold the rank's constants (its expert ids, vocabulary rows,
engram columns) and call the collectives of runtime_min/executors/collectives.py, and its weights file holds
the rank's slices only, under their checkpoint names, so nothing is re-sharded at load. A graph two
ranks share (a replicated stage) is compiled once, through the compile cache. The whole folder is
written atomically (compiler/bundle_writer.py): the ranks are built inside one temporary sibling,
parallel.json last. cpu target only; the neuron target's NxD layers are not written.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

import dsneuron
from dsneuron.graphs.config import ModelConfig
from dsneuron.runtime_min.bundle.bundle import file_sha256
from dsneuron.runtime_min.bundle.schema import MANIFEST, PARALLEL, ShardedManifest, rank_dir

from .bundle_writer import BundleWriter
from .compile import compile_bundle
from .config import CompileConfig
from .model_steps import build_model_parts
from .parallel import check_shardable
from .placement import Parallel


def compile_sharded_bundle(model_cfg: ModelConfig, compile_cfg: CompileConfig, out: Path, par: Parallel, *,
                           cache_dir: Path | None = None, force: bool = False, console: Console | None = None,
                           sign_key: Path | None = None) -> Path:
    """Compile the cpu target's bundle of every rank of `par` (par.tp >= 2 processes) into `out`
    (module docstring) and return `out`; sign_key signs each rank bundle. Raises UserError for a plan
    the cpu target cannot shard (compiler/parallel.py check_shardable) and whatever `compile_bundle`
    raises; the old folder at `out` is untouched by any failure."""
    console = console or Console(stderr=True)
    check_shardable(model_cfg, par)
    if par.tp < 2:
        raise ValueError(f"compile_sharded_bundle: a sharded bundle has 2 or more ranks, got tp={par.tp}")
    hashes = []
    with BundleWriter(Path(out), force) as writer:
        for rank in range(par.tp):
            console.print(f"rank {rank} of {par.tp} (tp={par.tp}, ep={par.ep}):", highlight=False)
            parts = build_model_parts(model_cfg, compile_cfg, cache_dir, target="cpu", par=par, rank=rank)
            folder = writer.path(rank_dir(rank, par.tp))
            compile_bundle(model_cfg, compile_cfg, folder, parts, cache_dir=cache_dir, console=console,
                           sign_key=sign_key, label=f"rank {rank} of {par.tp} compiled")
            del parts  # one rank's weights at a time
            hashes.append(file_sha256(folder / MANIFEST))
        sharded = ShardedManifest(par.tp, par.ep, tuple(hashes), created_by=f"dsneuron {dsneuron.__version__}")
        path = writer.commit_top(PARALLEL, sharded.to_json())
    console.print(f"sharded bundle written to {path} ({par.tp} ranks)", highlight=False)
    return path
