"""runtime_min/core/runner.py: the one decode primitive over rows at their positions, and the row operations.

On the compiled stand-in bundle (tests/stand_in.py: batch bucket 2, prefill 8, capacities 8 and
16): it has two rows, engram ids and a state tensor of each kind (sized by the capacity, or not).
The micro bundle of tests/conftest.py has batch 1 only, so it cannot put two rows in one call.
"""

from __future__ import annotations

import pytest
import torch

import stand_in
from dsneuron.runtime_min.core.runner import Executable, Runner, State

A = [1, 104, 105]  # 3 tokens: decodes at position 3
B = [1, 120, 121, 122, 123, 124]  # 6 tokens: decodes at position 6; both within capacity 8


@pytest.fixture(scope="module")
def runner():
    return Runner.load(stand_in.shared_bundle()[0])


def rows(runner: Runner, *prompts: list[int]) -> State:
    """Each prompt's prefill alone, its row 0 placed in row i of a 2-row state."""
    state = State()
    for i, ids in enumerate(prompts):
        state = runner.place_row(state, i, runner.prefill([ids]).state, 2)
    return state


def decode(runner: Runner, state: State, fed: list[tuple[int, int]]) -> tuple[torch.Tensor, State]:
    """One decode of (token, position) per row, filler rows (pad at position 0) after them."""
    tokens = torch.full((2,), runner.pad_token_id, dtype=torch.int64)
    pos = torch.zeros(2, dtype=torch.int64)
    for i, (t, p) in enumerate(fed):
        tokens[i], pos[i] = t, p
    step = runner.decode(tokens, pos, state)
    assert step.bucket.kind == "decode" and step.bucket.capacity == 8 and step.logits.shape == (2, runner.vocab_size)
    return step.logits, step.state


def test_two_rows_at_different_positions_equal_each_row_alone_bit_for_bit(runner):
    """Rows at positions 3 and 6 in one call, three steps: each row's logits, state and engram
    history are those it gets alone in row 0 (B moves from row 1 to row 0), bit for bit."""
    both = rows(runner, A, B)
    alone = [rows(runner, A), rows(runner, B)]
    feeds = [[(7, 3), (9, 6)], [(11, 4), (13, 7)]]
    for step, fed in enumerate(feeds):
        logits, both = decode(runner, both, fed)
        for i in range(2):
            want, alone[i] = decode(runner, alone[i], [fed[i]])
            assert torch.equal(logits[i], want[0]), (step, i)
            assert torch.equal(both.history[i], alone[i].history[0]), (step, i)
            for name, t in both.tensors.items():
                assert torch.equal(t[i], alone[i].tensors[name][0]), (step, i, name)
    assert not torch.equal(logits[0], logits[1])  # the rows do differ: the comparison can tell them apart


def test_decode_starts_missing_state_fresh_and_refuses_bad_calls(runner):
    fresh = runner.fresh_state(2)
    assert fresh.tensors == {} and torch.equal(fresh.history, runner.hasher.initial_history(2))
    tokens, pos = torch.tensor([5, 6]), torch.tensor([0, 0])
    step = runner.decode(tokens, pos, fresh)
    assert set(step.state_in) == set(step.state.tensors) == {s.name for s in runner.manifest.state}
    assert all(torch.equal(t, torch.full_like(t, runner.fills[n].fill)) for n, t in step.state_in.items())
    with pytest.raises(ValueError, match=r"no decode bucket of batch 3; the bundle's decode batches: \[2\]"):
        runner.decode(torch.tensor([5, 6, 7]), torch.tensor([0, 0, 0]), runner.fresh_state(3))
    with pytest.raises(ValueError, match="needs its history"):
        runner.decode(tokens, pos, State())


def test_row_operations(runner):
    a, b = runner.prefill([A]).state, runner.prefill([B]).state
    two = runner.place_row(runner.place_row(State(), 0, a, 2), 1, b, 2)
    one = runner.fit_rows(two, 1)
    assert all(t.shape[0] == 1 for t in one.tensors.values()) and one.history.shape[0] == 1
    runner.move_row(two, 0, 1)  # row 1 takes the freed row 0
    for name, t in two.tensors.items():
        assert torch.equal(t[0], b.tensors[name][0]), name
    assert torch.equal(two.history[0], b.history[0])
    grown = runner.fit_rows(one, 2)
    for name, t in grown.tensors.items():
        assert torch.equal(t[1], torch.full_like(t[1], runner.fills[name].fill)), name


def test_loaded_executables_are_executables(runner):
    runner.prefill([A])
    exe = runner.executable("prefill", 2, 8)
    assert isinstance(exe, Executable) and exe.bucket is runner.bucket("prefill", 2, 8)
    with pytest.raises(ValueError, match=r"no decode bucket of batch 2 and length 12; .* \[\(2, 8\), \(2, 16\)\]"):
        runner.executable("decode", 2, 12)


def test_a_prompt_within_a_prefill_bucket_is_one_call(runner):
    job = runner.prefill_job(B)
    assert job.step() and torch.equal(job.result.logits, runner.prefill([B]).logits)
