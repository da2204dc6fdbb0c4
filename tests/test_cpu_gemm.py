"""Tests of kernels_nki/cpu_gemm.py: the fixed-order block-scaled GEMM ops against their contract.

Bitwise: the C++ ops equal `gemm_panels_ref` (the contract in torch, on checkpoint-format weights)
on random shapes of all four formats; a row's result does not depend on M, on the thread count or
on the ISA layer (the portable build, loaded under a second namespace, equals the AVX2 one); the
grouped op equals per-expert calls. The reference's fma is itself checked against libm's fmaf.
Bounded: the float64 error bound (32 + K/32) * 2^-24 * sum|a w| of the two-level fp32 sum.
Also: the prepared layout dequantises to graphs.quant's values, bad arguments raise ValueError
naming the argument (eager C++ and fake), and an AOTInductor package calls the ops bit-identically.
The FP8 and FP4 activation ops equal graphs.quant's fp8_activation and fp4_act_quant_qdq on every
bf16 bit pattern and random fp32 ones.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from dsneuron.compiler.export import size_oblivious
from dsneuron.graphs.quant import (dequant_fp4_weight, dequant_fp8_weight, fp4_act_quant_qdq, fp8_activation,
                                  quantize_fp4_weight, quantize_fp8_weight)
from dsneuron.kernels_nki import cpu_gemm as G
from dsneuron.kernels_nki.formats import fp4_codes_to_float, unpack_fp4

FAST = settings(max_examples=30, deadline=None, derandomize=True)
OPS = torch.ops.dsneuron


def assert_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype == torch.float32
    diff = (actual.view(torch.int32) != expected.view(torch.int32)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} elements differ, first at {diff[0].tolist()}: " \
                              f"{actual[tuple(diff[0])].item()!r} vs {expected[tuple(diff[0])].item()!r}"


def checkpoint_weight(fmt: str, n: int, k: int, gen: torch.Generator, lead: tuple = ()):
    """Random checkpoint-format weight (all codes but e4m3 NaN; UE8M0 bytes 115..131) and its scale."""
    def scale_bytes(*shape):
        return torch.randint(115, 132, (*lead, *shape), generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    if fmt == "fp8":
        codes = torch.randint(0, 255, (*lead, n, k), generator=gen, dtype=torch.uint8)
        codes = torch.where(codes == 0x7F, 0x7E, codes)  # 0xFF excluded by the range, 0x7F here
        return codes.view(torch.float8_e4m3fn), scale_bytes(-(-n // 32), k // 32)
    if fmt == "fp4":
        return torch.randint(-128, 128, (*lead, n, k // 2), generator=gen, dtype=torch.int8), scale_bytes(n, k // 32)
    w = torch.randn(*lead, n, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (*lead, n, 1), generator=gen).float())
    return w.to(torch.bfloat16 if fmt == "bf16" else torch.float32), None


def activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 [M, K] with full 24-bit mantissas, so products round and the fma contract is exercised."""
    return torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-4, 5, (m, 1), generator=gen).float())


def run(fmt, a, weight, scale, ns=OPS):
    prep = G.prepare_weight(fmt, weight, scale)
    return ns.gemm_panels(a, prep["w"], prep["w_scale"], G.FORMATS.index(fmt), weight.shape[-2])


# ------------------------------------------------------------------------------------------ the contract

@FAST
@given(fmt=st.sampled_from(G.FORMATS), m=st.sampled_from([0, 1, 5, 37]) | st.integers(0, 40),
       n=st.integers(1, 70) | st.integers(120, 160), kb=st.integers(1, 64), seed=st.integers(0, 2**31 - 1))
def test_matches_reference(fmt, m, n, kb, seed):
    """N from 120 (8 panels) on exercises the kernel that reads a packed into 6-row tiles."""
    gen = torch.Generator().manual_seed(seed)
    weight, scale = checkpoint_weight(fmt, n, 32 * kb, gen)
    a = activations(m, 32 * kb, gen)
    assert_bits(run(fmt, a, weight, scale), G.gemm_panels_ref(a, fmt, weight, scale))


