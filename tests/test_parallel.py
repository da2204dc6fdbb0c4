"""Tensor and expert parallelism on the cpu target (compiler/parallel.py): a rank's shard holds what
the plan's placement rule says, and two gloo processes (TP=2, EP=2) give one process's greedy
tokens with logits within a small fraction of their spread."""

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
        shard_model(golden.model, par, rank, Comm(1))
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
    """TP=2 with EP=2 over gloo: the same greedy token at the prefill and every decode step as the
    single process, and logits within 1e-3 of it in 1 - cosine."""
    max_len = load_config("micro")[1].max_seq_len
    ids = [(37 * i + 11) % 5000 + 100 for i in range(24)]
    one = [r.logits for r in micro_golden.teacher_forced(ids, 16)]
    run = run_sharded(micro_cfg, micro_checkpoint, max_len, Parallel(2, 2), ids, 16)
    assert len(run.logits) == len(one) == 9
    for a, b in zip(one, run.logits):
        assert int(a.argmax()) == int(b.argmax())
        assert 1 - torch.nn.functional.cosine_similarity(a, b, dim=0).item() < 1e-3
    # each process ran on its shard: under 60% of the model (attention, experts and vocabulary halved)
    full = held_bytes(micro_golden.model)
    assert len(run.held) == 2 and all(h < 0.6 * full for h in run.held), (run.held, full)


def test_plans_the_cpu_target_does_not_shard_are_refused(micro_cfg):
    with pytest.raises(UserError, match=r"split over tp/ep=2 ranks.*--ep 2"):
        check_shardable(micro_cfg, Parallel(2, 1))
    with pytest.raises(UserError, match=r"--tp 4: must divide model.o_groups=2"):
        check_shardable(micro_cfg, Parallel(4, 4))
