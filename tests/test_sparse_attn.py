"""dsneuron::sparse_attn against float64 and float32-online oracles, with the docs/numerics.md "Kernel tests: edge cases and tolerances"
edge cases A1-A4 and A6-A9 (A5 topk_length, A10-A12 FP8 paging and split-KV are not part of this op)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import dsneuron.kernels_nki  # noqa: F401  (registers torch.ops.dsneuron)
from dsneuron.kernels_nki.sparse_attn_ref import sparse_attn_ref
from oracles import assert_close, f64, sparse_attn_online_f32, sparse_attn_oracle, ulp_distance_bf16

INT_MIN, INT_MAX = -(2**31), 2**31 - 1

# FlashMLA sparse prefill at HEAD, output vs the fp32 reference (docs/numerics.md "Kernel tests: edge cases and tolerances").
ABS_TOL, REL_TOL, COS_TOL = 8e-4, 3.01 / 128, 7e-6


def hostile_fillers(n_kv: int) -> list[int]:
    """Invalid index values the FlashMLA tests use (lib.py), relative to this N."""
    return [INT_MIN, -123456, -1, n_kv, n_kv + 1, 114514, 2147480000, INT_MAX]


@dataclass(frozen=True)
class Case:
    """One input family. Shapes: q [b,s,h,d], kv [b,n,d], idx [b,s,k]."""
    id: str
    b: int
    s: int
    h: int
    d: int
    n: int
    k: int
    invalid: float = 0.1  # fraction of slots holding a hostile invalid index
    empty_rows: float = 0.0  # fraction of rows whose every slot is invalid
    sink: str = "mixed"  # per head: "mixed" = -inf/+inf/finite (FlashMLA lib.py), or "finite"
    dup_range: int = 0  # > 0: draw indices from [0, dup_range) only, so duplicates abound
    blank_blocks: tuple[int, ...] = ()  # 64-key blocks whose every slot is invalid
    scale: float | None = None  # default d ** -0.5
    seed: int = 0


def make_inputs(c: Case):
    """FlashMLA-style inputs: randn/10 plus a random per-tensor offset; hostile invalid indices."""
    g = torch.Generator().manual_seed(1000 + c.seed)
    q = (torch.randn(c.b, c.s, c.h, c.d, generator=g) / 10 + torch.randn(1, generator=g) / 10).bfloat16()
    kv = (torch.randn(c.b, c.n, c.d, generator=g) / 10 + torch.randn(1, generator=g) / 10).bfloat16()
    if c.sink == "mixed":
        choice = torch.randint(0, 3, (c.h,), generator=g)
        sink = torch.where(choice == 0, -math.inf, torch.where(choice == 1, math.inf, torch.randn(c.h, generator=g)))
    else:
        sink = torch.randn(c.h, generator=g)
    hi = c.dup_range or c.n
    idx = torch.randint(0, hi, (c.b, c.s, c.k), generator=g)
    fillers = torch.tensor(hostile_fillers(c.n), dtype=torch.int64)
    bad = torch.rand(c.b, c.s, c.k, generator=g) < c.invalid
    bad |= (torch.rand(c.b, c.s, 1, generator=g) < c.empty_rows).expand_as(bad)
    if c.k > c.n and not c.dup_range:  # A2 as FlashMLA builds it: a permutation of N, then padding
        idx[..., : c.n] = torch.stack([torch.randperm(c.n, generator=g) for _ in range(c.b * c.s)]).view(c.b, c.s, c.n)
        bad[..., c.n:] = True
    for blk in c.blank_blocks:
        bad[..., blk * 64:(blk + 1) * 64] = True
    idx = torch.where(bad, fillers[torch.randint(0, len(fillers), idx.shape, generator=g)], idx)
    scale = c.scale if c.scale is not None else c.d ** -0.5
    return q, kv, sink.float(), idx.to(torch.int32), scale


CASES = [
    Case("tiny-decode", 1, 1, 8, 512, 485, 192),
    Case("tiny-prefill-rows", 2, 12, 8, 512, 300, 192, scale=0.5),
    Case("d64-topk>n-95-128", 1, 24, 4, 64, 95, 128, seed=1),
    Case("topk>n-153-256", 1, 8, 2, 64, 153, 256, seed=2),
    Case("topk>n-114-384", 1, 8, 2, 128, 114, 384, seed=3),
    Case("n-not-mult64-1521", 1, 8, 4, 128, 1521, 128, seed=4),
    Case("blank-blocks-0-2", 1, 8, 4, 64, 300, 200, blank_blocks=(0, 2), seed=13),
    Case("k1", 2, 6, 4, 64, 50, 1, invalid=0.3, seed=5),
    Case("k63-partial", 1, 10, 4, 64, 200, 63, seed=6),
    Case("k65-partial", 1, 10, 4, 64, 200, 65, seed=7),
    Case("k130-partial", 1, 10, 4, 64, 200, 130, seed=8),
    Case("h1", 1, 10, 1, 512, 130, 70, seed=9),
    Case("empty-rows", 2, 16, 4, 64, 100, 96, empty_rows=0.3, seed=10),
    Case("duplicates", 1, 16, 4, 64, 200, 96, dup_range=8, invalid=0.2, seed=11),
    Case("finite-sinks", 1, 16, 8, 64, 90, 64, sink="finite", seed=12),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_online_softmax_matches_global_softmax_oracle(case: Case):
    """The 64-key online result vs a one-pass float64 global softmax: FlashMLA prefill tolerances."""
    args = make_inputs(case)
    out = torch.ops.dsneuron.sparse_attn(*args)
    assert out.dtype == torch.bfloat16 and out.shape == args[0].shape
    assert_close(out, sparse_attn_oracle(*args), abs_tol=ABS_TOL, rel_tol=REL_TOL, cos_tol=COS_TOL, what=case.id)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rounding_points_match_float32_online_oracle(case: Case):
    """Same block order and rounding points (bf16 P into PV, fp32 P into l) in NumPy float32.

    Not bitwise: the contract fixes where values are rounded, not the fp32 summation order inside
    a dot product or a block sum, which differs between torch's and NumPy's kernels (and exp()
    implementations differ in the last fp32 bit). Such a difference can flip one bf16 rounding of
    P or of the output, so elements may differ by one bf16 step; nearly all must agree exactly.
    """
    args = make_inputs(case)
    dist = ulp_distance_bf16(torch.ops.dsneuron.sparse_attn(*args), sparse_attn_online_f32(*args))
    assert dist.max() <= 1, f"{case.id}: {int((dist > 1).sum())} elements more than 1 bf16 step apart"
    assert (dist == 0).mean() >= 0.999, f"{case.id}: only {(dist == 0).mean():.5f} bitwise equal"


@pytest.mark.parametrize("sink_value", [-math.inf, math.inf, 0.0, 50.0, -50.0])
def test_rows_without_valid_index_are_zero_whatever_the_sink(sink_value):
    """A1: all-invalid rows (every hostile filler) give exactly 0, other rows are untouched; K = 0 too."""
    c = Case("a1", 2, 8, 4, 64, 70, 70, invalid=0.0, sink="finite", seed=20)
    q, kv, _, idx, scale = make_inputs(c)
    sink = torch.full((c.h,), sink_value)
    before = torch.ops.dsneuron.sparse_attn(q, kv, sink, idx, scale)
    fillers = torch.tensor(hostile_fillers(c.n), dtype=torch.int32)
    idx[0, 3] = fillers[torch.arange(c.k) % len(fillers)]
    idx[1, 0] = -1
    out = torch.ops.dsneuron.sparse_attn(q, kv, sink, idx, scale)
    assert not out.isnan().any()
    assert (out[0, 3] == 0).all() and (out[1, 0] == 0).all()
    keep = torch.ones(c.b, c.s, dtype=torch.bool)
    keep[0, 3] = keep[1, 0] = False
    assert torch.equal(out[keep], before[keep])
    empty = torch.ops.dsneuron.sparse_attn(q, kv, sink, idx[:, :, :0].contiguous(), scale)
    assert torch.equal(empty, torch.zeros_like(q))


def test_hostile_indices_behave_as_minus_one():
    """A4: indices < -1 and >= N (INT_MIN, INT_MAX, N, ...) are exactly as empty as -1."""
    q, kv, sink, idx, scale = make_inputs(Case("a4", 1, 16, 4, 64, 100, 128, invalid=0.4, seed=21))
    canon = torch.where((idx >= 0) & (idx < kv.shape[1]), idx, -1)
    assert not torch.equal(canon, idx)
    assert torch.equal(torch.ops.dsneuron.sparse_attn(q, kv, sink, idx, scale),
                       torch.ops.dsneuron.sparse_attn(q, kv, sink, canon, scale))


def test_nan_in_unreferenced_kv_rows_does_not_leak():
    """A9: NaN/inf in rows no valid index references (row 0, the clamp target, among them)."""
    q, kv, sink, idx, scale = make_inputs(Case("a9", 2, 12, 4, 64, 80, 96, invalid=0.3, empty_rows=0.2, seed=22))
    n_kv = kv.shape[1]
    idx = torch.where((idx >= 0) & (idx < 3), idx + 3, idx)  # rows 0..2 are never referenced
    referenced = torch.zeros(kv.shape[:2], dtype=torch.bool)
    for b in range(kv.shape[0]):
        ok = idx[b][(idx[b] >= 0) & (idx[b] < n_kv)].long()
        referenced[b, ok] = True
    assert not referenced[:, 0].any() and (idx < 0).any()
    poisoned = kv.clone()
    poisoned[~referenced] = torch.tensor([math.nan, math.inf, -math.inf]).repeat(kv.shape[2])[: kv.shape[2]].bfloat16()
    out = torch.ops.dsneuron.sparse_attn(q, poisoned, sink, idx, scale)
    assert not out.isnan().any()
    cleaned = torch.where(referenced.unsqueeze(-1), kv, torch.zeros((), dtype=kv.dtype))
    assert torch.equal(out, torch.ops.dsneuron.sparse_attn(q, cleaned, sink, idx, scale))


def test_duplicates_and_sink_hand_computed():
    """A8 + A6 by hand: with q = 0 every valid logit is 0, so P = 1 per slot, m = 0, and a finite
    sink s adds exp(s) to the denominator only. Values are small integers, so the result is exact."""
    d = 64
    q = torch.zeros(1, 3, 2, d, dtype=torch.bfloat16)
    kv = torch.zeros(1, 5, d, dtype=torch.bfloat16)
    kv[0, 1], kv[0, 2], kv[0, 4] = 3.0, 5.0, -6.0
    idx = torch.tensor([[[1, 1, 2, -1], [4, 4, 4, 2], [2, 7, -9, 1]]], dtype=torch.int32)
    sink = torch.tensor([-math.inf, 0.0])  # head 1: exp(0 - 0) = 1 more in the denominator
    out = torch.ops.dsneuron.sparse_attn(q, kv, sink, idx, 0.1)
    numerators, counts = [3 + 3 + 5, -6 * 3 + 5, 5 + 3], [3, 4, 2]
    for s in range(3):
        for head, extra in ((0, 0), (1, 1)):  # exact fp32 integers, one fp32 division, one bf16 rounding
            want = torch.tensor(float(numerators[s])) / torch.tensor(float(counts[s] + extra))
            assert torch.equal(out[0, s, head], want.bfloat16().expand(d)), (s, head)


def test_sink_limits():
    """A6: sink = +inf zeroes every row; sink = -inf is the identity (denominator = l exactly);
    a finite sink scales by exp(lse) / (exp(lse) + exp(sink)) as in the float64 oracle."""
    q, kv, _, idx, scale = make_inputs(Case("a6", 1, 16, 4, 64, 90, 100, seed=23))
    h = q.shape[2]
    plus_inf = torch.full((h,), math.inf)
    assert torch.equal(torch.ops.dsneuron.sparse_attn(q, kv, plus_inf, idx, scale), torch.zeros_like(q))
    for sink in (torch.full((h,), -math.inf), torch.tensor([-3.0, 0.0, 2.0, 8.0])):
        out = torch.ops.dsneuron.sparse_attn(q, kv, sink, idx, scale)
        assert_close(out, sparse_attn_oracle(q, kv, sink, idx, scale), abs_tol=ABS_TOL, rel_tol=REL_TOL,
                     cos_tol=COS_TOL, what=f"sink {sink.tolist()}")
        dist = ulp_distance_bf16(out, sparse_attn_online_f32(q, kv, sink, idx, scale))
        assert dist.max() <= 1


@pytest.mark.parametrize("position", [5, 70, 150, 191])
def test_one_dominant_logit(position):
    """A7: one logit far above the rest (here ~70 natural units, > 6 in log2 units) in block 0, 1 or 2:
    the running-max rescale path; the output is that row's value, within the A.6 tolerances."""
    c = Case("a7", 1, 6, 2, 64, 300, 192, invalid=0.05, sink="finite", seed=24)
    q, kv, sink, idx, scale = make_inputs(c)
    u = torch.randn(c.d, generator=torch.Generator().manual_seed(7))
    q[:] = (3 * u).bfloat16()
    kv[0, 17] = (3 * u).bfloat16()
    idx[0, :, position] = 17
    out = torch.ops.dsneuron.sparse_attn(q, kv, sink, idx, scale)
    assert_close(out, sparse_attn_oracle(q, kv, sink, idx, scale), abs_tol=ABS_TOL, rel_tol=REL_TOL,
                 cos_tol=COS_TOL, what=f"dominant at {position}")
    assert torch.allclose(out[0, :, 0].float(), kv[0, 17].float().expand(c.s, -1), rtol=1 / 64, atol=1e-2)


