"""Tests of kernels_nki/cpu_attn.py: the fixed-order sparse attention op against its contract.

Bitwise: the C++ op equals `sparse_attn_cpu_ref` (the contract in torch) over the listed shapes and a
hypothesis property test, with -1 slots, out-of-range values, all-empty rows (exactly 0) and
duplicated indices; `exp_cpu` equals `exp_ref` on edge values and a dense sweep; a (row, head)'s
result does not depend on S, on B, on the other rows, on the thread count or on the ISA layer; NaN
and inf in kv rows no valid slot references never reach the result.
Bounded: exp_ref within 1 ulp of float64 exp over [-104, 89] (measured); the op within a derived
bound of the float64 golden `sparse_attn_ref` and within 2 bf16 steps at each (row, head)'s scale.
Also: bad arguments raise ValueError naming the argument (C++ op and fake), and the op exports with
a dynamic S and the exported program gives the eager bits.
"""

from __future__ import annotations

import math

import pytest
import torch
from dsneuron.kernels_nki import cpu_attn as A
from dsneuron.kernels_nki import cpu_gemm as G
from dsneuron.kernels_nki.sparse_attn_ref import BLOCK_KEYS, sparse_attn_ref
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

FAST = settings(max_examples=30, deadline=None, derandomize=True)
OPS = torch.ops.dsneuron
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
U = 2.0**-24  # fp32 unit roundoff


def assert_bf16_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bit-for-bit bf16 equality (-0 != +0); NaN only has to sit in the same places: the contract
    does not fix NaN payloads (the kernel writes 0x7FC0, torch's vectorised cast of a negative
    NaN in the reference writes 0xFFFF)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype == torch.bfloat16, what
    nan_a, nan_e = actual.isnan(), expected.isnan()
    bits_a, bits_e = actual.view(torch.int16), expected.view(torch.int16)
    diff = ((bits_a != bits_e) & ~(nan_a & nan_e)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} of {actual.numel()} elements differ, first at " \
                              f"{diff[0].tolist()}: {actual[tuple(diff[0])].item()!r} vs {expected[tuple(diff[0])].item()!r}"


def assert_f32_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-for-bit fp32 equality, NaN payloads included."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype == torch.float32
    diff = (actual.view(torch.int32) != expected.view(torch.int32)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} elements differ, first at {diff[0].tolist()}: " \
                              f"x={actual.flatten()[diff[0, 0]].item()!r} vs {expected.flatten()[diff[0, 0]].item()!r}"


def fillers(n: int) -> torch.Tensor:
    """Empty-slot values: -1 and values outside [0, N), some of which alias another batch's rows
    (t - N, t + N) if a kernel indexed the flat [B*N] table without a range check."""
    return torch.tensor([-1, -2, -n, -n - 1, n, n + 1, 2 * n - 1, 114514, INT_MIN, INT_MAX], dtype=torch.int64)


def make_inputs(b, s, h, d, n, k, gen, *, empty=0.15, dup=0.1, empty_rows=(), sink="finite", q_scale=1.0):
    """q ~ N(0, q_scale^2), kv ~ N(0, 1) (bf16), sink ~ N(0, 1) (sink="mixed": some +-inf), idx int32
    [b,s,k] in [0, n) with a fraction `empty` of empty slots (fillers), a fraction `dup` of slots
    copying slot 0 of their row (duplicates), and rows `empty_rows` (list of (b, s)) all empty."""
    q = (torch.randn(b, s, h, d, generator=gen) * q_scale).bfloat16()
    kv = torch.randn(b, n, d, generator=gen).bfloat16()
    sk = torch.randn(h, generator=gen)
    if sink == "mixed":
        pick = torch.randint(0, 3, (h,), generator=gen)
        sk = torch.where(pick == 0, -math.inf, torch.where(pick == 1, math.inf, sk))
    idx = torch.randint(0, max(n, 1), (b, s, k), generator=gen)
    if k:
        idx = torch.where(torch.rand(b, s, k, generator=gen) < dup, idx[..., :1], idx)
    f = fillers(n)
    bad = torch.rand(b, s, k, generator=gen) < empty
    for r in empty_rows:
        bad[r] = True
    if n == 0:
        bad[:] = True
    idx = torch.where(bad, f[torch.randint(0, len(f), (b, s, k), generator=gen)], idx)
    return q, kv, sk, idx.to(torch.int32)


