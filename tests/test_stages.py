"""The staged steps (graphs/stages.py) against the single-graph steps (graphs/steps.py) on micro:
running the stages in order must give the same logits and state bit for bit, and stages of one
kind must trace to one graph."""

from __future__ import annotations

import pytest
import torch

from dsneuron.graphs import stages as st
from dsneuron.graphs.steps import decode, prefill
from dsneuron.runtime_min.bundle.schema import engram_columns


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128000, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("L", [5, 16, 23])
def test_staged_prefill_and_decode_equal_the_steps(micro_golden, L):
    g = micro_golden
    m = g.model
    ids = _tokens(L + 2, L)
    eng = g.engram_ids(ids)
    logits, state = prefill(m, ids[:, :L], torch.tensor([L]), eng[:, :L])
    env = st.run_stages(st.build_stages(m, "prefill", 1, m.max_seq_len),
                        {"tokens": ids[:, :L], "valid_len": torch.tensor([L]), **engram_columns(eng[:, :L])})
    assert torch.equal(env["logits"], logits)
    for name, t in state.items():
        assert torch.equal(env[name].nan_to_num(), t.nan_to_num()), name
    for p in (L, L + 1):
        logits, state = decode(m, ids[:, p:p + 1], torch.tensor([p]), eng[:, p:p + 1], state)
        env = st.run_stages(st.build_stages(m, "decode", 1, m.max_seq_len),
                            {**{n: env[n] for n in state}, "tokens": ids[:, p:p + 1], "pos": torch.tensor([p]),
                             **engram_columns(eng[:, p:p + 1])})
        assert torch.equal(env["logits"], logits), p
        for name, t in state.items():
            assert torch.equal(env[name].nan_to_num(), t.nan_to_num()), (p, name)


def test_layer_kinds_name_the_distinct_structures(micro_cfg):
    from dsneuron.compiler.config import load_config

    kinds = [st.attn_kind(micro_cfg, L) for L in range(micro_cfg.n_layers)]
    assert kinds == ["attn_r0", "attn_r2_kv_index", "attn_r2", "attn_r1_kv_index_candsrc", "attn_r1",
                     "attn_r1_index_candfilter"]
    assert {st.ffn_kind(micro_cfg, L) for L in range(micro_cfg.n_layers)} == {
        f"ffn_e{micro_cfg.n_routed_experts}_k{micro_cfg.n_activated_experts}"}
    tiny = load_config("tiny")[0]
    assert len({st.attn_kind(tiny, L) for L in range(tiny.n_layers)}) == 6
    assert len({st.ffn_kind(tiny, L) for L in range(tiny.n_layers)}) == 1


def test_each_half_holds_only_its_own_weights(micro_golden):
    """A layer's attention stage and MoE stage together hold exactly the block's parameters (the
    engram aside), with no parameter in both: each weight is bound to one executable."""
    m = micro_golden.model
    stages = {s.name: s for s in st.build_stages(m, "decode", 1, m.max_seq_len)}
    for L, block in enumerate(m.layers):
        attn = {id(p) for p in stages[f"layers.{L}.attn"].module.parameters()}
        ffn = {id(p) for p in stages[f"layers.{L}.ffn"].module.parameters()}
        whole = {id(p) for n, p in block.named_parameters() if not n.startswith("engram.")}
        assert not attn & ffn and attn | ffn == whole, L


def test_staged_probes_are_the_step_captures(micro_golden):
    """With probes on, the stages return every stage tensor the single-graph prefill captures,
    under the same names and bit for bit (a probe bundle's compare tables rely on them)."""
    from dsneuron.graphs.context import Capture

    g, L = micro_golden, 9
    m = g.model
    ids = _tokens(L, 3)
    eng = g.engram_ids(ids)
    cap = Capture()
    prefill(m, ids, torch.tensor([L]), eng, cap)
    stages = st.with_probes(st.build_stages(m, "prefill", 1, m.max_seq_len))
    env = {"tokens": ids, "valid_len": torch.tensor([L]), **engram_columns(eng)}
    st.trace_stages(stages, env)
    out = st.run_stages(stages, env)
    probes = {n[len("probe."):]: t for n, t in out.items() if n.startswith("probe.")}
    assert probes.keys() == cap.tensors.keys()
    for name, t in cap.tensors.items():
        assert torch.equal(probes[name].nan_to_num(), t.nan_to_num()), name


def test_staged_verify_is_the_chunk_with_the_head_at_every_position(micro_golden):
    """build_stages(.., "verify"): the chunk's stages with the head at every position (kind
    head_all, no "last"): its logits are verify_chunk's at every position and each equals the
    one-position head's there, its state the chunk's, bit for bit."""
    from dsneuron.graphs.steps import verify_chunk

    g = micro_golden
    m = g.model
    ids = _tokens(14, 3)
    eng = g.engram_ids(ids)
    _, state = prefill(m, ids[:, :9], torch.tensor([9]), eng[:, :9])
    S, pos, count = 5, torch.tensor([9]), torch.tensor([5])
    logits, _, want = verify_chunk(m, ids[:, 9:], pos, count, eng[:, 9:], state)
    stages = st.build_stages(m, "verify", 1, m.max_seq_len)
    chunk = st.build_stages(m, "chunk", 1, m.max_seq_len)
    assert [(s.name, s.kind) for s in stages[:-1]] == [(s.name, s.kind) for s in chunk[:-1]]
    assert (stages[-1].name, stages[-1].kind, stages[-1].inputs) == ("head", "head_all", ("h", "pre_mix"))
    env = st.run_stages(stages, {**state, "tokens": ids[:, 9:], "pos": pos, "valid_len": count,
                                 **engram_columns(eng[:, 9:])})
    assert env["logits"].shape == (1, S, logits.size(-1)) and torch.equal(env["logits"], logits)
    for name, t in want.items():
        assert torch.equal(env[name].nan_to_num(), t.nan_to_num()), name
    one = chunk[-1].module
    for j in range(S):
        assert torch.equal(one(env["h"], env["pre_mix"], torch.tensor([j]))[0], env["logits"][:, j]), j