def test_fma32_is_libm_fmaf():
    """The reference's emulated fma against the C library's, on triples that cancel (where a
    separate multiply and add would round twice)."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.fmaf.restype, libm.fmaf.argtypes = ctypes.c_float, [ctypes.c_float] * 3
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3000, generator=gen)
    z = -(x.double() * y.double()).float() * (1 + torch.randn(3000, generator=gen) * 2.0**-20)
    z[::3] = torch.randn(1000, generator=gen)
    want = torch.tensor([libm.fmaf(*t) for t in zip(x.tolist(), y.tolist(), z.tolist())], dtype=torch.float32)
    assert_bits(G.fma32(x, y, z), want)
    assert not torch.equal(x * y + z, want)  # the triples do tell fma from multiply-then-add


def test_fp32_weights_use_fma():
    """With fp32 weights the products round, so an unfused kernel would differ from the contract."""
    gen = torch.Generator().manual_seed(1)
    weight, _ = checkpoint_weight("fp32", 64, 256, gen)
    a = activations(8, 256, gen)
    out = run("fp32", a, weight, None)
    assert_bits(out, G.gemm_panels_ref(a, "fp32", weight))
    p = (a.view(8, 1, 8, 32) * weight.view(1, 64, 8, 32)).permute(2, 3, 0, 1)  # [KB, 32, M, N] rounded products
    unfused = torch.zeros(8, 64)
    for b in range(8):
        part = torch.zeros(8, 64)
        for j in range(32):
            part = part + p[b, j]
        unfused = unfused + part
    assert not torch.equal(out, unfused)


@pytest.mark.parametrize("fmt", G.FORMATS)
def test_error_bound(fmt):
    """|out - exact| <= (32 + K/32) * 2^-24 * sum_k |a w|: 32 roundings in a block chain plus K/32 in acc."""
    gen = torch.Generator().manual_seed(2)
    k = 2048
    weight, scale = checkpoint_weight(fmt, 48, k, gen)
    a = activations(9, k, gen)
    w = G.dequant_weight(fmt, weight, scale).double()
    out = run(fmt, a, weight, scale).double()
    exact, mag = a.double() @ w.T, a.double().abs() @ w.abs().T
    assert bool(((out - exact).abs() <= (32 + k // 32) * 2.0**-24 * mag).all())


# ------------------------------------------------------------------------------------------ invariances

@pytest.mark.parametrize("fmt", G.FORMATS)
@pytest.mark.parametrize("n", [50, 130], ids=["a-in-place", "a-packed"])
def test_rows_do_not_depend_on_the_call(fmt, n):
    """Rows of a 37-row call (6-row tiles on a decoded panel) equal 1-row and 5-row calls (decoded
    on the fly), a 10-row call (decoded per tile for bf16, else once) and a call of shuffled rows."""
    gen = torch.Generator().manual_seed(3)
    weight, scale = checkpoint_weight(fmt, n, 320, gen)
    a = activations(37, 320, gen)
    full = run(fmt, a, weight, scale)
    for i in range(37):
        assert_bits(run(fmt, a[i:i + 1], weight, scale), full[i:i + 1])
    assert_bits(run(fmt, a[3:8], weight, scale), full[3:8])
    assert_bits(run(fmt, a[3:13], weight, scale), full[3:13])
    perm = torch.randperm(37, generator=gen)
    assert_bits(run(fmt, a[perm], weight, scale), full[perm])


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of t whose data starts one element past the allocator's alignment."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("fmt", G.FORMATS)
def test_alignment_does_not_matter(fmt):
    gen = torch.Generator().manual_seed(11)
    weight, scale = checkpoint_weight(fmt, 130, 96, gen)
    prep = G.prepare_weight(fmt, weight, scale)
    for m in (1, 37):
        a = activations(m, 96, gen)
        want = G.gemm(a, prep, fmt, 130)
        moved = {key: _misaligned(v) for key, v in prep.items()}
        assert_bits(G.gemm(_misaligned(a), moved, fmt, 130), want)


@pytest.mark.parametrize("m, n, threads", [(1, 300, 2), (37, 300, 2), (715, 16, 2), (50, 40, 2), (7, 128, 4)])
def test_threads_do_not_matter(m, n, threads):
    """1 thread vs more, with many panels and with few (where rows are split across threads; with 4
    threads 8 panels split 7 rows into a 6-row and a 1-row chunk)."""
    gen = torch.Generator().manual_seed(4)
    weight, scale = checkpoint_weight("fp8", n, 256, gen)
    a = activations(m, 256, gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run("fp8", a, weight, scale)
        torch.set_num_threads(threads)
        assert_bits(run("fp8", a, weight, scale), one)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", G.FORMATS)
@pytest.mark.parametrize("offsets, n", [([0, 7, 7, 8, 30, 30], 33), ([0, 7, 7, 8, 30, 30], 130), ([0, 0, 0], 33),
                                        ([0, 0, 40], 33)], ids=["mixed", "mixed-packed", "no-rows", "one"])
def test_segments_equal_per_expert_calls(fmt, offsets, n):
    gen = torch.Generator().manual_seed(5)
    e, k = len(offsets) - 1, 128
    weight, scale = checkpoint_weight(fmt, n, k, gen, lead=(e,))
    a = activations(offsets[-1], k, gen)
    prep = G.prepare_weight(fmt, weight, scale)
    out = G.gemm_segments(a, torch.tensor(offsets), prep, fmt, n)
    assert out.shape == (offsets[-1], n)
    for x in range(e):
        rows = slice(offsets[x], offsets[x + 1])
        assert_bits(out[rows], run(fmt, a[rows], weight[x], None if scale is None else scale[x]))


@pytest.mark.parametrize("fmt", G.FORMATS)
def test_isa_layers_agree(portable_ops, fmt):
    gen = torch.Generator().manual_seed(6)
    for m, n, k in [(1, 40, 64), (5, 17, 96), (37, 70, 256), (37, 130, 256)]:
        weight, scale = checkpoint_weight(fmt, n, k, gen)
        a = activations(m, k, gen)
        assert_bits(run(fmt, a, weight, scale, portable_ops), run(fmt, a, weight, scale))
    weight, scale = checkpoint_weight(fmt, n, k, gen, lead=(3,))
    prep, off = G.prepare_weight(fmt, weight, scale), torch.tensor([0, 9, 9, 37])
    args = (a, off, prep["w"], prep["w_scale"], G.FORMATS.index(fmt), n)
    assert_bits(portable_ops.gemm_panels_segments(*args), OPS.gemm_panels_segments(*args))


def test_e4m3_nan_codes_and_huge_scales():
    """The exact fp8 decoder (panels with a NaN code, or a scale above 2^119) against the reference."""
    gen = torch.Generator().manual_seed(7)
    weight, scale = checkpoint_weight("fp8", 64, 64, gen)
    codes = weight.view(torch.uint8).clone()
    codes[3, 5], codes[40, 7] = 0x7F, 0xFF
    sbytes = scale.view(torch.uint8).clone()
    sbytes[1, 1] = 250  # 2^123: e4m3 values from 2^-9 up overflow past 2^119 * 448
    codes[32:, 32:] &= 0x87  # keep that tile's values small enough to stay finite
    codes, sbytes = codes.view(torch.float8_e4m3fn), sbytes.view(torch.float8_e8m0fnu)
    a = activations(3, 64, gen)
    out, ref = run("fp8", a, codes, sbytes), G.gemm_panels_ref(a, "fp8", codes, sbytes)
    nan = ref.isnan()
    assert nan[:, 3].all() and nan[:, 40].all() and torch.equal(out.isnan(), nan)
    assert_bits(out[~nan], ref[~nan])
    assert out[:, 48:].abs().max() > 2.0**100


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_scale_folding_keeps_the_bits_at_the_range_edges(fmt, portable_ops):
    """The decode path (rows <= 6) multiplies a block's partial by its power-of-two scale once
    instead of every weight (gemm.cpp FoldRange) only where that gives the same bits: rows whose
    chains would go subnormal (tiny activations against tiny scales), overflow (huge against huge),
    UE8M0 byte 0 (2^-127), NaN and inf activations. Each case against the reference and the
    portable layer."""
    gen = torch.Generator().manual_seed(11)
    n, k = 48, 128
    weight, scale = checkpoint_weight(fmt, n, k, gen)

    def with_bytes(*pattern):  # the scale bytes, every len(pattern)-th one set to each of pattern's
        b = scale.view(torch.uint8).clone()
        for i, byte in enumerate(pattern):
            b.view(-1)[i:: len(pattern)] = byte
        return b.view(torch.float8_e8m0fnu)

    # 2^-30 (with activations near 2^-100 the products are subnormal), 2^-127 (byte 0), 2^73 (with
    # activations near 2^60 the sums pass 2^128), 2^-126, and the test's usual range
    scales = [with_bytes(97), with_bytes(200), with_bytes(97, 0, 200, 1, 120, 125, 131)]
    rows = [activations(1, k, gen) * 2.0 ** -100, activations(1, k, gen) * 2.0 ** -120, activations(1, k, gen) * 2.0 ** 60,
            activations(1, k, gen), torch.zeros(1, k), activations(1, k, gen) * 2.0 ** -140]
    inf_row, nan_row = activations(1, k, gen), activations(1, k, gen)
    inf_row[0, 7], nan_row[0, 100] = float("inf"), float("nan")
    cases = [*rows, inf_row, nan_row, torch.cat(rows[:3]), torch.cat(rows)]
    for s in scales:
        for a in cases:
            out, ref = run(fmt, a, weight, s), G.gemm_panels_ref(a, fmt, weight, s)
            same = (out.view(torch.int32) == ref.view(torch.int32)) | (out.isnan() & ref.isnan())
            assert same.all(), f"rows {tuple(a.shape)}: {int((~same).sum())} elements differ"
            port = run(fmt, a, weight, s, portable_ops)
            assert ((port.view(torch.int32) == out.view(torch.int32)) | (port.isnan() & out.isnan())).all()
    # the cases reach the edges: subnormal results and infinities occur
    tiny = run(fmt, torch.cat(rows[:2]), weight, scales[0])
    assert ((tiny != 0) & (tiny.abs() < 2.0 ** -126)).any()
    assert run(fmt, rows[2], weight, scales[1]).isinf().any()


# ------------------------------------------------------------------------------------------ layout

def unprepare(fmt: str, prep: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    """The inverse of prepare_weight's layout: prepared panels -> dequantised fp32 [N, K]."""
    w, s = prep["w"], prep["w_scale"]
    rows = w.transpose(-1, -2).flatten(-3, -2)[:n]  # [N, K] or [N, K/2]
    if fmt == "fp8":
        scale = s.repeat_interleave(16, 0)[:n].repeat_interleave(32, 1)
        return rows.view(torch.float8_e4m3fn).float() * scale
    if fmt == "fp4":
        scale = s.transpose(-1, -2).flatten(-3, -2)[:n].repeat_interleave(32, 1)
        return fp4_codes_to_float(unpack_fp4(rows)) * scale
    return rows.float()


