"""Paged MQA logits: `paged_mqa_logits_ref` / `paged_mqa_logits_sparse_ref` (kernels_nki/mqa_logits_ref.py) and
the NKI kernels `paged_mqa_logits_kernel` / `paged_mqa_logits_sparse_kernel` (on the NumPy stand-in) against a
float64 oracle that reads the pages itself, and against the contiguous reference and kernel on the same keys.
docs/numerics.md "Kernel tests: edge cases and tolerances" (partial last page, context 1, empty rows) and B6 (next_n = 2 with DeepGEMM's 1-D
causal rule), plus the block-table contract: slots past a context are never read (deepseek-ai/DeepGEMM
tests/test_attention.py builds its tables with zeros there; here they hold hostile ids)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsneuron.kernels_nki import sim
from dsneuron.kernels_nki.mqa_logits_ref import (
    mqa_logits_ref,
    mqa_logits_sparse_ref,
    paged_mqa_logits_ref,
    paged_mqa_logits_sparse_ref,
)
from oracles import assert_calc_diff, dequantize, f64, mqa_scores, quantize_fp4, quantize_fp8, ulp_distance_bf16
from test_mqa_logits import SIM_DIFF_BF16, bf16_ref

INT_MIN, INT_MAX = -(2**31), 2**31 - 1
P_MAX = 128  # partitions: the kernels broadcast one int32 per partition per row bound


# ------------------------------------------------------------------------------------------ inputs

@dataclass(frozen=True)
class PagedCase:
    """B = len(lens) sequences of next_n query tokens; lens are the sequences' context lengths."""
    id: str
    fmt: str  # "fp8" | "fp4"
    lens: tuple[int, ...]
    next_n: int
    page: int
    h: int = 4
    d: int = 64
    lens_2d: bool = False  # context_lens [B, N] (per-row ends, DeepGEMM HEAD) instead of [B] (1-D causal rule)
    weights: str = "positive"  # positive | mixed | bf16
    extra_cols: int = 3  # max_context_len = max(lens) + extra_cols (negative truncates)
    seed: int = 0


@dataclass
class Paged:
    q: torch.Tensor
    q_sf: torch.Tensor
    cache: torch.Tensor  # uint8 [pages, page, 1, Dq + D/32]
    w: torch.Tensor
    context_lens: torch.Tensor
    table: torch.Tensor
    ends: np.ndarray  # [B, N]: row n of sequence b sees positions < ends[b, n]
    kv: torch.Tensor  # the same keys laid out contiguously, sequence b from row starts[b]
    kv_sf: torch.Tensor
    starts: np.ndarray
    cols: int

    def args(self):
        return self.q, self.q_sf, self.cache, self.w, self.context_lens, self.table


