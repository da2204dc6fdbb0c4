"""Tests of kernels_nki/cpu_gemm_fast.py: the fast-numerics GEMM ops (bf16 dot products).

Bounded: within `error_bound` of the float64 value of bf16(a) @ W.T on all three formats (random
shapes, every FP8 code but NaN, every FP4 code), and within bf16 rounding of torch.mm on bf16
operands. Bitwise on one host: a row alone equals the row inside a batch of 1..8 (and at any place
in it), one thread equals two, the grouped op equals per-expert calls, a GEMM continued from init
is the same sum. Exact weight expansion: an identity activation reads back every FP8 code (NaN
included) as its value times its scale. Bad arguments raise ValueError naming the argument.
On AMX hosts the same tests run the AMX layer (block scales folded into the weights), plus its
per-block path for scales outside the fold range and the switch that turns AMX off.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from dsneuron.kernels_nki import cpu_gemm as G
from dsneuron.kernels_nki import cpu_gemm_fast as F
from tests.test_cpu_gemm import activations, assert_bits, checkpoint_weight

FAST = settings(max_examples=25, deadline=None, derandomize=True)
OPS = torch.ops.dsneuron


def run(fmt, a, weight, scale):
    return F.gemm(a, G.prepare_weight(fmt, weight, scale), fmt, weight.shape[-2])


@FAST
@given(fmt=st.sampled_from(F.FAST_FORMATS), m=st.integers(0, 30), n=st.integers(1, 70), kb=st.integers(1, 40),
       seed=st.integers(0, 2**31 - 1))
def test_within_the_bound_of_the_float64_value(fmt, m, n, kb, seed):
    gen = torch.Generator().manual_seed(seed)
    weight, scale = checkpoint_weight(fmt, n, 32 * kb, gen)
    a = activations(m, 32 * kb, gen)
    err = (run(fmt, a, weight, scale).double() - F.gemm_fast_ref(a, fmt, weight, scale)).abs()
    assert (err <= F.error_bound(a, fmt, weight, scale)).all()


@pytest.mark.parametrize("fmt", F.FAST_FORMATS)
def test_close_to_torch_mm_bf16(fmt):
    """The reference a bf16 GEMM user would reach for: torch.mm on bf16 operands, fp32 out."""
    gen = torch.Generator().manual_seed(3)
    weight, scale = checkpoint_weight(fmt, 96, 512, gen)
    a = activations(17, 512, gen)
    w = G.dequant_weight(fmt, weight, scale)
    want = torch.mm(a.to(torch.bfloat16), w.to(torch.bfloat16).T).float()
    got = run(fmt, a, weight, scale)
    mag = a.abs().to(torch.bfloat16).float() @ w.abs().T
    assert ((got - want).abs() <= 2**-7 * mag + 1e-30).all()


def test_expansion_is_exact_for_every_fp8_code():
    """Weight row n holds code n at k = 0 and zeros elsewhere; a = e_0 reads back every code's value
    times its scale, subnormals and the NaN codes (e4m3fn 0x7F / 0xFF) included."""
    codes = torch.zeros(256, 32, dtype=torch.uint8)
    codes[:, 0] = torch.arange(256, dtype=torch.uint8)
    scale = torch.full((8, 1), 125, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^-2
    out = run("fp8", torch.eye(32)[:1], codes.view(torch.float8_e4m3fn), scale)[0]
    want = codes[:, 0].view(torch.float8_e4m3fn).float() * 0.25
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num(), want.nan_to_num())  # -0 reads back as +0: sums start from +0


@pytest.mark.parametrize("fmt", F.FAST_FORMATS)
def test_a_row_is_the_same_in_every_batch(fmt):
    """Batch invariance: row r of a batch of M (1..8, and a prefill's 40) is bit for bit the row alone."""
    gen = torch.Generator().manual_seed(5)
    weight, scale = checkpoint_weight(fmt, 40, 256, gen)
    a = activations(40, 256, gen)
    alone = torch.cat([run(fmt, a[r:r + 1], weight, scale) for r in range(40)])
    for m in (*range(1, 9), 40):
        for r0 in range(0, 40 - m + 1, max(1, m // 2)):
            assert_bits(run(fmt, a[r0:r0 + m], weight, scale), alone[r0:r0 + m])


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_scales_outside_the_fold_range(fmt):
    """Block scales of 2^-67 .. 2^73 (UE8M0 bytes 60..200), most outside [2^-64, 2^64], where the
    AMX layer keeps a partial per block instead of folding the scale into the weights: still within
    the bound, and a row alone equals the row in a batch."""
    gen = torch.Generator().manual_seed(8)
    weight, scale = checkpoint_weight(fmt, 40, 256, gen)
    scale = torch.randint(60, 201, scale.shape, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    a = activations(40, 256, gen)
    got = run(fmt, a, weight, scale)
    assert ((got.double() - F.gemm_fast_ref(a, fmt, weight, scale)).abs() <= F.error_bound(a, fmt, weight, scale)).all()
    for r0, m in ((0, 1), (3, 5), (7, 17), (0, 40)):
        assert_bits(got[r0:r0 + m], run(fmt, a[r0:r0 + m], weight, scale))


@pytest.mark.parametrize("m", [1, 3, 8, 29])
def test_threads_do_not_matter(m):
    gen = torch.Generator().manual_seed(m)
    weight, scale = checkpoint_weight("fp8", 70, 512, gen)
    a = activations(m, 512, gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run("fp8", a, weight, scale)
        torch.set_num_threads(2)
        two = run("fp8", a, weight, scale)
    finally:
        torch.set_num_threads(before)
    assert_bits(one, two)


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_segments_equal_per_expert_calls(fmt):
    gen = torch.Generator().manual_seed(11)
    weight, scale = checkpoint_weight(fmt, 24, 128, gen, lead=(3,))
    offsets = torch.tensor([0, 2, 2, 15])
    a = activations(15, 128, gen)
    prep = G.prepare_weight(fmt, weight, scale)
    got = F.gemm_segments(a, offsets, prep, fmt, 24)
    for e in range(3):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        assert_bits(got[rows], run(fmt, a[rows], weight[e], None if scale is None else scale[e]))


def test_continued_from_init_is_the_same_sum():
    """Splitting K in two shards (cpu_gemm.gemm_acc's use): the second continued from the first
    equals the whole GEMM, bit for bit (block partials and their order are the same)."""
    gen = torch.Generator().manual_seed(2)
    weight, scale = checkpoint_weight("fp8", 32, 256, gen)
    a = activations(5, 256, gen)
    first = run("fp8", a[:, :128], weight[:, :128], scale[:, :4])
    prep = G.prepare_weight("fp8", weight[:, 128:].contiguous(), scale[:, 4:].contiguous())
    assert_bits(F.gemm_acc(a[:, 128:].contiguous(), prep, "fp8", 32, first), run("fp8", a, weight, scale))


@pytest.mark.parametrize("fake", [False, True])
def test_bad_arguments(fake):
    gen = torch.Generator().manual_seed(0)
    weight, scale = checkpoint_weight("fp8", 16, 64, gen)
    prep = G.prepare_weight("fp8", weight, scale)
    a = torch.zeros(2, 64)
    calls = [((a, prep["w"], prep["w_scale"], 3, 16), "fp32 weights have no fast path"),
             ((a[:, :48], prep["w"], prep["w_scale"], 0, 16), "positive multiple of 32"),
             ((a, prep["w"], prep["w_scale"][:, :1], 0, 16), "w_scale must be"),
             ((a, prep["w"], prep["w_scale"], 0, 17), "n must be in")]
    for args, msg in calls:
        with pytest.raises(ValueError, match=msg):
            if fake:
                with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                    OPS.gemm_fast(*(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args))
            else:
                OPS.gemm_fast(*args)
    with pytest.raises(ValueError, match="fp32 weights stay on gemm_panels"):
        F.gemm(a, prep, "fp32", 16)


def test_build_refuses_what_would_crash_the_process(monkeypatch):
    """build() raises ValueError, before any compiler runs, where loading would abort the process
    (this family's ops registered twice under one namespace), fail to compile or load (a namespace
    that is no identifier), or die of SIGILL at the first call (a variant the CPU lacks)."""
    other = next(v for v in F.ISA_NEEDS if v != F.VARIANT)
    with pytest.raises(ValueError, match=rf"torch.ops.dsneuron already holds the '{F.VARIANT}' variant's ops"):
        F.build(other, namespace="dsneuron")
    for bad in ("my-check", "", "1ns"):
        with pytest.raises(ValueError, match="namespace must be a Python identifier"):
            F.build(F.VARIANT, namespace=bad)
    with pytest.raises(ValueError, match="variant must be one of"):
        F.build("avx1024", namespace="dsneuron_fast_unknown")
    monkeypatch.setattr(G, "cpu_flags", lambda: {"fpu", "avx2", "fma", "f16c"})
    for variant in ("avx512vbmi", "avx512bf16", "amx"):
        with pytest.raises(ValueError, match=rf"this CPU cannot run variant '{variant}': /proc/cpuinfo lacks .*avx512"):
            F.build(variant, namespace="dsneuron_fast_nocpu")
    with pytest.raises(ValueError, match="cpu_gemm.build: this CPU cannot run variant 'avx2': /proc/cpuinfo lacks f16c"):
        monkeypatch.setattr(G, "cpu_flags", lambda: {"fpu", "avx2", "fma"})
        G.build("avx2", namespace="dsneuron_exact_nocpu")


@pytest.mark.skipif(F.VARIANT != "amx", reason="the host has no AMX-BF16 (or Linux refused its tile state)")
def test_amx_can_be_turned_off():
    """DSNEURON_FAST_NO_AMX=1 (the benchmarks' A/B switch) builds the VDPBF16PS variant instead."""
    code = "from dsneuron.kernels_nki import cpu_gemm_fast as F; print(F.VARIANT)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DSNEURON_FAST_NO_AMX": "1"},
                         capture_output=True, text=True, timeout=300, check=True)
    vbmi = "avx512vbmi" in F.cpu_flags() and os.environ.get("DSNEURON_FAST_NO_VBMI") != "1"
    assert out.stdout.split()[-1] == ("avx512vbmi" if vbmi else "avx512bf16")


VBMI_HOST = F.ISA_NEEDS["avx512vbmi"] <= F.cpu_flags() and torch.backends.cpu.get_cpu_capability() == "AVX512"


@pytest.mark.skipif(not VBMI_HOST, reason="the host has no AVX512-VBMI and AVX512-BF16")
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("m", [1, 3, 7, 29])
def test_table_expansion_equals_the_arithmetic_one(fmt, m):
    """The avx512vbmi variant expands FP8 by byte tables, avx512bf16 by arithmetic: the same bits on
    every code (NaN included), on the decode path (M <= 4) and the expanded panel (M > 4), plain and
    grouped; FP4, expanded alike by both, checks the variants otherwise agree."""
    if F.VARIANT != "avx512vbmi":  # an AMX host, or the switch set: the table variant beside it
        F.build("avx512vbmi", namespace="dsneuron_fast_tables")
    tables = OPS if F.VARIANT == "avx512vbmi" else torch.ops.dsneuron_fast_tables
    F.build("avx512bf16", namespace="dsneuron_fast_arith")
    arith = torch.ops.dsneuron_fast_arith
    gen = torch.Generator().manual_seed(m)
    kw = 256 if fmt == "fp8" else 128
    codes = torch.randint(0, 256, (3, 48, kw), generator=gen, dtype=torch.uint8)
    codes[0, :8].view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every byte: FP8 0x7F, 0xFF; all nibble pairs
    shape = (3, 2, 8) if fmt == "fp8" else (3, 48, 8)
    scale = torch.randint(100, 150, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    weight = codes.view(torch.float8_e4m3fn) if fmt == "fp8" else codes.view(torch.int8)
    code = G.FORMATS.index(fmt)
    a = activations(m, 256, gen)
    prep = G.prepare_weight(fmt, weight[0], scale[0])
    assert_bits(tables.gemm_fast(a, prep["w"], prep["w_scale"], code, 48),
                arith.gemm_fast(a, prep["w"], prep["w_scale"], code, 48))
    stacked = G.prepare_weight(fmt, weight, scale)
    offsets = torch.tensor([0, m // 2, m // 2, m])
    args = (a, offsets, stacked["w"], stacked["w_scale"], code, 48)
    assert_bits(tables.gemm_fast_segments(*args), arith.gemm_fast_segments(*args))


AVX2_HOST = G.ISA_NEEDS["avx2"] <= F.cpu_flags() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.mark.skipif(not AVX2_HOST, reason="the host has no AVX2 and FMA")
@pytest.mark.parametrize("fmt", F.FAST_FORMATS)
@pytest.mark.parametrize("m", [1, 3, 5, 8, 9, 29])
@pytest.mark.parametrize("flush_denormal", [False, True])
def test_avx2_layer_equals_the_portable_one(fmt, m, flush_denormal):
    """The avx2 variant (intrinsics, pair vectors widened to fp32) and the generic one (plain loops)
    do the same fma sequence: the same bits on every FP8 code (NaN and the subnormals, which the
    AVX2 layer passes through an fp32 denormal, also with denormals-are-zero set in the process)
    and every FP4 nibble pair, on the decode path (M <= 4) and the expanded panel in tiles of 8,
    plain, continued from init and grouped."""
    ns = {}
    for variant in ("avx2", "generic"):
        if F.VARIANT == variant:
            ns[variant] = OPS
        else:
            F.build(variant, namespace=f"dsneuron_fast_{variant}")
            ns[variant] = getattr(torch.ops, f"dsneuron_fast_{variant}")
    gen = torch.Generator().manual_seed(m)
    k = 256
    if fmt == "bf16":
        weight, scale = torch.randn(3, 48, k, generator=gen).to(torch.bfloat16), None
    else:
        codes = torch.randint(0, 256, (3, 48, k if fmt == "fp8" else k // 2), generator=gen, dtype=torch.uint8)
        codes[0, 8:16].view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every byte, in panel 0's second half
        shape = (3, 2, k // 32) if fmt == "fp8" else (3, 48, k // 32)
        scale = torch.randint(100, 150, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        weight = codes.view(torch.float8_e4m3fn) if fmt == "fp8" else codes.view(torch.int8)
    code = G.FORMATS.index(fmt)
    a = activations(m, k, gen)
    init = activations(m, 48, gen)
    plain = G.prepare_weight(fmt, weight[0], None if scale is None else scale[0])
    stacked = G.prepare_weight(fmt, weight, scale)
    offsets = torch.tensor([0, m // 3, m // 3, m])
    calls = (("gemm_fast", (a, plain["w"], plain["w_scale"], code, 48)),
             ("gemm_fast_acc", (a, plain["w"], plain["w_scale"], code, 48, init)),
             ("gemm_fast_segments", (a, offsets, stacked["w"], stacked["w_scale"], code, 48)))
    torch.set_flush_denormal(flush_denormal)
    try:
        for op, args in calls:
            avx2, generic = getattr(ns["avx2"], op)(*args), getattr(ns["generic"], op)(*args)
            assert_bits(avx2, generic)
            if fmt == "fp8" and op != "gemm_fast_segments":  # the NaN codes' rows: the patched path ran
                assert avx2[:, 8:16].isnan().any()
    finally:
        torch.set_flush_denormal(False)
    if fmt == "fp8":  # the subnormal codes read back exactly (not as 0) with DAZ set
        eye = torch.eye(k)[:m]
        ones = torch.full((2, k // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        sub = torch.arange(1, 8, dtype=torch.uint8).repeat(48 * k // 7 + 1)[: 48 * k].view(48, k)
        p = G.prepare_weight("fp8", sub.view(torch.float8_e4m3fn), ones)
        torch.set_flush_denormal(True)
        try:
            got = ns["avx2"].gemm_fast(eye, p["w"], p["w_scale"], 0, 48)
        finally:
            torch.set_flush_denormal(False)
        assert torch.equal(got, sub.view(torch.float8_e4m3fn).float().T[:m])


@pytest.mark.skipif(F.VARIANT != "avx512vbmi", reason="the host has no AVX512-VBMI (or it is turned off)")
def test_vbmi_can_be_turned_off():
    """DSNEURON_FAST_NO_VBMI=1 (the benchmarks' A/B switch) builds the arithmetic-expansion variant."""
    code = "from dsneuron.kernels_nki import cpu_gemm_fast as F; print(F.VARIANT)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DSNEURON_FAST_NO_VBMI": "1"},
                         capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-1] == "avx512bf16"
