"""The main job on the cpu target with the real model: the session's micro probe bundle (conftest
`micro_bundle`: one prefill and one decode bucket) run through the CLI and runtime_min."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from rich.console import Console

from dsneuron.compiler.compile import build_steps_for_config, compile_bundle


def test_run_generates_text_from_the_bundle(micro_bundle):
    r = subprocess.run([sys.executable, "-m", "dsneuron.compiler.cli", "run", str(micro_bundle.path), "--prompt", "Hello there",
                        "--max-new-tokens", "5"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_prompt_longer_than_the_largest_bucket_exits_2(micro_bundle):
    r = subprocess.run([sys.executable, "-m", "dsneuron.compiler.cli", "run", str(micro_bundle.path), "--prompt", "word " * 40,
                        "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "16" in r.stderr


def test_second_compile_with_the_same_cache_compiles_nothing(micro_bundle, tmp_path):
    b = micro_bundle
    parts = build_steps_for_config(b.model_cfg, b.compile_cfg, b.cache, probes=True)
    console = Console(file=io.StringIO(), width=300)
    again = compile_bundle(b.model_cfg, b.compile_cfg, tmp_path / "bundle2", parts, cache_dir=b.cache, console=console)
    assert "(0 of " in console.file.getvalue()

    def executables(root):
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in (root / "buckets").rglob("*.pt2")}

    first = executables(b.path)
    assert len(first) >= 4 and executables(again) == first  # staged: one per stage kind and bucket


def test_inspect_lists_the_stage_executables(micro_bundle):
    """`dsneuron inspect` on a staged bundle: each bucket's size is that of its stage executables,
    and every stage kind is listed with the stages that run it."""
    r = subprocess.run([sys.executable, "-m", "dsneuron.compiler.cli", "inspect", str(micro_bundle.path)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    from dsneuron.runtime_min.bundle import read_manifest

    m = read_manifest(micro_bundle.path)
    for b in m.buckets:
        files = {st.file for st in b.stages}
        mib = sum(m.files[f]["size"] for f in files) / 2**20
        assert f"{mib:.2f}" in r.stdout
        for f in files:
            assert f in r.stdout
    assert "stages (one executable per stage kind)" in r.stdout and "layers.0" in r.stdout
    assert "prepared at load" in r.stdout and "weights 0 tensors" not in r.stdout