def test_twenty_reruns_bitwise_identical():
    args = make_inputs(Case("rerun", 2, 6, 8, 512, 300, 192, empty_rows=0.1, seed=25))
    first = torch.ops.dsneuron.sparse_attn(*args)
    for _ in range(19):
        assert torch.equal(torch.ops.dsneuron.sparse_attn(*args), first)


def test_result_does_not_depend_on_row_chunking():
    args = make_inputs(Case("chunks", 2, 20, 4, 128, 200, 150, empty_rows=0.1, seed=26))
    full = sparse_attn_ref(*args)
    for rows in (1, 7, 40):
        assert torch.equal(sparse_attn_ref(*args, rows_per_chunk=rows), full)


def _good_args():
    return make_inputs(Case("bad", 1, 3, 2, 64, 10, 5, seed=27))


@pytest.mark.parametrize("position, value, match", [
    (0, lambda a: a[0].float(), "q must be bf16"),
    (0, lambda a: a[0][0], "q must be bf16"),
    (1, lambda a: a[1].float(), "kv must be bf16"),
    (1, lambda a: torch.cat([a[1], a[1]]), "kv must be bf16"),
    (1, lambda a: a[1][..., :32], "kv must be bf16"),
    (2, lambda a: a[2].bfloat16(), "sink must be fp32"),
    (2, lambda a: torch.zeros(3), "sink must be fp32"),
    (3, lambda a: a[3].long(), "idx must be int32"),
    (3, lambda a: a[3][:, :2].contiguous(), "idx must be int32"),
    (4, lambda a: 0.0, "scale must be finite and > 0"),
    (4, lambda a: -0.5, "scale must be finite and > 0"),
    (4, lambda a: math.nan, "scale must be finite and > 0"),
    (4, lambda a: math.inf, "scale must be finite and > 0"),
])
def test_bad_inputs_raise_value_error(position, value, match):
    args = list(_good_args())
    args[position] = value(args)
    with pytest.raises(ValueError, match=match):
        torch.ops.dsneuron.sparse_attn(*args)