# ------------------------------------------------------------------------------------------ the contract

@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize("k", [1, 63, 64, 65, 130])
def test_matches_reference(d, k):
    """Every B in {1,2}, S in {1,7}, H in {1,4}; N = 40 < 130 (duplicates by pigeonhole) and
    explicit ones, empty slots of every filler kind, an all-empty row where B*S > 1."""
    gen = torch.Generator().manual_seed(1000 * d + k)
    for b in (1, 2):
        for s in (1, 7):
            for h in (1, 4):
                rows = [(b - 1, s - 1)] if b * s > 1 else []
                q, kv, sink, idx = make_inputs(b, s, h, d, 40, k, gen, empty_rows=rows,
                                               sink="mixed" if h == 4 and s == 7 else "finite")
                out = A.sparse_attn_cpu(q, kv, sink, idx, d ** -0.5)
                assert_bf16_bits(out, A.sparse_attn_cpu_ref(q, kv, sink, idx, d ** -0.5), f"B={b} S={s} H={h}")
                for r in rows:
                    assert (out[r].view(torch.int16) == 0).all()  # +0 exactly
                assert not out.isnan().any()  # finite q and kv: no NaN, +-inf sinks included


@FAST
@given(b=st.integers(1, 2), s=st.integers(1, 3), h=st.integers(1, 10) | st.sampled_from([16, 17]),
       d=st.integers(1, 40) | st.sampled_from([64, 72]), n=st.integers(0, 90), k=st.integers(0, 140),
       empty=st.sampled_from([0.0, 0.1, 0.5, 1.0]), dup=st.sampled_from([0.0, 0.3]),
       sink=st.sampled_from(["finite", "mixed"]), scale=st.sampled_from([None, 0.5, 3.0, 1e-3]),
       seed=st.integers(0, 2**31 - 1))
def test_matches_reference_property(b, s, h, d, n, k, empty, dup, sink, scale, seed):
    """Small random shapes: H not a multiple of 8 (padding lanes), D not a multiple of 8, N = 0,
    K = 0, K > N, every empty fraction, sinks of +-inf."""
    gen = torch.Generator().manual_seed(seed)
    q, kv, sk, idx = make_inputs(b, s, h, d, n, k, gen, empty=empty, dup=dup, empty_rows=[(0, 0)] if s > 1 else [],
                                 sink=sink)
    sc = d ** -0.5 if scale is None else scale
    assert_bf16_bits(A.sparse_attn_cpu(q, kv, sk, idx, sc), A.sparse_attn_cpu_ref(q, kv, sk, idx, sc))


@pytest.mark.parametrize("sink_value", [-math.inf, math.inf, math.nan, 0.0, 80.0])
def test_empty_rows_are_zero_whatever_the_sink(sink_value):
    """l == 0 gives +0 bits whatever the sink (NaN included); K = 0 and N = 0 too; other rows are the reference's."""
    gen = torch.Generator().manual_seed(1)
    q, kv, _, idx = make_inputs(2, 4, 4, 64, 30, 70, gen, empty=0.0)
    sink = torch.full((4,), sink_value)
    f = fillers(30)
    idx[0, 2] = f[torch.arange(70) % len(f)].to(torch.int32)
    idx[1, 0] = -1
    out = A.sparse_attn_cpu(q, kv, sink, idx, 0.125)
    assert (out[0, 2].view(torch.int16) == 0).all() and (out[1, 0].view(torch.int16) == 0).all()
    assert_bf16_bits(out, A.sparse_attn_cpu_ref(q, kv, sink, idx, 0.125))
    for kv_, idx_ in [(kv, idx[:, :, :0].contiguous()), (kv[:, :0].contiguous(), idx)]:
        assert (A.sparse_attn_cpu(q, kv_, sink, idx_, 0.125).view(torch.int16) == 0).all()


def test_degenerate_shapes():
    """B, S, H or D = 0: an empty result of q's shape."""
    gen = torch.Generator().manual_seed(2)
    for b, s, h, d in [(0, 3, 2, 8), (1, 0, 2, 8), (1, 3, 0, 8), (1, 3, 2, 0)]:
        q, kv, sink, idx = make_inputs(b, s, h, d, 5, 4, gen)
        out = A.sparse_attn_cpu(q, kv, sink, idx, 0.5)
        assert out.shape == q.shape and out.dtype == torch.bfloat16