@pytest.mark.parametrize("fmt", G.FORMATS)
@pytest.mark.parametrize("n", [16, 45, 64])
def test_prepare_weight_round_trip(fmt, n):
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(n, 96, generator=gen)
    if fmt == "fp8":
        weight, scale = quantize_fp8_weight(w)
        expected = dequant_fp8_weight(weight, scale)
    elif fmt == "fp4":
        weight, scale = quantize_fp4_weight(w)
        expected = dequant_fp4_weight(weight, scale)
    else:
        weight, scale = w.to(torch.bfloat16 if fmt == "bf16" else torch.float32), None
        expected = weight.float()
    prep = G.prepare_weight(fmt, weight, scale)
    p = -(-n // 16)
    assert prep["w"].shape == (p, 48 if fmt == "fp4" else 96, 16) and prep["w"].is_contiguous()
    assert_bits(unprepare(fmt, prep, n), expected)
    assert_bits(G.dequant_weight(fmt, weight, scale), expected)
    assert prep["w"].transpose(-1, -2).flatten(-3, -2)[n:].count_nonzero() == 0  # zero padding rows
    stacked = G.prepare_weight(fmt, weight.unsqueeze(0).expand(2, *weight.shape),
                               None if scale is None else scale.unsqueeze(0).expand(2, *scale.shape))
    assert torch.equal(stacked["w"][1], prep["w"])
    assert torch.equal(stacked["w_scale"][1], prep["w_scale"]) if scale is not None else stacked["w_scale"].numel() == 0
    with FakeTensorMode() as mode:  # what torch.export traces
        fake = G.prepare_weight(fmt, mode.from_tensor(weight), None if scale is None else mode.from_tensor(scale))
    assert {k: (v.shape, v.dtype) for k, v in fake.items()} == {k: (v.shape, v.dtype) for k, v in prep.items()}
    for args, made in [((weight, scale), prep), ((weight.unsqueeze(0).expand(2, *weight.shape),
                                                  None if scale is None else scale.unsqueeze(0).expand(2, *scale.shape)), stacked)]:
        assert G.prepared_specs(fmt, *args) == {k: (tuple(v.shape), v.dtype) for k, v in made.items()}


# ------------------------------------------------------------------------------------------ bad input

def _good():
    gen = torch.Generator().manual_seed(9)
    weight, scale = checkpoint_weight("fp4", 40, 64, gen)
    prep = G.prepare_weight("fp4", weight, scale)
    return torch.randn(3, 64), prep["w"], prep["w_scale"]


def _bad_calls():
    a, w, s = _good()
    yield "a must be a Float", (a.bfloat16(), w, s, 1, 40)
    yield "a must be a Float", (a[0], w, s, 1, 40)
    yield "multiple of 32, got 48", (torch.randn(3, 48), w, s, 1, 40)
    yield "fmt must be 0", (a, w, s, 4, 40)
    yield "w must be a contiguous", (a, w.view(torch.int8), s, 1, 40)
    yield "w must be a contiguous", (a, w[:, :16], s, 1, 40)
    yield "w must be a contiguous", (a, w.transpose(0, 1).contiguous().transpose(0, 1), s, 1, 40)
    yield "w_scale must be a contiguous", (a, w, s[:, :1], 1, 40)
    yield "w_scale must be a contiguous", (a, w, s.double(), 1, 40)
    yield "w must be a contiguous", (a, w, s, 0, 40)  # fp4 panels given as fp8
    yield r"n must be in .* = \(32, 48\] for w with P = 3 panels, got 49", (a, w, s, 1, 49)
    yield r"n must be in .* = \(32, 48\] for w with P = 3 panels, got 32", (a, w, s, 1, 32)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_bad_arguments(fake):
    for message, args in _bad_calls():
        with pytest.raises(ValueError, match=message):
            if fake:
                with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                    OPS.gemm_panels(*[mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args])
            else:
                OPS.gemm_panels(*args)
    a, w, s = _good()
    with pytest.raises(ValueError, match="w_scale must be empty"):
        OPS.gemm_panels(a, torch.zeros(3, 64, 16), s, 3, 40)


def test_bad_segments():
    a, w, s = _good()
    w2, s2 = w.unsqueeze(0).expand(2, *w.shape).contiguous(), s.unsqueeze(0).expand(2, *s.shape).contiguous()
    for message, off in [("offsets must be a Long", torch.tensor([0, 1, 3], dtype=torch.int32)),
                         ("end at R = a.size\\(0\\) = 3", torch.tensor([0, 1, 2])),
                         ("non-decreasing", torch.tensor([0, 2, 1, 3])),
                         ("E = offsets.numel\\(\\) - 1 = 1", torch.tensor([0, 3]))]:
        with pytest.raises(ValueError, match=message):
            OPS.gemm_panels_segments(a, off, w2, s2, 1, 40)


def test_bad_prepare():
    w = torch.zeros(8, 64, dtype=torch.uint8)
    for message, call in [("fmt must be one of", lambda: G.prepare_weight("int8", w)),
                          ("positive multiple of 32", lambda: G.prepare_weight("fp8", w[:, :40], w[:1, :1])),
                          ("needs its UE8M0 scale", lambda: G.prepare_weight("fp4", w)),
                          ("scale must have shape \\(1, 2\\)", lambda: G.prepare_weight("fp8", w, w[:2, :2])),
                          ("weight must be one of", lambda: G.prepare_weight("bf16", w)),
                          ("takes no scale", lambda: G.prepare_weight("fp32", w.float(), w))]:
        with pytest.raises(ValueError, match=message):
            call()


def test_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler '/nonexistent/g\\+\\+'.*not found"):
        G.build("generic", "dsneuron_no_compiler")


# ------------------------------------------------------------------------------------------ FP8 activation

def _activation_cases(gen: torch.Generator):
    """Inputs of fp8_act_dequant: every bf16 bit pattern (NaN, inf, subnormals, both zeros) in
    order and shuffled, random fp32 bit patterns, and rows whose magnitudes span fp32."""
    every_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    yield every_bf16.reshape(-1, 128)
    yield every_bf16[torch.randperm(65536, generator=gen)].reshape(-1, 128)
    yield torch.randint(-2**31, 2**31 - 1, (256, 128), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    for scale in (1e-30, 1e-6, 1e-4, 1.0, 300.0, 1e30):
        x = torch.randn(37, 256, generator=gen) * scale * torch.exp(torch.randn(37, 256, generator=gen) * 3)
        yield x
        yield x.to(torch.bfloat16)


def assert_same_or_nan(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equal, any NaN equal to any NaN (the e4m3 NaN decodes to torch's canonical NaN)."""
    same = (actual.view(torch.int32) == expected.view(torch.int32)) | (actual.isnan() & expected.isnan())
    bad = (~same).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} elements differ, first at {bad[0].tolist()}: " \
                             f"{actual[tuple(bad[0])].item()!r} vs {expected[tuple(bad[0])].item()!r}"


@pytest.mark.parametrize("block", [32, 128])
def test_fp8_act_dequant_is_the_graph_qdq(block):
    """The C++ activation QDQ equals graphs.quant.fp8_activation bit for bit (its torch definition)."""
    gen = torch.Generator().manual_seed(11)
    for x in _activation_cases(gen):
        out = G.fp8_act_dequant(x, block)
        assert out.dtype == torch.float32 and out.shape == x.shape
        assert_same_or_nan(out, fp8_activation(x, block))
    x = torch.randn(3, 5, 256, generator=gen).to(torch.bfloat16)
    assert_same_or_nan(G.fp8_act_dequant(x.transpose(0, 1), block), fp8_activation(x.transpose(0, 1), block))


@pytest.mark.parametrize("block, scale_fmt", [(32, "ue8m0"), (16, "e4m3"), (128, "e4m3")])
def test_fp4_act_dequant_is_the_graph_qdq(block, scale_fmt):
    """The C++ FP4 QDQ equals graphs.quant.fp4_act_quant_qdq bit for bit (fp32 out; cast to bf16
    for a bf16 input, as the graph casts)."""
    gen = torch.Generator().manual_seed(13)
    for x in _activation_cases(gen):
        out = G.fp4_act_dequant(x, block, scale_fmt)
        assert out.dtype == torch.float32 and out.shape == x.shape
        expected = fp4_act_quant_qdq(x, block, scale_fmt)
        assert_same_or_nan(out.to(x.dtype).float(), expected.float())
        if x.dtype == torch.float32:
            assert_same_or_nan(out, expected)


def test_fp8_act_dequant_isa_layers_agree(portable_ops):
    gen = torch.Generator().manual_seed(12)
    for x in _activation_cases(gen):
        for block in (32, 128):
            assert_same_or_nan(portable_ops.fp8_act_dequant(x, block), OPS.fp8_act_dequant(x, block))
            for fmt in (0, 1):
                assert_same_or_nan(portable_ops.fp4_act_dequant(x, block, fmt), OPS.fp4_act_dequant(x, block, fmt))
    x = torch.randn(4, 40, generator=gen)  # block 20: the scalar path on every build
    assert_same_or_nan(OPS.fp8_act_dequant(x, 20), fp8_activation(x, 20))


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_fp8_act_dequant_bad_arguments(fake):
    fp8, fp4 = OPS.fp8_act_dequant, (lambda x, b, fmt=0: OPS.fp4_act_dequant(x, b, fmt))
    for op in (fp8, fp4):
        for message, x, block in [("must be a bfloat16 or float32 tensor, got", torch.zeros(2, 32, dtype=torch.float16), 32),
                                  ("must be a multiple of block = 32", torch.zeros(2, 40), 32)]:
            with pytest.raises(ValueError, match=message):
                if fake:
                    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                        op(mode.from_tensor(x), block)
                else:
                    op(x, block)
    with pytest.raises(ValueError, match=r"scale_fmt must be 0 \(ue8m0\) or 1 \(e4m3\), got 2"):
        if fake:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fp4(mode.from_tensor(torch.zeros(2, 32)), 32, 2)
        else:
            fp4(torch.zeros(2, 32), 32, 2)
    with pytest.raises(ValueError, match="scale_fmt must be one of"):
        G.fp4_act_dequant(torch.zeros(2, 32), 32, "e8m0")


# ------------------------------------------------------------------------------------------ AOTInductor

class _Linears(torch.nn.Module):
    """An fp8 linear, then a grouped fp4 one on its output: both ops inside one package."""

    def forward(self, a, w8, s8, w4, s4, offsets):
        h = OPS.gemm_panels(a, w8, s8, 0, 64).relu()
        return OPS.gemm_panels_segments(h, offsets, w4, s4, 1, 24)


def test_aoti_package_calls_the_ops(tmp_path):
    """Export with a symbolic row count (fake tensors), compile with AOTInductor, run through the C++
    loader's proxy executor: bitwise the eager ops, at row counts other than the traced one. In a
    child process: after this package ran in a pytest process, tests/test_compiled_rounding.py's
    MoE check (eager against torch.compile, no package) found 3 routing weights one fp32 ulp apart;
    the cause is not found yet, so this test keeps its process state to itself."""
    if os.environ.get("DSNEURON_AOTI_CHILD") != "1":
        child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                f"{__file__}::test_aoti_package_calls_the_ops", "--basetemp", str(tmp_path)],
                               env={**os.environ, "DSNEURON_AOTI_CHILD": "1"}, capture_output=True, text=True,
                               timeout=600)
        assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
        assert "1 passed" in child.stdout, child.stdout[-2000:]
        return
    gen = torch.Generator().manual_seed(10)
    w8, s8 = checkpoint_weight("fp8", 64, 96, gen)
    w4, s4 = checkpoint_weight("fp4", 24, 64, gen, lead=(3,))
    p8, p4 = G.prepare_weight("fp8", w8, s8), G.prepare_weight("fp4", w4, s4)
    weights = (p8["w"], p8["w_scale"], p4["w"], p4["w_scale"])
    rows = torch.export.Dim("rows", min=1, max=4096)
    with size_oblivious():  # as the cpu backend exports and compiles: valid at one row (a decode step)
        ep = torch.export.export(_Linears(), (activations(7, 96, gen), *weights, torch.tensor([0, 3, 3, 7])),
                                 dynamic_shapes=({0: rows}, None, None, None, None, None), strict=False)
        path = torch._inductor.aoti_compile_and_package(
            ep, package_path=str(tmp_path / "linears.pt2"),
            inductor_configs={"aot_inductor.compile_wrapper_opt_level": "O0", "emulate_precision_casts": True,
                              "cpp.vec_isa_ok": False, "aot_inductor.check_lowerbound": False})
    loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
    for m, offsets in [(7, [0, 3, 3, 7]), (1, [0, 0, 1, 1]), (40, [0, 20, 30, 40])]:
        args = (activations(m, 96, gen), *weights, torch.tensor(offsets))
        (out,) = loader.boxed_run(list(args))
        assert_bits(out, _Linears()(*args))


@pytest.mark.parametrize("fmt", G.FORMATS)
def test_a_gemm_continued_from_the_previous_k_blocks_is_the_whole_gemm(fmt, portable_ops):
    """gemm_panels_acc (a row-parallel shard's GEMM, compiler/parallel.py): the first K blocks' GEMM,
    then the rest continued from it, is gemm_panels over all of K bit for bit, at every row count
    (the direct and the buffered kernels) and on both ISA layers; a bad init is refused."""
    gen = torch.Generator().manual_seed(11)
    n, k, cut = 70, 256, 96
    weight, scale = checkpoint_weight(fmt, n, k, gen)
    packed = 2 if fmt == "fp4" else 1
    halves = [(weight[:, : cut // packed], None if scale is None else scale[:, : cut // 32]),
              (weight[:, cut // packed:], None if scale is None else scale[:, cut // 32:])]
    preps = [G.prepare_weight(fmt, w.contiguous(), None if s is None else s.contiguous()) for w, s in halves]
    for m in (1, 5, 37):
        a = activations(m, k, gen)
        want = run(fmt, a, weight, scale)
        for ns in (OPS, portable_ops):
            first = ns.gemm_panels_acc(a[:, :cut].contiguous(), preps[0]["w"], preps[0]["w_scale"], G.FORMATS.index(fmt),
                                       n, torch.zeros(m, n))
            got = ns.gemm_panels_acc(a[:, cut:].contiguous(), preps[1]["w"], preps[1]["w_scale"], G.FORMATS.index(fmt),
                                     n, first)
            assert_bits(got, want)
    with pytest.raises(ValueError, match=r"init must be a Float tensor \[M, n\] = \[37, 70\]"):
        G.gemm_acc(a[:, cut:].contiguous(), preps[1], fmt, n, torch.zeros(37, 71))


def test_openmp_pool_released_and_rebuilt():
    """`release_openmp_threads` (the serve engine's start) frees this thread's OpenMP pool; the
    next parallel GEMM, here and on another thread, builds one again and gives the same bits."""
    import threading

    from dsneuron.runtime_min.executors.executor_cpu import release_openmp_threads

    gen = torch.Generator().manual_seed(4)
    weight, scale = checkpoint_weight("fp8", 4096, 1024, gen)  # 4 MB: large enough to run on every thread
    a = activations(3, 1024, gen)
    want = run("fp8", a, weight, scale)
    assert release_openmp_threads() == any((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    assert_bits(run("fp8", a, weight, scale), want)
    got = []
    t = threading.Thread(target=lambda: got.append(run("fp8", a, weight, scale)))
    t.start()
    t.join()
    assert_bits(got[0], want)