def make_paged(c: PagedCase, poison: bool = True) -> Paged:
    """Keys quantized as one contiguous array whose sequences start on page boundaries, cut into pages
    stored under shuffled ids, plus spare pages. With `poison`, everything no row may read is hostile:
    spare pages and the tail of each last page hold NaN codes and NaN scale bytes (255), and the table
    slots past each context hold -1, INT_MIN, INT_MAX, ids past the cache and ids of spare pages.
    Without it those hold finite data and page 0; the random draws are the same either way."""
    rng = np.random.default_rng(1000 + c.seed)
    quant = quantize_fp8 if c.fmt == "fp8" else quantize_fp4
    n_seq, n, page = len(c.lens), c.next_n, c.page
    lens = np.array(c.lens, dtype=np.int64)
    q, q_sf = quant(rng.standard_normal((n_seq, n, c.h, c.d)))
    if c.lens_2d:  # DeepGEMM's test: floor((ctx + 1) * U[0, 1)), the last token seeing the whole context
        ends = ((lens[:, None] + 1) * rng.random((n_seq, n))).astype(np.int64)
        ends[:, -1] = lens
        context_lens = torch.from_numpy(ends.astype(np.int32))
    else:
        ends = lens[:, None] - n + 1 + np.arange(n)
        context_lens = torch.from_numpy(lens.astype(np.int32))
    rows = n_seq * n
    w = rng.standard_normal((rows, c.h)) if c.weights == "mixed" else rng.random((rows, c.h)) + 0.01
    w = torch.from_numpy(w).float()
    if c.weights == "bf16":
        w = w.bfloat16()

    used = -(-lens // page)
    starts = (np.cumsum(used) - used) * page
    kv, kv_sf = quant(rng.standard_normal((int(used.sum()) * page, c.d)))
    codes, scales = kv.view(torch.uint8).clone(), kv_sf.clone()
    spare = 3
    n_pages = int(used.sum()) + spare
    ids = rng.permutation(n_pages).astype(np.int64)  # ids[k]: page of the contiguous layout's k-th page
    junk = np.array([-1, INT_MIN, INT_MAX, n_pages, n_pages + 10**6, *ids[-spare:]])
    table = rng.choice(junk, size=(n_seq, int(used.max(initial=0)) + 2))
    if poison:
        for b in range(n_seq):
            tail = slice(int(starts[b] + lens[b]), int(starts[b] + used[b] * page))
            codes[tail], scales[tail] = 0x7F, 255
    else:
        table[:] = 0
    width, groups = codes.shape[1], scales.shape[1]
    cache = np.zeros((n_pages, page * (width + groups)), dtype=np.uint8)
    if poison:
        cache[:, :page * width], cache[:, page * width:] = 0x7F, 255
    for k in range(int(used.sum())):
        cache[ids[k], :page * width] = codes[k * page:(k + 1) * page].numpy().reshape(-1)
        cache[ids[k], page * width:] = scales[k * page:(k + 1) * page].numpy().reshape(-1)
    for b in range(n_seq):
        first = int(starts[b]) // page
        table[b, :used[b]] = ids[first:first + used[b]]
    kv = codes.view(kv.dtype)
    cache = torch.from_numpy(cache).reshape(n_pages, page, 1, width + groups)
    cols = max(0, int(lens.max(initial=0)) + c.extra_cols)
    return Paged(q, q_sf, cache, w, context_lens, torch.from_numpy(table.astype(np.int32)), ends, kv, scales,
                 starts, cols)


def make_selected_blocks(p: Paged, nb: int, bs: int, seed: int) -> torch.Tensor:
    """Per row: blocks reaching into the row's context (shuffled, one duplicate), -1 padding, other
    negatives, blocks past the context and past the table, and ones whose position would wrap int32."""
    rng = np.random.default_rng(seed)
    rows = []
    for end in p.ends.reshape(-1):
        reach = rng.permutation(np.arange(-(-int(end) // bs)))[: nb // 2]
        junk = rng.choice([-1, -1, -7, INT_MIN, INT_MAX, 2**29, int(end) // bs + 1, 10**6], size=nb)
        row = np.concatenate([reach, reach[:1], junk])[:nb]
        rows.append(np.where(rng.random(nb) < 0.1, -1, row))
    return torch.from_numpy(np.stack(rows).astype(np.int32))


# ------------------------------------------------------------------------------------------ oracle

def _oracle_keys(p: Paged, b: int, n_pos: int) -> np.ndarray:
    """float64 [n_pos, D]: positions 0 .. n_pos-1 of sequence b, each read from its page by hand."""
    page, width = p.cache.shape[1], p.q.shape[3]
    groups = p.q_sf.shape[3]
    flat = p.cache.reshape(p.cache.shape[0], -1)
    keys = []
    for j in range(n_pos):
        pid, t = int(p.table[b, j // page]), j % page
        code = flat[pid, t * width:(t + 1) * width]
        sf = flat[pid, page * width + t * groups:page * width + (t + 1) * groups]
        keys.append(dequantize(code.view(torch.float8_e4m3fn) if p.q.dtype == torch.float8_e4m3fn else code, sf))
    return np.stack(keys) if keys else np.zeros((0, p.q_sf.shape[3] * 32))


def _oracle_scores(p: Paged, b: int) -> np.ndarray:
    """float64 [N, max end of sequence b]: sum_h relu(q . k) * w for every position any row of b sees."""
    n_seq, n, n_heads = p.q.shape[:3]
    keys = _oracle_keys(p, b, int(p.ends[b].max()))
    return mqa_scores(dequantize(p.q[b], p.q_sf[b]), keys, f64(p.w).reshape(n_seq, n, n_heads)[b])


def paged_oracle(p: Paged, cols: int) -> np.ndarray:
    """float64 [B*N, cols]: column j of row b*N+n is position j of sequence b, -inf from ends[b, n] on."""
    n_seq, n = p.q.shape[:2]
    out = np.full((n_seq * n, cols), -np.inf)
    for b in range(n_seq):
        scores = _oracle_scores(p, b)
        for i in range(n):
            e = min(int(p.ends[b, i]), cols)
            out[b * n + i, :e] = scores[i, :e]
    return out


def paged_sparse_oracle(p: Paged, blocks: torch.Tensor, bs: int) -> np.ndarray:
    """float64 [B*N, NB*bs]: column k*bs+o of row r is position blocks[r, k]*bs + o; -inf for a negative
    block or a position at or past the row's end."""
    n_seq, n = p.q.shape[:2]
    out = np.full((n_seq * n, blocks.shape[1] * bs), -np.inf)
    for b in range(n_seq):
        scores = _oracle_scores(p, b)
        for i in range(n):
            r = b * n + i
            for k, blk in enumerate(blocks[r].tolist()):
                for o in range(bs):
                    pos = blk * bs + o
                    if blk >= 0 and pos < p.ends[b, i]:
                        out[r, k * bs + o] = scores[i, pos]
    return out


def check_oracle(out: torch.Tensor, oracle: np.ndarray, c: PagedCase, what: str) -> None:
    """-inf exactly where the oracle has it, calc_diff < 3e-5, and with positive weights (no
    cancellation) one bf16 step at most from bf16(float64 score)."""
    assert out.dtype == torch.bfloat16 and out.shape == oracle.shape, what
    assert out.shape[1] == 0 or out.stride(0) % 256 == 0, what  # 512-byte rows
    assert_calc_diff(out, oracle, SIM_DIFF_BF16, what)
    if c.weights != "mixed":
        assert ulp_distance_bf16(out, bf16_ref(oracle)).max(initial=0) <= 1, what


def contiguous_bounds(p: Paged) -> tuple[torch.Tensor, torch.Tensor]:
    """ks, ke [B*N] of the same rows over the contiguous keys p.kv."""
    ks = np.repeat(p.starts, p.q.shape[1])
    return (torch.from_numpy(ks.astype(np.int32)),
            torch.from_numpy((ks + p.ends.reshape(-1)).astype(np.int32)))


# ------------------------------------------------------------------------------------------ cases

REF_CASES = [
    PagedCase("fp8-page64-zero-boundary-one-past", "fp8", (0, 1, 63, 64, 65, 130), 1, 64),
    PagedCase("fp4-page32-d128", "fp4", (32, 33, 0, 95), 1, 32, h=8, d=128, seed=1),
    PagedCase("fp8-next2-causal", "fp8", (1, 2, 64, 65, 129), 2, 64, seed=2),
    PagedCase("fp4-next2-page16-bf16w", "fp4", (16, 17, 1, 48), 2, 16, weights="bf16", seed=3),
    PagedCase("fp8-next2-2d-lens-page32", "fp8", (0, 31, 32, 33, 70), 2, 32, lens_2d=True, seed=4),
    PagedCase("fp4-page128-mixed-w", "fp4", (128, 129, 7, 300), 1, 128, weights="mixed", seed=5),
    PagedCase("fp8-odd-page5-truncated", "fp8", (4, 5, 6, 23), 2, 5, extra_cols=-4, seed=6),
    PagedCase("fp4-page1-h1-d32", "fp4", (1, 3, 0), 1, 1, h=1, d=32, seed=7),
]

# the kernels take power-of-two pages of at least 32 tokens
KERNEL_CASES = [REF_CASES[0], REF_CASES[1], REF_CASES[2], REF_CASES[4],
                PagedCase("fp4-page128-bf16w-truncated", "fp4", (128, 129, 7), 1, 128, weights="bf16", extra_cols=-20,
                          seed=8)]


# ----------------------------------------------------------------------------------- references

@pytest.mark.parametrize("case", REF_CASES, ids=lambda c: c.id)
def test_ref_matches_float64_oracle_and_the_contiguous_ref(case: PagedCase):
    """B5/B6 and ragged contexts (0, 1, a page boundary and one past it); on poisoned tables and pages.
    The same keys laid out contiguously give the same bits through `mqa_logits_ref`."""
    p = make_paged(case)
    out = paged_mqa_logits_ref(*p.args(), p.cols)
    check_oracle(out, paged_oracle(p, p.cols), case, case.id)
    ks, ke = contiguous_bounds(p)
    contiguous = mqa_logits_ref(p.q.flatten(0, 1), p.q_sf.flatten(0, 1), p.kv, p.kv_sf, p.w, ks, ke, p.cols)
    assert torch.equal(out, contiguous)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("case", [REF_CASES[i] for i in (0, 3, 4, 5, 6)], ids=lambda c: c.id)
def test_sparse_ref_matches_float64_oracle_and_the_contiguous_ref(case: PagedCase, block_size: int):
    """Column k*B+o is position block*B+o of the row's sequence; -inf for empty blocks (-1, other
    negatives), blocks past the context or the table, and positions at or past the row's end. On the
    contiguous layout (sequence starts are page multiples, hence block multiples) the same logits come
    from `mqa_logits_sparse_ref` with blocks shifted by the sequence's start."""
    p = make_paged(case)
    blocks = make_selected_blocks(p, 12, block_size, case.seed)
    out = paged_mqa_logits_sparse_ref(*p.args(), blocks, block_size)
    oracle = paged_sparse_oracle(p, blocks, block_size)
    assert np.isfinite(oracle).any() and np.isneginf(oracle).any()
    check_oracle(out, oracle, case, case.id)
    ks, ke = contiguous_bounds(p)
    if case.page % block_size == 0:
        shifted = torch.where(blocks >= 0, blocks.long() + (ks.long() // block_size)[:, None], -1).int()
        contiguous = mqa_logits_sparse_ref(p.q.flatten(0, 1), p.q_sf.flatten(0, 1), p.kv, p.kv_sf, p.w, ks, ke,
                                           shifted, block_size)
        assert torch.equal(out, contiguous)


def test_poison_past_the_context_changes_nothing():
    """Hostile table slots and pages (see make_paged) give the bits of a clean table and cache, and
    raise nothing: the references read no slot past a context."""
    for case in (REF_CASES[2], REF_CASES[4]):
        hostile, clean = make_paged(case), make_paged(case, poison=False)
        assert (hostile.table != clean.table).any() and not torch.equal(hostile.cache, clean.cache)
        assert torch.equal(paged_mqa_logits_ref(*hostile.args(), hostile.cols),
                           paged_mqa_logits_ref(*clean.args(), clean.cols))
        blocks = make_selected_blocks(hostile, 10, 8, 0)
        assert torch.equal(paged_mqa_logits_sparse_ref(*hostile.args(), blocks, 8),
                           paged_mqa_logits_sparse_ref(*clean.args(), blocks, 8))


def test_only_in_context_slots_are_checked():
    """A bad id in the first slot past a context is ignored; the same id in the last slot of a context
    is refused. A context of exactly max_blocks * page positions fits."""
    p = make_paged(PagedCase("edge", "fp8", (64, 96), 1, 32))
    table = p.table[:, :3].clone()  # sequence 0 uses 2 slots, sequence 1 all 3
    table[0, 2] = INT_MAX
    out = paged_mqa_logits_ref(p.q, p.q_sf, p.cache, p.w, p.context_lens, table, p.cols)
    assert torch.equal(out, paged_mqa_logits_ref(*p.args(), p.cols))
    table[1, 2] = INT_MAX
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = 2147483647 lies inside sequence 1"):
        paged_mqa_logits_ref(p.q, p.q_sf, p.cache, p.w, p.context_lens, table, p.cols)
    with pytest.raises(ValueError, match="sequence 1 has context 96 > max_blocks 2"):
        paged_mqa_logits_ref(p.q, p.q_sf, p.cache, p.w, p.context_lens, p.table[:, :2], p.cols)


def _small():
    return list(make_paged(PagedCase("small", "fp8", (3, 40), 2, 32, seed=9)).args())


def _set(i, value):
    def mutate(a):
        a[i] = value(a)
        return a
    return mutate


BAD_INPUTS = [
    (_set(0, lambda a: a[0][0]), "q must be"),
    (_set(0, lambda a: a[0][:, :0]), "N >= 1 query tokens"),
    (_set(0, lambda a: a[0].float()), "q: expected float8_e4m3fn or packed"),
    (_set(1, lambda a: a[1][..., :1]), "q_sf must be UE8M0"),
    (_set(1, lambda a: a[1].float()), "q_sf must be UE8M0"),
    (_set(2, lambda a: a[2].view(torch.int8)), "kv_cache must be uint8"),
    (_set(2, lambda a: a[2][..., :-1]), "kv_cache must be uint8"),
    (_set(2, lambda a: a[2][:, :, 0]), "kv_cache must be uint8"),
    (_set(3, lambda a: a[3].half()), "weights must be fp32 or bf16"),
    (_set(3, lambda a: a[3][:2]), "weights must be fp32 or bf16"),
    (_set(4, lambda a: a[4].long()), "context_lens must be int32"),
    (_set(4, lambda a: a[4][:, None].expand(2, 3).contiguous()), "context_lens must be int32"),
    (_set(5, lambda a: a[5].long()), "block_table must be int32"),
    (_set(5, lambda a: a[5][0]), "block_table must be int32"),
    (_set(4, lambda a: torch.tensor([0, 40], dtype=torch.int32)), r"context_lens\[0\] = 0 is below next_n - 1 = 1"),
    (_set(4, lambda a: torch.tensor([[1, 3], [-1, 40]], dtype=torch.int32)), r"context_lens\[1, 0\] = -1 is negative"),
    (_set(4, lambda a: torch.tensor([3, 200], dtype=torch.int32)), "sequence 1 has context 200 > max_blocks"),
    (_set(5, lambda a: torch.where(torch.arange(a[5].shape[1]) == 1, a[2].shape[0], a[5]).int()),
     r"block_table\[1, 1\] = \d+ lies inside sequence 1's context \(40 positions\) but is not a page"),
    (_set(5, lambda a: torch.where(torch.arange(a[5].shape[1]) == 0, -1, a[5]).int()),
     r"block_table\[0, 0\] = -1 lies inside"),
]


@pytest.mark.parametrize("mutate, match", BAD_INPUTS)
def test_bad_inputs_raise_value_error(mutate, match):
    """Both references run the same checks (the sparse one given a valid block list)."""
    args = mutate(_small())
    with pytest.raises(ValueError, match=match):
        paged_mqa_logits_ref(*args, 40)
    with pytest.raises(ValueError, match=match):
        paged_mqa_logits_sparse_ref(*args, torch.zeros(4, 1, dtype=torch.int32), 8)


@pytest.mark.parametrize("extra, match", [
    ((-1,), "max_context_len must be >= 0"),
    ((torch.zeros(4, 2, dtype=torch.int32), 12), "block_size must be one of"),
    ((torch.zeros(4, 2, dtype=torch.int64), 8), "block_idx must be int32"),
    ((torch.zeros(2, 2, dtype=torch.int32), 8), r"block_idx must be int32 \[S=4,NB\]"),
])
def test_bad_output_size_or_block_list_raise_value_error(extra, match):
    with pytest.raises(ValueError, match=match):
        (paged_mqa_logits_ref if len(extra) == 1 else paged_mqa_logits_sparse_ref)(*_small(), *extra)


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(["fp8", "fp4"]), next_n=st.integers(1, 3), page=st.sampled_from([1, 3, 8, 32, 64]),
       lens=st.lists(st.integers(0, 140), min_size=1, max_size=4), lens_2d=st.booleans(),
       extra=st.integers(-10, 5), seed=st.integers(0, 2**16))
def test_property_ref_is_the_oracle_and_the_contiguous_ref(fmt, next_n, page, lens, lens_2d, extra, seed):
    """Random formats, page sizes, next_n, ragged lengths, both context_lens forms and truncated or
    extended outputs: the float64 oracle's -inf pattern and values, and the contiguous reference's bits."""
    lens = tuple(max(n, next_n - 1) for n in lens)  # the 1-D rule needs context_len >= next_n - 1
    case = PagedCase("prop", fmt, lens, next_n, page, h=2, d=32, lens_2d=lens_2d, extra_cols=extra, seed=seed)
    p = make_paged(case)
    out = paged_mqa_logits_ref(*p.args(), p.cols)
    check_oracle(out, paged_oracle(p, p.cols), case, "property")
    ks, ke = contiguous_bounds(p)
    assert torch.equal(out, mqa_logits_ref(p.q.flatten(0, 1), p.q_sf.flatten(0, 1), p.kv, p.kv_sf, p.w, ks, ke, p.cols))


# --------------------------------------------------------------------------------------- kernels

@pytest.fixture(scope="module")
def mqa():
    with sim.installed(("dsneuron.kernels_nki.mqa_logits_nki",)) as (module,):
        yield module


def _np(t: torch.Tensor) -> np.ndarray:
    """Kernel operand: one-byte data as uint8, bf16 through its bits, anything else as is."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.view(torch.uint8).numpy() if t.element_size() == 1 else t.numpy()


def _fmt(p: Paged) -> str:
    return "fp8" if p.q.dtype == torch.float8_e4m3fn else "fp4"


def _logits(out: np.ndarray, cols: int) -> torch.Tensor:
    assert out.shape[1] % 256 == 0 and out.shape[1] >= cols  # 512-byte rows
    return torch.from_numpy(np.ascontiguousarray(out).view(np.int16)).view(torch.bfloat16)[:, :cols]


def run_paged(mqa, p: Paged, cols: int) -> torch.Tensor:
    return _logits(mqa.paged_mqa_logits_kernel(*(_np(t) for t in p.args()), cols, _fmt(p)), cols)


def run_paged_sparse(mqa, p: Paged, blocks: torch.Tensor, bs: int) -> torch.Tensor:
    out = mqa.paged_mqa_logits_sparse_kernel(*(_np(t) for t in p.args()), blocks.numpy(), bs, _fmt(p))
    return _logits(out, blocks.shape[1] * bs)


def check_kernel(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """-inf where the reference has it; one bf16 step at most from it (the Tensor Engine's fp32 order)
    and equal almost everywhere."""
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), what
    finite = torch.isfinite(ref).numpy()
    dist = ulp_distance_bf16(out, ref.float().numpy())[finite]
    assert dist.max(initial=0) <= 1 and (dist == 0).mean() >= 0.999, what


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.id)
def test_kernel_matches_ref_and_oracle(mqa, case: PagedCase):
    """On poisoned tables and pages: a wild read would show as NaN or a stand-in error."""
    p = make_paged(case)
    cols = max(1, p.cols)
    out = run_paged(mqa, p, cols)
    check_kernel(out, paged_mqa_logits_ref(*p.args(), cols), case.id)
    check_oracle(out, paged_oracle(p, cols), case, case.id)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("case", [KERNEL_CASES[i] for i in (0, 3, 4)], ids=lambda c: c.id)
def test_sparse_kernel_matches_ref_and_oracle(mqa, case: PagedCase, block_size: int):
    """Hostile block lists (make_selected_blocks: INT_MIN, INT_MAX, 2^29 whose position wraps int32)."""
    p = make_paged(case)
    blocks = make_selected_blocks(p, 10, block_size, case.seed)
    out = run_paged_sparse(mqa, p, blocks, block_size)
    check_kernel(out, paged_mqa_logits_sparse_ref(*p.args(), blocks, block_size), case.id)
    check_oracle(out, paged_sparse_oracle(p, blocks, block_size), case, case.id)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("case", [KERNEL_CASES[2], KERNEL_CASES[3]], ids=lambda c: c.id)
def test_kernel_equals_the_contiguous_kernel_and_reads_no_slot_past_a_context(mqa, case: PagedCase, sparse: bool):
    """The paged kernels give the contiguous kernels' bits on the same keys, and their HBM reads are
    the contiguous kernels' minus one int32 broadcast per row (the context end replaces ks and ke)
    plus one int32 table slot per valid key: a table slot read past a context, or for a position no
    row sees, would add to that count. The poisoned and the clean table read the same bytes."""
    p, clean = make_paged(case), make_paged(case, poison=False)
    ks, ke = contiguous_bounds(p)
    flat = [_np(t) for t in (p.q.flatten(0, 1), p.q_sf.flatten(0, 1), p.kv, p.kv_sf, p.w, ks, ke)]
    if sparse:
        blocks = make_selected_blocks(p, 8, 16, 3)
        shifted = torch.where(blocks >= 0, blocks.long() + (ks.long() // 16)[:, None], -1).int()
        out = run_paged_sparse(mqa, p, blocks, 16)
        paged_kernel, contiguous_kernel = mqa.paged_mqa_logits_sparse_kernel, mqa.mqa_logits_sparse_kernel
        paged_read = paged_kernel.last_stats.hbm_read
        assert torch.equal(out, _logits(contiguous_kernel(*flat, shifted.numpy(), 16, _fmt(p)), 8 * 16))
        assert torch.equal(run_paged_sparse(mqa, clean, blocks, 16), out)
    else:
        out = run_paged(mqa, p, p.cols)
        paged_kernel, contiguous_kernel = mqa.paged_mqa_logits_kernel, mqa.mqa_logits_kernel
        paged_read = paged_kernel.last_stats.hbm_read
        assert torch.equal(out, _logits(contiguous_kernel(*flat, p.cols, _fmt(p)), p.cols))
        assert torch.equal(run_paged(mqa, clean, p.cols), out)
    assert paged_kernel.last_stats.hbm_read == paged_read  # the clean run
    valid = int(torch.isfinite(out.float()).sum())
    assert paged_read == contiguous_kernel.last_stats.hbm_read - ks.shape[0] * P_MAX * 4 + 4 * valid


def test_kernel_masks_what_the_reference_refuses(mqa):
    """Inputs the reference raises on: the kernel checks no values, it gives -inf there and reads
    nothing wild (a page id past the cache, a negative one, a context longer than the table: the
    positions past max_blocks * page would otherwise map into the next sequence's slots)."""
    p = make_paged(PagedCase("refused", "fp8", (40, 70), 1, 32, seed=10), poison=False)
    good = run_paged(mqa, p, p.cols)
    table = p.table.clone()
    table[0, 1], table[1, 0] = p.cache.shape[0], -1
    out = run_paged(mqa, replace(p, table=table), p.cols)
    want = good.clone()
    want[0, 32:], want[1, :32] = -torch.inf, -torch.inf
    assert torch.equal(out, want)
    # sequence 1's context of 101 overruns its 3 slots of 32: the reference on the 96 that fit
    lens, fits = (torch.tensor([40, n], dtype=torch.int32) for n in (101, 96))
    out = run_paged(mqa, replace(p, context_lens=lens, table=p.table[:, :3]), 110)
    check_kernel(out, paged_mqa_logits_ref(p.q, p.q_sf, p.cache, p.w, fits, p.table[:, :3], 110), "longer")
    assert torch.isfinite(out[1, :96].float()).all() and torch.isneginf(out[1, 96:]).all()


@pytest.mark.parametrize("change, match", [
    (lambda a: [a[0], a[1], a[2].reshape(a[2].shape[0] * 2, 16, 1, -1), *a[3:]], "power of two >= 32"),
    (lambda a: [a[0], a[1], a[2][:, :, :, :-1], *a[3:]], r"kv_cache must be \[pages, page, 1, 64\+2\]"),
    (lambda a: [*a[:4], a[4][:, None].repeat(3, axis=1), a[5]], "context_lens must be"),
    (lambda a: [*a[:5], a[5][0]], "block_table must be"),
    (lambda a: [*a[:5], a[5][:, :0]], "block_table must be"),
    (lambda a: [a[0], a[1][:, :1], *a[2:]], "q_sf must be"),
    (lambda a: [*a[:3], a[3][:1], *a[4:]], "weights"),
])
def test_kernel_refuses_shapes_it_cannot_run(mqa, change, match):
    p = make_paged(PagedCase("shapes", "fp8", (3, 40), 2, 32, seed=11))
    args = change([_np(t) for t in p.args()])
    with pytest.raises(ValueError, match=match):
        mqa.paged_mqa_logits_kernel(*args, p.cols, "fp8")
    with pytest.raises(ValueError, match="block_size must be one of"):
        mqa.paged_mqa_logits_sparse_kernel(*[_np(t) for t in p.args()], np.zeros((4, 1), np.int32), 12, "fp8")
