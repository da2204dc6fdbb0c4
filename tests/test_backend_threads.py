"""compiler/backend_cpu.py: the glue kernels Inductor generates run on every thread, and never split a
reduction across threads, so an executable's bits do not depend on the thread count it runs with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsneuron.compiler.backend_cpu import compile_cpu, effective_flags, kernel_sources
from dsneuron.compiler.export import CompileError


class _Glue(torch.nn.Module):
    """A whole-tensor sum (a pure reduction: Inductor's widest choice splits its loop across
    threads), row sums over long rows (Inductor would move the threads onto the reduction loop),
    and an elementwise map (the outer loops a thread may take)."""

    def forward(self, x, y):
        return x.sum(), (x * y).sum(dim=1), torch.exp(x) * y + 1


def _kernel_source(package: Path) -> str:
    return "".join(kernel_sources(package).values())


def _run(package: Path, threads: int, *args: torch.Tensor) -> list[torch.Tensor]:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return list(torch._inductor.aoti_load_package(str(package))(*args))
    finally:
        torch.set_num_threads(before)


def test_glue_runs_on_threads_and_its_reductions_do_not_depend_on_them(tmp_path, monkeypatch):
    from torch._inductor import metrics

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 1 << 16, generator=g), torch.randn(4, 1 << 16, generator=g)
    program = torch.export.export(_Glue(), (x, y), strict=False)
    flags = {**effective_flags(), "cpp.threads": 2}
    assert flags["cpp.dynamic_threads"]

    metrics.reset()
    compile_cpu(program, tmp_path / "glue.pt2", flags)
    assert metrics.parallel_reduction_count == 0
    source = _kernel_source(tmp_path / "glue.pt2")
    assert "#pragma omp parallel" in source and "num_threads(" not in source  # the run's thread count

    # the same flags without rows_to_threads: Inductor splits the reductions (so the check above can fail)
    metrics.reset()
    with torch._inductor.config.patch(flags):
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "split.pt2"))
    assert metrics.parallel_reduction_count > 0

    # a decode-sized nest (fewer than threads x cpp.min_chunk_size elements) stays serial
    small = (x[:1, :1024], y[:1, :1024])
    compile_cpu(torch.export.export(_Glue(), small, strict=False), tmp_path / "small.pt2", flags)
    assert "#pragma omp" not in _kernel_source(tmp_path / "small.pt2")
    for got, want in zip(_run(tmp_path / "small.pt2", 2, *small), _Glue()(*small)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)

    one = _run(tmp_path / "glue.pt2", 1, x, y)
    for threads in (2, 3):
        for got, want in zip(_run(tmp_path / "glue.pt2", threads, x, y), one):
            assert torch.equal(got, want), f"{threads} threads"
    want = _Glue()(x, y)
    torch.testing.assert_close(one[2], want[2])
    torch.testing.assert_close(one[1], want[1], rtol=1e-5, atol=1e-3)


class _ScatterAdd(torch.nn.Module):
    def forward(self, x, idx, v):
        return torch.index_put(x, (idx,), v, accumulate=True)


def test_atomic_adds_are_refused(tmp_path, monkeypatch):
    """A scatter-add that Inductor lowers to atomic adds (their order across threads would change
    the sums): compile_cpu raises CompileError naming it and writes nothing."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    args = (torch.zeros(64, 256), torch.randint(0, 64, (4096,)), torch.randn(4096, 256))
    program = torch.export.export(_ScatterAdd(), args, strict=False)
    with pytest.raises(CompileError, match="atomic adds"):
        compile_cpu(program, tmp_path / "scatter.pt2", {**effective_flags(), "cpp.threads": 2})
    assert not (tmp_path / "scatter.pt2").exists()

