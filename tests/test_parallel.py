"""Tensor and expert parallelism on the cpu target (compiler/parallel.py): a rank's shard holds what
the plan's placement rule says, two gloo processes (TP=2, EP=2) give one process's logits bit for
bit, and the chained sum is one process's order of adds."""

from __future__ import annotations

import pytest
import torch

from dsneuron import UserError
from dsneuron.compiler.config import load_config
from dsneuron.compiler.parallel import Comm, check_shardable, held_bytes, run_sharded, shard_model
from dsneuron.compiler.plan import EXPERTS, TP, VOCAB, Parallel, placement
from dsneuron.graphs.golden import Golden


def _numels(model) -> dict[str, int]:
    return {n.replace("head.head.", "head."): p.numel() for n, p in model.named_parameters()}


def test_a_shard_holds_what_the_plans_placement_says(micro_cfg, micro_checkpoint):
    """Tensor by tensor, rank r of TP=2 / EP=2 keeps: all of a replicated (or host) tensor, half of
    a TP one, all or nothing of an expert (its EP group's experts), and its vocabulary rows of the
    embedding and head, as compiler/plan.py `placement` (which `dsneuron plan` counts) says."""
    max_len = load_config("micro")[1].max_seq_len
    par = Parallel(2, 2)
    per = -(-micro_cfg.vocab_size // 2)
    for rank in range(2):
        golden = Golden(micro_cfg, micro_checkpoint, max_len)
        before = _numels(golden.model)
        shard_model(golden.model, par, rank, Comm(rank, 1))
        after = _numels(golden.model)
        for name, n in before.items():
            where, got = placement(micro_cfg, par, name), after.get(name, 0)
            if where == EXPERTS:
                mine = int(name.split(".")[4]) // (micro_cfg.n_routed_experts // 2) == rank
                assert got == (n if mine else 0), name
            elif where == TP:
                assert got == n // 2, name
            elif where == VOCAB:
                rows = min(per, micro_cfg.vocab_size - rank * per) if name == "embed.weight" else per
                assert got == n // micro_cfg.vocab_size * rows, name
            else:
                assert got == n, name
        assert sum(after.values()) < 0.6 * sum(before.values())


def test_two_ranks_give_one_process_tokens(micro_cfg, micro_checkpoint, micro_golden):
    """TP=2 with EP=2 over gloo: the prefill's and every decode step's logits are the single
    process's bit for bit (the ranks chain their partial sums in one process's order)."""
    max_len = load_config("micro")[1].max_seq_len
    ids = [(37 * i + 11) % 5000 + 100 for i in range(24)]
    one = [r.logits for r in micro_golden.teacher_forced(ids, 16)]
    run = run_sharded(micro_cfg, micro_checkpoint, max_len, Parallel(2, 2), ids, 16)
    assert len(run.logits) == len(one) == 9
    for a, b in zip(one, run.logits):
        assert torch.equal(a, b), (a - b).abs().max().item()
    # each process ran on its shard: under 60% of the model (attention, experts and vocabulary halved)
    full = held_bytes(micro_golden.model)
    assert len(run.held) == 2 and all(h < 0.6 * full for h in run.held), (run.held, full)


def test_plans_the_cpu_target_does_not_shard_are_refused(micro_cfg):
    with pytest.raises(UserError, match=r"split over tp/ep=2 ranks.*--ep 2"):
        check_shardable(micro_cfg, Parallel(2, 1))
    with pytest.raises(UserError, match=r"--tp 4: must divide model.o_groups=2"):
        check_shardable(micro_cfg, Parallel(4, 4))


def test_a_row_parallel_sum_continued_from_the_previous_ranks_is_one_processes(micro_golden):
    """quant.block_partials split at any block and added in turn (what Comm.chain runs across ranks)
    gives block_scaled_matmul bit for bit; bad operands are refused."""
    from dsneuron.graphs import quant as Q

    g = torch.Generator().manual_seed(4)
    a = Q.fp8_activation(torch.randn(3, 5, 128, generator=g).bfloat16())
    w = micro_golden.model.layers[0].attn.wo_b.dequantized()  # [256, 128]
    want = Q.block_scaled_matmul(a, w)
    parts = Q.block_partials(a, w)
    assert parts.shape == (4, 3, 5, w.shape[0])
    for cut in (1, 2, 3):
        first = Q.add_blocks(torch.zeros_like(want), parts[:cut])
        assert torch.equal(Q.add_blocks(first, parts[cut:]), want)
    with pytest.raises(ValueError, match="block_partials: need a fp32"):
        Q.block_partials(a.bfloat16(), w)


def test_a_rank_outside_the_world_is_refused(micro_cfg, micro_golden):
    with pytest.raises(ValueError, match=r"rank must be in 0..1, got 2"):
        shard_model(micro_golden.model, Parallel(2, 2), 2, Comm(2, 2))