class _Attend(torch.nn.Module):
    def forward(self, q, kv, sink, idx):
        return torch.ops.dsneuron.sparse_attn(q, kv, sink, idx, 0.125) * 2


def test_export_keeps_one_node_and_fake_matches():
    args = _good_args()[:4]
    ep = torch.export.export(_Attend(), args)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.dsneuron.sparse_attn.default) == 1
    assert torch.equal(ep.module()(*args), _Attend()(*args))
    torch.library.opcheck(torch.ops.dsneuron.sparse_attn.default, (*args, 0.125))
    with pytest.raises(ValueError, match="q must be bf16"):
        torch.export.export(_Attend(), (args[0].float(), *args[1:]))


def test_reference_traces_for_inlining():
    """The cpu lowering may inline the reference (run_decompositions): it must trace without
    data-dependent control flow, and the traced aten graph must give the same bits."""
    args = make_inputs(Case("trace", 2, 40, 4, 128, 90, 150, empty_rows=0.1, seed=28))[:4]
    ep = torch.export.export(_Attend(), args)
    inlined = ep.run_decompositions({torch.ops.dsneuron.sparse_attn.default: sparse_attn_ref})
    targets = {n.target for n in inlined.graph.nodes if n.op == "call_function"}
    assert torch.ops.dsneuron.sparse_attn.default not in targets
    assert torch.equal(inlined.module()(*args), _Attend()(*args))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_shape_sweep(seed):
    rng = np.random.default_rng(seed)
    n_kv = int(rng.integers(1, 700))
    c = Case(f"sweep{seed}", int(rng.integers(1, 3)), int(rng.integers(1, 20)), int(rng.choice([1, 2, 8])),
             int(rng.choice([64, 128, 512])), n_kv, int(rng.integers(1, 400)), invalid=float(rng.random() * 0.5),
             empty_rows=float(rng.random() * 0.2), dup_range=int(rng.choice([0, 0, 5])), seed=100 + seed)
    args = make_inputs(c)
    out = torch.ops.dsneuron.sparse_attn(*args)
    assert_close(out, sparse_attn_oracle(*args), abs_tol=ABS_TOL, rel_tol=REL_TOL, cos_tol=COS_TOL, what=c.id)
    assert ulp_distance_bf16(out, sparse_attn_online_f32(*args)).max() <= 1


@pytest.mark.slow
def test_tiny_prefill_shape():
    """The tiny model's prefill call (S=715, H=8, D=512, K=192, N=1072), oracle checked by row slices."""
    args = make_inputs(Case("tiny-prefill", 1, 715, 8, 512, 1072, 192, invalid=0.05, seed=30))
    q, kv, sink, idx, scale = args
    out = torch.ops.dsneuron.sparse_attn(*args)
    for s0 in range(0, 715, 128):
        part = (q[:, s0:s0 + 128], kv, sink, idx[:, s0:s0 + 128], scale)
        assert_close(out[:, s0:s0 + 128], sparse_attn_oracle(*part), abs_tol=ABS_TOL, rel_tol=REL_TOL,
                     cos_tol=COS_TOL, what=f"rows {s0}")
        assert ulp_distance_bf16(out[:, s0:s0 + 128], sparse_attn_online_f32(*part)).max() <= 1
    assert np.isfinite(f64(out)).all()