def test_nan_in_used_operands_propagates():
    """NaN in q[r, h] makes (r, h) NaN and nothing else; a NaN sink makes every non-empty row NaN."""
    gen = torch.Generator().manual_seed(3)
    q, kv, sink, idx = make_inputs(1, 3, 4, 64, 50, 70, gen, empty=0.2, empty_rows=[(0, 2)])
    q[0, 1, 2, 7] = math.nan
    out = A.sparse_attn_cpu(q, kv, sink, idx, 0.125)
    assert out[0, 1, 2].isnan().all() and out.isnan().sum() == 64
    assert_bf16_bits(out, A.sparse_attn_cpu_ref(q, kv, sink, idx, 0.125))
    sink[1] = math.nan
    out = A.sparse_attn_cpu(q, kv, sink, idx, 0.125)
    assert out[0, :2, 1].isnan().all() and (out[0, 2] == 0).all()


def test_overflowing_logits():
    """Huge scales (logits +-inf: NaN rows, exactly as the reference) and tiny ones (all logits ~0)."""
    gen = torch.Generator().manual_seed(4)
    q, kv, sink, idx = make_inputs(1, 3, 4, 64, 30, 70, gen)
    for sc in (3e38, 1e30, 1e-30, 1e-45):
        assert_bf16_bits(A.sparse_attn_cpu(q, kv, sink, idx, sc), A.sparse_attn_cpu_ref(q, kv, sink, idx, sc), str(sc))


def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(5)
    q, kv, sink, idx = make_inputs(2, 3, 8, 64, 40, 70, gen)
    sink2 = torch.stack([sink, sink], 1)[:, 0]
    want = A.sparse_attn_cpu(q, kv, sink, idx, 0.125)
    got = A.sparse_attn_cpu(q.transpose(1, 2).contiguous().transpose(1, 2), kv.transpose(0, 1).contiguous().transpose(0, 1),
                            sink2, idx.transpose(0, 2).contiguous().transpose(0, 2), 0.125)
    assert_bf16_bits(got, want)


# ------------------------------------------------------------------------------------------ exp

def _bits(*hexes: int) -> torch.Tensor:
    return torch.tensor(hexes, dtype=torch.int64).to(torch.int32).view(torch.float32)


def exp_edges() -> torch.Tensor:
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, -104.0, 89.0, -103.97, -103.9, -87.33, -87.34,
                             88.72, 88.7228, 88.72284, 88.7229, 88.73, -88.0, -100.0, 1e-45, -1e-45, 1e-30, -1e-30,
                             1e30, -1e30, 3.4028235e38, -3.4028235e38, 1.0, -1.0, 0.5, -0.5, 0.34657359, -0.34657359,
                             104.0, -105.0, 1000.0, -1000.0])
    nans = _bits(0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FA12345)  # quiet, negative, signalling payloads
    # x near (j + 1/2) ln2, where k = round(x log2e) changes: the range reduction's tie region
    halves = ((torch.arange(-150, 129, dtype=torch.float64) + 0.5) * math.log(2)).float()
    near = torch.cat([torch.nextafter(halves, torch.tensor(-math.inf)), halves, torch.nextafter(halves, torch.tensor(math.inf))])
    # ties of k itself: x * fp32(log2e) exactly j + 1/2 is not reachable; cover small |x| binades instead
    tiny = torch.ldexp(torch.ones(149, dtype=torch.float64), torch.arange(-149, 0)).float()
    rand = torch.randint(INT_MIN, INT_MAX, (1 << 16,), generator=torch.Generator().manual_seed(6),
                         dtype=torch.int64).to(torch.int32).view(torch.float32)  # all of fp32: huge, NaN, denormal
    return torch.cat([specials, nans, near, tiny, -tiny, rand])


