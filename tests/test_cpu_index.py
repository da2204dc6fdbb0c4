"""The cpu target's indexer-score op (kernels_nki/cpu_index.py) against the golden's expression:
bit for bit on FP4-QDQ'd operands, independent of batch, threads and the cache slice, bad arguments
named."""

from __future__ import annotations

import pytest
import torch

from dsneuron.graphs.dispatch import fp4_qdq
from dsneuron.graphs.quant import INDEX_K_FORMAT, quantize_state
from dsneuron.kernels_nki import cpu_index


def operands(B: int, S: int, H: int, T: int, D: int = 128, seed: int = 0, spread: float = 1.0):
    """FP4-QDQ'd queries, index-key cache rows and head weights as the model makes them; `spread`
    scales some 32-blocks of q and k by large powers of two (wide UE8M0 scale ranges)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g)
    k = torch.randn(B, T, D, generator=g)
    if spread != 1.0:
        q[..., :32] *= spread
        k[..., 64:96] /= spread
    q = fp4_qdq(q.bfloat16(), 32, "ue8m0")
    index_k = quantize_state(k.bfloat16(), INDEX_K_FORMAT)
    w = torch.randn(B, S, H, generator=g).bfloat16()
    return q, index_k, w


@pytest.mark.parametrize("B,S,H,T,D", [(1, 1, 4, 1024, 128), (4, 1, 4, 37, 128), (1, 23, 4, 23, 128),
                                       (2, 5, 64, 17, 128), (1, 3, 2, 16, 64), (2, 2, 3, 0, 32)])
def test_index_scores_equal_the_golden_bit_for_bit(B, S, H, T, D):
    q, index_k, w = operands(B, S, H, T, D)
    got = cpu_index.index_scores(q, index_k, w)
    assert got.dtype == torch.bfloat16 and got.shape == (B, S, T)
    assert torch.equal(got.view(torch.int16), cpu_index.index_scores_ref(q, index_k, w).view(torch.int16))


def test_index_scores_exact_across_wide_scale_ranges():
    # q's first block 2^20 larger, k's third 2^20 smaller: the float64 sums stay exact, so the
    # golden's GEMM and the op's chain agree whatever the order
    q, index_k, w = operands(2, 4, 4, 40, spread=2.0 ** 20, seed=3)
    assert torch.equal(cpu_index.index_scores(q, index_k, w).view(torch.int16),
                       cpu_index.index_scores_ref(q, index_k, w).view(torch.int16))


def test_index_scores_read_a_leading_slice_of_the_cache_and_do_not_depend_on_the_batch():
    q, cache, w = operands(3, 2, 4, 64, seed=1)
    T = 29  # the decode graph reads leading(cache, T): rows of a larger cache, not contiguous per batch
    sliced = cache[:, :T]
    assert not sliced.is_contiguous()
    whole = cpu_index.index_scores(q, sliced, w)
    assert torch.equal(whole, cpu_index.index_scores(q, sliced.contiguous(), w))
    for b in range(3):  # a row alone gives its batch row's bits
        assert torch.equal(whole[b:b + 1], cpu_index.index_scores(q[b:b + 1], cache[b:b + 1, :T], w[b:b + 1]))


def test_index_scores_do_not_depend_on_the_thread_count():
    q, index_k, w = operands(2, 7, 4, 300, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_index.index_scores(q, index_k, w)
        torch.set_num_threads(max(2, threads))
        many = cpu_index.index_scores(q, index_k, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_index_scores_refuse_bad_arguments_by_name():
    q, index_k, w = operands(1, 2, 4, 8)
    bad = [((q.float(), index_k, w), "q must be bf16"),
           ((q[..., :40], index_k, w), "multiple of 32"),
           ((q, index_k[..., :-1], w), "index_k must be uint8"),
           ((q, index_k.view(torch.int8), w), "index_k must be uint8"),
           ((q, index_k, w[:, :1]), "w must be bf16")]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            cpu_index.index_scores(*args)
        with pytest.raises(ValueError, match=msg):
            cpu_index.check_args(*args)
    with pytest.raises(ValueError, match=r"got Byte \[1, 8, 67\]"):  # the C++ op names the shape it got
        cpu_index.index_scores(q, index_k[..., :-1], w)
    fake = torch._subclasses.FakeTensorMode()
    with fake:
        out = torch.ops.dsneuron.index_scores(torch.empty(2, 3, 4, 128, dtype=torch.bfloat16),
                                              torch.empty(2, 9, 68, dtype=torch.uint8),
                                              torch.empty(2, 3, 4, dtype=torch.bfloat16))
    assert out.shape == (2, 3, 9) and out.dtype == torch.bfloat16


def test_index_scores_equal_on_the_portable_build(portable_ops):
    # the same float64 chains whatever the vector width: the AVX2 and the portable layer agree
    q, index_k, w = operands(2, 3, 4, 45, seed=4)
    assert torch.equal(portable_ops.index_scores(q, index_k, w).view(torch.int16),
                       cpu_index.index_scores(q, index_k, w).view(torch.int16))
