"""Blockwise routing of a static-shape MoE: (token, expert) pairs grouped by expert into blocks.

An exported step cannot size a tensor by how many tokens chose an expert, so it needs a layout
whose shape depends only on the call's token count. Running every expert on every token (weight 0
where not routed) is such a layout and costs E/k times the routed work (64x on V4.1-Flash, 384
experts, 6 activated). The blockwise layout (NxDI's blockwise MoE, from
aws-neuron/neuronx-distributed: src/neuronx_distributed/modules/moe/blockwise.py, whose NKI kernel
takes one expert per block; vLLM's fused MoE aligns tokens to blocks the same way,
vllm-project/vllm: moe_align_block_size) instead sorts the N*k pairs by expert and cuts each
expert's run into blocks of `block` pairs, the last one padded; every block is one expert's GEMM
on `block` rows. How many blocks a call can need is bounded by its pair count alone: with m
= min(E, pairs) experts in use, sum_e ceil(n_e / block) <= m + (pairs - m) // block (each expert
in use adds at most one partly-filled block), so `n_blocks` blocks always suffice and the graph
computes n_blocks * block expert rows, whatever the routing. Pad slots (and blocks no expert
needs) take a zero row with routing weight 0, whose output is exactly 0.

`block_size` picks the largest power of two up to MAX_BLOCK whose worst-case padding keeps the
computed rows within PAD_LIMIT times the routed pairs (1 when nothing larger does: one pair a
block, the gather of the decode step's layout). Where every expert on every token computes no more
rows (few experts, most of them activated: an expert-parallel rank's share), that layout stays
(`use_blocks`): it gathers no weights.

A graph materialises what it gathers: each block's expert weights, dequantised. The blocks
therefore run in groups of at most E (`block_groups`), so that no more expert copies are live at a
time than the every-expert layout held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the computed expert rows may be at most this multiple of the routed pairs (issue: plan's
#: prefill and chunk FLOPs within 1.25x the routed expert work)
PAD_LIMIT = 1.25
#: the largest block: one 128-row tile of Trainium's PE array (NxDI's blockwise kernels tile by 128)
MAX_BLOCK = 128


def n_blocks(pairs: int, n_experts: int, block: int) -> int:
    """The most blocks `pairs` (token, expert) pairs over `n_experts` experts can need (module
    docstring). Raises ValueError for pairs < 1, n_experts < 1 or block < 1."""
    if pairs < 1 or n_experts < 1 or block < 1:
        raise ValueError(f"n_blocks: need pairs, n_experts and block >= 1, got {pairs}, {n_experts}, {block}")
    m = min(n_experts, pairs)
    return m + (pairs - m) // block


def block_size(pairs: int, n_experts: int) -> int:
    """The block size (a power of two, 1..MAX_BLOCK) of a call routing `pairs` pairs over
    `n_experts` experts: the largest whose n_blocks * block <= PAD_LIMIT * pairs."""
    best = 1
    b = 2
    while b <= MAX_BLOCK and n_blocks(pairs, n_experts, b) * b <= PAD_LIMIT * pairs:
        best, b = b, 2 * b
    return best


def use_blocks(tokens: int, topk: int, n_experts: int) -> bool:
    """Whether a call of `tokens` tokens with `topk` of `n_experts` experts each runs blockwise: it
    routes at least as many pairs as there are experts (fewer: each pair gathers its expert) and
    its blocks compute fewer rows than every expert on every token."""
    pairs = tokens * topk
    if pairs < n_experts:
        return False
    block = block_size(pairs, n_experts)
    return n_blocks(pairs, n_experts, block) * block < n_experts * tokens


def block_groups(n_blocks_: int, n_experts: int) -> list[range]:
    """The blocks 0..n_blocks_-1 in consecutive groups of at most n_experts (module docstring)."""
    return [range(g, min(g + n_experts, n_blocks_)) for g in range(0, n_blocks_, n_experts)]


@dataclass(frozen=True)
class BlockRouting:
    """Where each routed pair goes, for a call of N tokens with k experts each (pairs P = N * k in
    token-major order: pair p is token p // k's slot p % k).

    slot_token: int64 [NB * block]: the token each slot reads, N (a zero row) for a pad slot;
    slot_weight: fp32 [NB * block]: the pair's routing weight, 0 for a pad slot;
    block_expert: int64 [NB]: the expert of each block (E - 1 for a block nothing fills);
    pair_slot: int64 [P]: the slot that computed each pair."""

    slot_token: torch.Tensor
    slot_weight: torch.Tensor
    block_expert: torch.Tensor
    pair_slot: torch.Tensor
    block: int


def route_blocks(indices: torch.Tensor, weights: torch.Tensor, n_experts: int) -> BlockRouting:
    """The blockwise layout of one call: indices int64 [N, k] (each token's experts), weights fp32
    [N, k]. Static shapes only (sort, compare-and-sum, gather, scatter), so it exports and lowers
    to StableHLO. Within an expert, pairs keep token-major order."""
    N, k = indices.shape
    P = N * k
    block = block_size(P, n_experts)
    NB = n_blocks(P, n_experts, block)
    flat_e = indices.reshape(-1)
    arange_p = torch.arange(P, device=indices.device)
    # a unique key makes any sort stable: by expert, then pair order
    order = torch.sort(flat_e * P + arange_p).indices  # [P] pair at each sorted position
    sorted_e = flat_e[order]
    experts = torch.arange(n_experts, device=indices.device)
    counts = (flat_e[:, None] == experts[None, :]).sum(0)  # [E] pairs per expert
    blocks = (counts + block - 1) // block
    # exclusive prefix sums over E by a compare-and-sum (E is small; no cumsum lowering needed)
    before = (experts[None, :] < experts[:, None]).to(torch.int64)  # [E, E]: e' < e
    pair_start = (before * counts[None, :]).sum(1)
    block_start = (before * blocks[None, :]).sum(1)
    block_end = block_start + blocks
    slot_sorted = block_start[sorted_e] * block + (torch.arange(P, device=indices.device) - pair_start[sorted_e])
    pair_slot = torch.zeros_like(order).scatter(0, order, slot_sorted)
    slot_pair = torch.full((NB * block,), P, dtype=torch.int64, device=indices.device).scatter(0, slot_sorted, order)
    slot_token = torch.where(slot_pair < P, slot_pair // k, N)
    slot_weight = torch.cat([weights.reshape(-1).float(), weights.new_zeros(1, dtype=torch.float32)])[slot_pair]
    block_ids = torch.arange(NB, device=indices.device)
    block_expert = (block_ids[:, None] >= block_end[None, :]).sum(1).clamp(max=n_experts - 1)
    return BlockRouting(slot_token, slot_weight, block_expert, pair_slot, block)
