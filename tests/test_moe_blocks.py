"""The blockwise MoE layout (graphs/moe_blocks.py) and the exported MoE that runs on it
(graphs/model.py MoE._blockwise): its bound holds for any routing, every pair lands in one slot of
a block of its expert, and the MoE's output is the routed loop's bit for bit, with skewed
routings included (every token on the same experts: the most padding)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsneuron.graphs.moe_blocks import MAX_BLOCK, PAD_LIMIT, block_groups, block_size, n_blocks, route_blocks, use_blocks
from dsneuron.graphs.numerics import gemm_order


@given(st.lists(st.integers(0, 300), min_size=1, max_size=40), st.integers(0, 7))
def test_n_blocks_bounds_every_routing(counts, log_block):
    """However P pairs fall on E experts, sum ceil(n_e / block) <= n_blocks(P, E, block)."""
    block = 2 ** log_block
    pairs = sum(counts)
    if pairs == 0:
        return
    need = sum(math.ceil(c / block) for c in counts)
    assert need <= n_blocks(pairs, len(counts), block)


@given(st.integers(1, 200_000), st.integers(1, 512))
def test_block_size_keeps_the_padding_within_the_limit(pairs, experts):
    b = block_size(pairs, experts)
    assert 1 <= b <= MAX_BLOCK and b & (b - 1) == 0
    assert b == 1 or n_blocks(pairs, experts, b) * b <= PAD_LIMIT * pairs
    assert b == MAX_BLOCK or n_blocks(pairs, experts, 2 * b) * 2 * b > PAD_LIMIT * pairs


def test_block_size_on_v4_1_flash():
    """V4.1-Flash (384 experts, 6 a token): its prefill buckets of 1024 / 4096 / 16384 tokens get
    blocks of 4 / 16 / 64 pairs, within 1.25x the routed rows (the dense layout was 64x); an
    expert-parallel rank with 6 experts, all activated, keeps every expert on every token."""
    for tokens, want in ((1024, 4), (4096, 16), (16384, 64)):
        pairs = tokens * 6
        assert use_blocks(tokens, 6, 384) and block_size(pairs, 384) == want
        assert n_blocks(pairs, 384, want) * want <= 1.25 * pairs
    assert not use_blocks(16384, 6, 6)
    assert not use_blocks(10, 6, 384)  # 60 pairs < 384 experts: each pair gathers its expert


def test_block_groups_cover_the_blocks_in_order_at_most_e_at_a_time():
    for nb, e in ((1, 8), (8, 8), (20, 8), (1914, 384)):
        groups = block_groups(nb, e)
        assert [b for g in groups for b in g] == list(range(nb)) and max(len(g) for g in groups) <= e


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 4), st.integers(2, 12), st.integers(0, 2**31 - 1), st.booleans())
def test_route_blocks_places_every_pair_once_in_a_block_of_its_expert(N, k, E, seed, skewed):
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    if skewed:  # every token on experts 0..k-1: one expert's run fills many blocks
        indices = torch.arange(k).repeat(N, 1)
    else:
        indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g) + 0.1
    r = route_blocks(indices, weights, E)
    P = N * k
    NB = n_blocks(P, E, r.block)
    assert r.slot_token.shape == r.slot_weight.shape == (NB * r.block,) and r.block_expert.shape == (NB,)
    assert r.pair_slot.unique().numel() == P  # distinct slots
    tok = torch.arange(P) // k
    assert torch.equal(r.slot_token[r.pair_slot], tok)
    assert torch.equal(r.slot_weight[r.pair_slot], weights.reshape(-1))
    assert torch.equal(r.block_expert[r.pair_slot // r.block], indices.reshape(-1))
    pad = torch.ones(NB * r.block, dtype=torch.bool)
    pad[r.pair_slot] = False
    assert torch.all(r.slot_token[pad] == N) and torch.all(r.slot_weight[pad] == 0)


@pytest.fixture(scope="module")
def moe(micro_golden):
    return micro_golden.model.layers[1].ffn


@pytest.mark.parametrize("tokens", [4, 37, 64])
@pytest.mark.parametrize("skewed", [False, True])
def test_blockwise_moe_is_the_routed_loop_bit_for_bit(moe, tokens, skewed):
    """The exported MoE (routed=False, GEMM order ascending: row-independent exact partials) at a
    prefill's token count equals the routed loop bit for bit; skewed: a gate bias routes every
    token to the same experts."""
    assert use_blocks(tokens, moe.gate.topk, moe.n_experts)  # the blockwise branch
    x = torch.randn(1, tokens, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(tokens)).bfloat16()
    bias = moe.gate.bias.data.clone()
    try:
        if skewed:
            moe.gate.bias.data[: moe.gate.topk] += 1e4
        with gemm_order("ascending"):
            assert torch.equal(moe(x, routed=False), moe(x, routed=True))
    finally:
        moe.gate.bias.data = bias


def test_blockwise_moe_computes_within_the_pad_limit(moe):
    """The expert GEMMs the exported MoE runs on 64 tokens (counted by torch's FlopCounterMode, in
    GEMM order ascending, which has the products of "fused" without the zero rows it pads a GEMM of
    fewer than 8 rows with): at most PAD_LIMIT x the routed pairs' rows, where every expert on
    every token was E / k x."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(1, 64, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()

    def expert_flops(routed: bool) -> int:
        fc = FlopCounterMode(display=False)
        with fc, gemm_order("ascending"):
            moe(x, routed=routed)
        shared = FlopCounterMode(display=False)
        with shared, gemm_order("ascending"):
            moe.shared_experts(x.reshape(64, -1))
        gate = 2 * 64 * moe.gate.weight.numel()
        return fc.get_total_flops() - shared.get_total_flops() - gate

    routed, blockwise = expert_flops(True), expert_flops(False)
    assert routed > 0 and routed <= blockwise <= PAD_LIMIT * routed