def test_exp_edges():
    x = exp_edges()
    y = A.exp_cpu(x)
    assert_f32_bits(y, A.exp_ref(x))
    assert_f32_bits(y[:4], torch.tensor([1.0, 1.0, math.inf, 0.0]))
    assert A.exp_cpu(torch.tensor([-104.0, -1e30, -math.inf])).view(torch.int32).eq(0).all()  # +0, not -0
    assert A.exp_cpu(torch.tensor([89.0, 1e30])).isposinf().all()
    assert A.exp_cpu(torch.tensor([88.72283])).isfinite().all()
    nans = x.isnan()
    assert_f32_bits(y[nans], x[nans])  # NaN in, the same NaN out
    cut = x[:x.numel() // 16 * 16]
    assert_f32_bits(A.exp_cpu(cut.view(16, -1)), y[:cut.numel()].view(16, -1))  # shape kept
    assert A.exp_cpu(x[::3]).view(torch.int32).equal(y[::3].view(torch.int32))  # strided input


def _fp32_ulp_error(y: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(|y - exp(x)| in ulps of fp32 at exp(x), distance in fp32 steps from fp32(exp(x))) with
    exp in float64 (its error, ~2^-52 relative, is far below these ulps); the subnormal ulp is 2^-149."""
    e = torch.exp(x.double())
    ulp = torch.exp2((torch.frexp(e.clamp_min(2.0**-126))[1] - 24).double())
    rounded = e.float()
    err = torch.where(rounded.isinf() & y.isinf(), 0.0, (y.double() - e).abs() / ulp)
    steps = (y.view(torch.int32).long() - rounded.view(torch.int32).long()).abs()
    return err, steps


def test_exp_ref_within_one_ulp():
    """Dense sweep of [-104, 89] (2^20 + 1 evenly spaced points, ~1.8e-4 apart, and the ends):
    exp_ref within 1 ulp of float64 exp (measured max 0.843), at most 1 fp32 step from the
    correctly rounded value, and exp_cpu bit-identical to it."""
    x = torch.linspace(-104.0, 89.0, (1 << 20) + 1)
    y = A.exp_ref(x)
    assert_f32_bits(A.exp_cpu(x), y)
    err, steps = _fp32_ulp_error(y, x)
    print(f"exp_ref on {x.numel()} points of [-104, 89]: max error {err.max().item():.4f} ulp, "
          f"correctly rounded {(steps == 0).double().mean().item():.4%}")
    assert err.max() <= 1.0 and steps.max() <= 1
    # ~94% at evenly spaced x (~6% of |x| >= 0.35 are 1 step off), ~99.5% over fp32 bit patterns
    # (dominated by tiny |x|, where exp rounds to 1 or 1 - 2^-24 trivially)
    assert (steps == 0).double().mean() > 0.9


def test_exp_cpu_every_67th_fp32():
    """exp_cpu (== exp_ref, tested above) over every 67th fp32 of [-104, 89] (~33M values, both
    signs, all binades, the subnormal results below -87.3 included): within 1 ulp."""
    lo, hi = _bits(0xC2D00000).item(), _bits(0x42B20000).item()
    assert (lo, hi) == (-104.0, 89.0)
    worst, rounded, total = 0.0, 0, 0
    for first, last in [(0, 0x42B20000), (0x80000000, 0xC2D00000)]:  # [0, 89] and [-104, -0]
        x = torch.arange(first, last + 1, 67, dtype=torch.int64).to(torch.int32).view(torch.float32)
        err, steps = _fp32_ulp_error(A.exp_cpu(x), x)
        worst = max(worst, err.max().item())
        assert steps.max() <= 1
        rounded += int((steps == 0).sum())
        total += x.numel()
    print(f"exp_cpu over every 67th fp32 of [-104, 89]: max error {worst:.4f} ulp, correctly rounded {rounded / total:.4%}")
    assert worst <= 1.0 and rounded / total > 0.99


# ------------------------------------------------------------------------------------------ invariances

def test_rows_do_not_depend_on_the_call():
    """Rows of a [2, 7] call (all of kv converted once: the valid slots outnumber B*N) equal the
    one-row calls (each converts its own rows: ~115 slots < N = 300), the one-batch calls and a
    call with S permuted."""
    gen = torch.Generator().manual_seed(7)
    b, s, n = 2, 7, 300
    q, kv, sink, idx = make_inputs(b, s, 12, 512, n, 130, gen, empty_rows=[(1, 3)])
    valid = (idx >= 0) & (idx < n)
    assert valid.sum() >= b * n and (valid.sum(-1) < n).all()  # both conversion paths are exercised
    sc = 512 ** -0.5
    full = A.sparse_attn_cpu(q, kv, sink, idx, sc)
    for bi in range(b):
        one_b = A.sparse_attn_cpu(q[bi:bi + 1], kv[bi:bi + 1], sink, idx[bi:bi + 1], sc)
        assert_bf16_bits(one_b, full[bi:bi + 1], f"batch {bi}")
        for si in range(s):
            one = A.sparse_attn_cpu(q[bi:bi + 1, si:si + 1], kv[bi:bi + 1], sink, idx[bi:bi + 1, si:si + 1], sc)
            assert_bf16_bits(one, full[bi:bi + 1, si:si + 1], f"row {bi},{si}")
    perm = torch.randperm(s, generator=gen)
    assert_bf16_bits(A.sparse_attn_cpu(q[:, perm], kv, sink, idx[:, perm], sc), full[:, perm])
    assert_bf16_bits(A.sparse_attn_cpu(q[:, 2:5], kv, sink, idx[:, 2:5], sc), full[:, 2:5])


@pytest.mark.parametrize("b, s, h, n, k", [(1, 1, 64, 2000, 640), (2, 1, 72, 300, 200), (2, 7, 16, 300, 200),
                                           (1, 3, 4, 100, 130)], ids=["decode-h64", "decode-h72", "prefill", "small"])
def test_threads_do_not_matter(b, s, h, n, k):
    """1 thread vs 2 and 3. With few rows the kernel splits a row's heads into groups whose size
    depends on the thread count (H = 64, S = 1: groups of 2 head vectors with 2 threads, 4 with one;
    H = 72: a partial 9th vector)."""
    gen = torch.Generator().manual_seed(8)
    q, kv, sink, idx = make_inputs(b, s, h, 512, n, k, gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = A.sparse_attn_cpu(q, kv, sink, idx, 512 ** -0.5)
        for t in (2, 3):
            torch.set_num_threads(t)
            assert_bf16_bits(A.sparse_attn_cpu(q, kv, sink, idx, 512 ** -0.5), one, f"{t} threads")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("op", ["cpu", "golden"])
def test_attending_to_the_gathered_rows_is_attending_to_the_cache(op):
    """The decode step's premise (graphs/model.py Attention._compressed): the result depends on
    the listed rows' values in list order only, so the window followed by just the picked cache
    rows, the list renumbering them in order (-1 kept), gives the same bits as the whole cache."""
    gen = torch.Generator().manual_seed(3)
    b, h, d, w, t, k = 2, 4, 64, 16, 300, 40
    q, kv, sink, _ = make_inputs(b, 1, h, d, w + t, k, gen)
    widx = torch.randint(-1, w, (b, 1, w), generator=gen)
    cidx = torch.randint(0, t, (b, 1, k), generator=gen).sort(dim=-1).values + w
    cidx = torch.where(torch.rand(b, 1, k, generator=gen) < 0.2, -1, cidx)
    picked = kv[:, w:].gather(1, (cidx.view(b, k, 1) - w).clamp(min=0).expand(b, k, d))
    renumbered = torch.where(cidx < 0, -1, w + torch.arange(k))
    run = A.sparse_attn_cpu if op == "cpu" else OPS.sparse_attn
    whole = run(q, kv, sink, torch.cat([widx, cidx], -1).int(), d ** -0.5)
    gathered = run(q, torch.cat([kv[:, :w], picked], 1), sink, torch.cat([widx, renumbered], -1).int(), d ** -0.5)
    assert_bf16_bits(gathered, whole)


@pytest.mark.parametrize("n", [50, 1000], ids=["kv-converted-once", "rows-converted-per-item"])
def test_empty_slots_never_read_kv(n):
    """Valid slots reference rows [0, 25) only; rows [25, N) of both batches hold NaN / +inf / -inf,
    and the empty slots include values that alias them in a flat [B*N] table (t + N, t - N)."""
    gen = torch.Generator().manual_seed(9)
    b, s, h, d, k = 2, 5, 4, 64, 130
    q, kv, sink, idx = make_inputs(b, s, h, d, n, k, gen, empty=0.0, empty_rows=[(0, 4)])
    idx = idx % 25
    aliases = torch.tensor([-1, -n + 30, -n + 40, n + 30, n + 26, 2 * n - 1, INT_MIN, INT_MAX])
    bad = torch.rand(b, s, k, generator=gen) < 0.4
    bad[0, 4] = True
    idx = torch.where(bad, aliases[torch.randint(0, len(aliases), (b, s, k), generator=gen)], idx).to(torch.int32)
    poison = torch.tensor([math.nan, math.inf, -math.inf]).repeat(d)[:d].bfloat16()
    poisoned = kv.clone()
    poisoned[:, 25:] = poison
    sc = d ** -0.5
    out = A.sparse_attn_cpu(q, poisoned, sink, idx, sc)
    assert not out.isnan().any() and (out[0, 4] == 0).all()
    assert_bf16_bits(out, A.sparse_attn_cpu(q, kv, sink, idx, sc))
    assert_bf16_bits(out, A.sparse_attn_cpu_ref(q, kv, sink, idx, sc))


def test_isa_layers_agree(portable_ops):
    gen = torch.Generator().manual_seed(10)
    for shape in [(1, 1, 64, 512, 2000, 640), (2, 7, 4, 64, 40, 130), (1, 3, 17, 19, 30, 65)]:
        q, kv, sink, idx = make_inputs(*shape, gen, sink="mixed", empty_rows=[(0, 0)])
        sc = shape[3] ** -0.5
        assert_bf16_bits(portable_ops.sparse_attn_cpu(q, kv, sink, idx, sc), OPS.sparse_attn_cpu(q, kv, sink, idx, sc))
    x = torch.cat([exp_edges(), torch.linspace(-104, 89, 1 << 16)])
    assert_f32_bits(portable_ops.exp_cpu(x), OPS.exp_cpu(x))


# ------------------------------------------------------------------------------------------ bad input

def _good():
    gen = torch.Generator().manual_seed(11)
    return make_inputs(2, 3, 4, 16, 10, 5, gen)


def _bad_calls():
    """(argument named, message from the C++ op and the fake alike, args)."""
    q, kv, sink, idx = _good()
    yield "q", True, (q.float(), kv, sink, idx, 0.5)
    yield "q", True, (q[0], kv, sink, idx, 0.5)
    yield "q", True, (q.half(), kv, sink, idx, 0.5)
    yield "kv", True, (q, kv.float(), sink, idx, 0.5)
    yield "kv", True, (q, kv[:1], sink, idx, 0.5)
    yield "kv", True, (q, kv[..., :8], sink, idx, 0.5)
    yield "kv", True, (q, kv[0], sink, idx, 0.5)
    yield "sink", True, (q, kv, sink.bfloat16(), idx, 0.5)
    yield "sink", True, (q, kv, sink.double(), idx, 0.5)
    yield "sink", True, (q, kv, sink[:3], idx, 0.5)
    yield "sink", True, (q, kv, sink[None], idx, 0.5)
    yield "idx", True, (q, kv, sink, idx.long(), 0.5)
    yield "idx", True, (q, kv, sink, idx[:1], 0.5)
    yield "idx", True, (q, kv, sink, idx[:, :2], 0.5)
    yield "idx", True, (q, kv, sink, idx[0], 0.5)
    yield "idx", False, (q, kv, sink, idx.to(torch.int8), 0.5)
    yield "kv", False, (q, kv.view(torch.int16), sink, idx, 0.5)
    for scale in (0.0, -0.0, -1.0, math.nan, math.inf, -math.inf, 1e39, 1e-46):
        yield "scale", scale in (math.nan, math.inf, -math.inf, 1e39, 1e-46), (q, kv, sink, idx, scale)


def _raise_message(args, fake: bool, op=OPS.sparse_attn_cpu) -> str:
    with pytest.raises(ValueError) as info:
        if fake:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                op(*[mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args])
        else:
            op(*args)
    return str(info.value)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_bad_arguments(fake):
    for name, _, args in _bad_calls():
        message = _raise_message(args, fake)
        assert message.startswith(f"sparse_attn_cpu: {name} must"), message
    for x in (torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int32)):
        assert _raise_message((x,), fake, OPS.exp_cpu).startswith("exp_cpu: x must be fp32"), x.dtype
    q, kv, sink, idx = _good()
    with pytest.raises(ValueError, match="sparse_attn_cpu: idx must"):  # the torch reference checks too
        A.sparse_attn_cpu_ref(q, kv, sink, idx[0], 0.5)


def test_fake_and_op_messages_agree():
    """check_args gives 'the C++ op's message' for dtypes the C++ side spells like torch and
    scales whose text is the same in C++ and Python."""
    for _, same, args in _bad_calls():
        if same:
            assert _raise_message(args, True) == _raise_message(args, False)


def test_opcheck():
    """torch.library.opcheck: schema, fake tensor (shapes, dtypes, strides) and aot dispatch, dynamic shapes."""
    q, kv, sink, idx = _good()
    torch.library.opcheck(OPS.sparse_attn_cpu, (q, kv, sink, idx, 0.5))
    torch.library.opcheck(OPS.exp_cpu, (torch.randn(5, 7),))


# ------------------------------------------------------------------------------------------ vs the golden

def _bf16_ulp(y: torch.Tensor) -> torch.Tensor:
    """The bf16 step at |y| (float64), 2^-133 below the normal range."""
    return torch.exp2((torch.frexp(y.abs().clamp_min(2.0**-126))[1] - 8).double())


def golden_bound(q, kv, sink, idx, scale):
    """Per element: (mu = sum_j w_j |v_j[d]| with the float64 softmax weights w_j (sink in the
    denominator), eta) such that |op - golden| <= ulp_bf16(max(|op|, |golden|)) + eta * mu.

    Derivation, for one (row, head), u = 2^-24, both sides run the same sequence except:
      logits: the op's fma chain over D is within D u sum_d|q_d k_d| of q.k, the golden's single
        rounding within u |q.k|; both then round (.) * scale. So the logits differ by at most
        e = scale (D + 3) u max_j sum_d |q_d k_jd|, and so does every running max (max is
        1-Lipschitz).
      p_j = exp(fl(s_j - m)), alpha, exp(sink - m): arguments differ by <= 2e plus the two
        subtractions' roundings (<= 2u * 104: a larger |s - m| gives p = 0 on both sides), the two
        exps are within 1 ulp (exp_ref measured above; torch.exp fp32 is SLEEF's 1-ulp exp):
        relative difference eps_p <= 2.01 e + 2^-15.
      bf16(p_j): if a bf16 rounding boundary lies between the two p_j, they differ by one bf16
        step, <= 2^-7 p_j. Worst case every slot: the term 2^-7 below, which dominates eta.
      block sums: the op's 64-term fp32 chains (sum P, P @ V) are within 64 u of the sum of |terms|,
        the golden's float64 sums rounded once within u; o = o*alpha + pv and l = l*alpha + sum
        round twice per block (nblk blocks), the products of up to nblk alphas add nblk eps_p.
    With x = sum_j A_j bf16(p_j) v_j / (sum_j A_j p_j + exp(sink - m)) (A_j the alphas after j's
    block) the numerator's terms move by <= 2^-7 + eps_p + nblk eps_p + (66 + 2 nblk) u relative,
    the denominator by the same without 2^-7, so the fp32 results differ by
    delta <= (1 + 2^-6) (2^-7 + 2 (1 + nblk) eps_p + 2 (66 + 2 nblk) u) mu (the 1 + 2^-6 covers
    bf16(p) vs p and w_j's rounding). Both are then rounded to bf16: <= ulp_bf16(max) + delta.
    """
    b, _, h, d = q.shape
    n, k = kv.shape[1], idx.shape[2]
    valid = (idx >= 0) & (idx < n)
    kvg = kv.double()[torch.arange(b)[:, None, None], torch.where(valid, idx, 0).long()]  # [B,S,K,D]
    logits = torch.einsum("bshd,bskd->bshk", q.double(), kvg) * scale
    mag = torch.einsum("bshd,bskd->bshk", q.double().abs(), kvg.abs()) * scale
    logits = logits.masked_fill(~valid[:, :, None], -math.inf)
    m = logits.amax(-1, keepdim=True).clamp_min(-1e30)
    e = torch.exp(logits - m)
    w = e / (e.sum(-1, keepdim=True) + torch.exp(sink.double().view(1, 1, h, 1) - m))
    mu = torch.einsum("bshk,bskd->bshd", w, kvg.abs())
    err_logit = (d + 3) * U * mag.masked_fill(~valid[:, :, None], 0).amax(-1, keepdim=True)
    eps_p = 2.01 * err_logit + 2.0**-15
    nblk = -(-k // BLOCK_KEYS)
    eta = (1 + 2.0**-6) * (2.0**-7 + 2 * (1 + nblk) * eps_p + 2 * (66 + 2 * nblk) * U)
    return mu, eta


@pytest.mark.parametrize("b, s, h, n, k, q_scale", [(1, 16, 8, 300, 192, 1.0), (2, 1, 64, 2000, 640, 1.0),
                                                    (1, 8, 16, 1000, 640, 3.0)],
                         ids=["tiny-prefill", "decode-h64-k640", "sharp-softmax"])
def test_close_to_golden(b, s, h, n, k, q_scale):
    """The model's shapes (D = 512, scale = 512^-0.5, K = window + top-k) with realistic magnitudes:
    kv rows of unit RMS (kv_norm), q ~ N(0, q_scale^2), sink ~ N(0, 1), 10% empty slots.

    1. Rigorous: |op - golden| <= ulp_bf16(max(|op|, |golden|)) + eta mu (golden_bound); eta is
       ~2^-7 (a worst case where every bf16(p_j) rounds the other way) and measured values use
       ~1-5% of the eta mu budget beyond the final rounding.
    2. A few bf16 steps: |op - golden| <= 2 ulp_bf16(max_d |golden[row, head, :]|), the step at the
       (row, head)'s own scale (elementwise steps are meaningless for outputs near 0, where a
       1e-6 absolute deviation is hundreds of steps). One step is the final rounding (two values
       within delta of each other round to neighbours at most, when delta < 1 step); delta itself
       is far below a step here because the fp32 rounding errors of the logits behave like a
       random walk (~sqrt(D) u, not D u, relative), so a bf16(p_j) flip needs p_j within ~1e-6 of
       a bf16 midpoint (~0.1% of slots), moves x by <= 2^-7 w_j |v_j|, and cannot hit the largest
       weight (its p is exp(0) = 1 on both sides). Measured: at most 1 step; < 1% of elements differ.
    """
    gen = torch.Generator().manual_seed(12)
    d = 512
    q = (torch.randn(b, s, h, d, generator=gen) * q_scale).bfloat16()
    kv = torch.randn(b, n, d, generator=gen)
    kv = (kv * kv.pow(2).mean(-1, keepdim=True).rsqrt()).bfloat16()
    sink = torch.randn(h, generator=gen)
    idx = torch.randint(0, n, (b, s, k), generator=gen)
    idx = torch.where(torch.rand(b, s, k, generator=gen) < 0.1, -1, idx).to(torch.int32)
    sc = d ** -0.5
    out = A.sparse_attn_cpu(q, kv, sink, idx, sc).double()
    gold = sparse_attn_ref(q, kv, sink, idx, sc).double()
    assert out.isfinite().all() and gold.isfinite().all()
    diff = (out - gold).abs()
    mu, eta = golden_bound(q, kv, sink, idx, sc)
    final = _bf16_ulp(torch.maximum(out.abs(), gold.abs()))
    budget_used = ((diff - final).clamp_min(0) / (eta * mu)).max().item()
    steps_row = (diff / _bf16_ulp(gold.abs().amax(-1, keepdim=True))).max().item()
    differ = (diff > 0).double().mean().item()
    print(f"vs golden: max {diff.max().item():.3g} abs, {steps_row:.2f} bf16 steps at the row scale, "
          f"{differ:.3%} elements differ, {budget_used:.3%} of the eta*mu budget (eta max {eta.max().item():.3g})")
    assert bool((diff <= final + eta * mu).all())
    assert steps_row <= 2
    assert differ < 0.01


# ------------------------------------------------------------------------------------------ export

class _Attn(torch.nn.Module):
    def forward(self, q, kv, sink, idx):
        return A.sparse_attn_cpu(q, kv, sink, idx, 512 ** -0.5)


def test_exports_with_dynamic_s():
    """torch.export with S symbolic (the fake checks args on symbolic shapes without a guard on S):
    the graph holds the op itself, and the exported program gives the eager bits at S other than
    the traced one (S = 1 included)."""
    gen = torch.Generator().manual_seed(13)

    def args(s):
        return make_inputs(1, s, 4, 512, 60, 130, gen, empty_rows=[(0, s - 1)] if s > 1 else [])

    seq = torch.export.Dim("S", min=1, max=4096)
    ep = torch.export.export(_Attn(), args(7), dynamic_shapes=({1: seq}, None, None, {1: seq}), strict=False)
    targets = [node.target for node in ep.graph.nodes if node.op == "call_function"]
    assert targets == [OPS.sparse_attn_cpu.default]
    (lo_hi,) = [(r.lower, r.upper) for r in ep.range_constraints.values()]
    assert lo_hi == (1, 4096)
    module = ep.module()
    for s in (1, 3, 7, 20):
        a = args(s)
        assert_bf16_bits(module(*a), _Attn()(*a), f"S={s}")
