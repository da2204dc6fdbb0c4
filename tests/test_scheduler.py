"""runtime_min/core/scheduler.py: continuous batching gives each request the output it gets alone.

Default suite: the compiled stand-in bundle (tests/stand_in.py: batch bucket 2, capacities 8 and
16), so rows join, leave and move while others decode. `-m slow`: the real model (micro) with
batch buckets 1 and 2, whose cpu kernels keep a row's numbers independent of the batch size.
"""

from __future__ import annotations

import dataclasses

import pytest

import stand_in
from dsneuron import UserError
from dsneuron.runtime_min.core.scheduler import QueueFull, Request, RequestError, Scheduler
from dsneuron.runtime_min.session import Session

PROMPTS = ["hi", "h\u00e9llo", "abc", "xyzw", "q", "tok"]  # 3..7 tokens with BOS (byte tokenizer)
NEW = [9, 4, 12, 6, 13, 2]  # each within capacity 16


@pytest.fixture(scope="module")
def bundle():
    return stand_in.shared_bundle()


@pytest.fixture(scope="module")
def session(bundle):
    return Session.load(bundle[0])


@pytest.fixture(scope="module")
def alone(session):
    """Each prompt's greedy ids when it is the only request."""
    return [session.generate_ids([p], n)[0] for p, n in zip(PROMPTS, NEW)]


def staggered(session, requests, steps_between: int = 1, scheduler=None):
    """Submit the requests one after another with decode steps in between, then run to the end."""
    s = scheduler or Scheduler(session.runner, session.decode)
    for r in requests:
        s.submit(r)
        for _ in range(steps_between):
            s.step()
    s.run()
    return s


@pytest.mark.parametrize("steps_between", [0, 1, 3])
def test_staggered_requests_give_their_alone_tokens_bit_for_bit(session, bundle, alone, steps_between):
    """Six requests on two rows: requests wait, join rows mid-generation, end at different
    steps, and the last row moves into a freed one; each one's ids are those it gets alone and the
    float64 oracle's (up to an EOS)."""
    _, kit = bundle
    reqs = [Request(session.encode(p), n) for p, n in zip(PROMPTS, NEW)]
    staggered(session, reqs, steps_between)
    for r, want, p, n in zip(reqs, alone, PROMPTS, NEW):
        assert r.generated == want, p
        oracle = kit.greedy(session.encode(p), n)
        assert r.generated == oracle[:len(r.generated)]
        assert r.finish_reason == ("length" if len(r.generated) == n else "stop")
        assert r.text == session.decode(r.generated)


def test_session_generate_takes_more_prompts_than_the_largest_batch(session, alone):
    """The batch bucket of the stand-in holds 2 rows; 6 prompts run through the scheduler, output
    in prompt order, each as alone."""
    each = [session.generate_ids([p], 8)[0] for p in PROMPTS]
    got = session.generate_ids(PROMPTS, 8)
    assert got == each
    assert [g[:min(n, 8)] for g, n in zip(got, NEW)] == [a[:min(n, 8)] for a, n in zip(alone, NEW)]
    stats = session.last_stats
    assert stats.rows == len(PROMPTS) and stats.decode_tokens == sum(len(g) for g in got) - len(PROMPTS)


def test_seeded_sampling_is_the_same_batched_and_alone(session):
    kw = {"temperature": 1.3, "top_p": 0.9}
    alone = [session.generate_ids([p], 8, seed=11 + i, **kw)[0] for i, p in enumerate(PROMPTS[:4])]
    reqs = [Request(session.encode(p), 8, seed=11 + i, **kw) for i, p in enumerate(PROMPTS[:4])]
    staggered(session, reqs)
    assert [r.generated for r in reqs] == alone


def test_stop_string_cuts_the_text_and_frees_the_row(session, alone):
    """The stop string is taken from the middle of the request's own greedy text: the text ends
    before it, the streamed pieces add up to that text, and the other request is unchanged."""
    full = session.decode(alone[2])
    stop = full[3:5]
    assert stop and full.find(stop) >= 0
    pieces = []
    r = Request(session.encode(PROMPTS[2]), NEW[2], stop=[stop, "\x00never"], listener=lambda _r, p: pieces.append(p))
    other = Request(session.encode(PROMPTS[0]), NEW[0])
    staggered(session, [r, other])
    assert r.text == full[:full.find(stop)] and r.finish_reason == "stop"
    assert "".join(pieces) == r.text
    assert other.generated == alone[0]


def test_cancel_frees_the_row_and_leaves_the_others_alone(session, alone):
    picked = [0, 2, 4]  # 9, 12 and 13 new tokens: none ends by itself in the first steps
    reqs = [Request(session.encode(PROMPTS[i]), NEW[i]) for i in picked]
    s = session.scheduler()
    for r in reqs:
        s.submit(r)
    s.step()
    s.step()
    assert s.running == 2 and s.waiting == 1
    s.cancel(reqs[0])
    s.step()  # the cancelled row is freed at once and the waiting request takes it
    assert reqs[0].finish_reason == "abort" and s.running == 2 and s.waiting == 0
    s.run()
    assert [r.generated for r in reqs[1:]] == [alone[i] for i in picked[1:]]
    assert 2 <= len(reqs[0].generated) < NEW[0] and reqs[0].generated == alone[0][:len(reqs[0].generated)]


def test_a_failing_prefill_ends_only_its_request(session, alone, monkeypatch):
    """An error in one request's step ends that request ("error") and is raised; the rows of the
    others keep their state and give their alone tokens."""
    bad = session.encode("zz")
    real = session.runner.prefill

    def prefill(prompts, batch=None):
        if prompts[0] == bad:
            raise RuntimeError("injected")
        return real(prompts, batch)

    monkeypatch.setattr(session.runner, "prefill", prefill)
    first = Request(session.encode(PROMPTS[0]), NEW[0])
    broken = Request(bad, 5)
    last = Request(session.encode(PROMPTS[1]), NEW[1])
    s = session.scheduler()
    s.submit(first)
    s.step()
    s.submit(broken)
    s.submit(last)
    with pytest.raises(RuntimeError, match="injected"):
        s.step()
    assert broken.finish_reason == "error" and "injected" in broken.error
    s.run()
    assert first.generated == alone[0] and last.generated == alone[1]


def test_queue_is_bounded(session):
    s = session.scheduler(max_queue=2)
    s.submit(Request(session.encode("a"), 2))
    s.submit(Request(session.encode("b"), 2))
    with pytest.raises(QueueFull, match=r"queue is full \(2 waiting"):
        s.submit(Request(session.encode("c"), 2))
    s.step()  # both admitted into the two rows: the queue has room again
    s.submit(Request(session.encode("c"), 2))
    s.run()
    with pytest.raises(UserError, match="max_queue must be a positive integer"):
        session.scheduler(max_queue=0)


@pytest.mark.parametrize("change, param, message", [
    ({"prompt_ids": []}, "prompt", "the prompt is empty"),
    ({"prompt_ids": [1, 258]}, "prompt", r"integers in 0\.\.257"),
    ({"prompt_ids": [1] * 9}, "prompt", "largest prefill bucket of this bundle holds 8"),
    ({"max_tokens": 0}, "max_tokens", "positive integer"),
    ({"max_tokens": 15}, "max_tokens", r"needs 17 positions .* 16 tokens .*use max_tokens <= 14"),
    ({"temperature": -0.5}, "temperature", "finite number >= 0"),
    ({"temperature": float("nan")}, "temperature", "finite number >= 0"),
    ({"top_p": 0.0}, "top_p", r"in \(0, 1\]"),
    ({"seed": -1}, "seed", r"0\.\.18446744073709551615"),
    ({"seed": 2**64}, "seed", r"0\.\.18446744073709551615"),
    ({"stop": [""]}, "stop", "non-empty strings"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
])
def test_bad_requests_name_the_field_and_the_limit(session, change, param, message):
    r = dataclasses.replace(Request([1, 104, 105], 4), **change)
    s = session.scheduler()
    with pytest.raises(RequestError, match=message) as e:
        s.submit(r)
    assert e.value.param == param and s.waiting == 0


# ---------------------------------------------------------------------------------------- slow
@pytest.fixture(scope="module")
def micro_rows(tmp_path_factory, micro_checkpoint):
    """micro with batch buckets 1 and 2 (prefill 16 and 32, capacity 64): 32 executables, about
    10 minutes on 2 cores."""
    from dsneuron.compiler.compile import build_steps_for_config, compile_bundle
    from dsneuron.compiler.config import load_config

    model_cfg, compile_cfg, _ = load_config("micro")
    compile_cfg = dataclasses.replace(compile_cfg, batch_sizes=(1, 2), prefill_seq_lens=(16, 32),
                                      decode_context_lens=(64,), checkpoint=str(micro_checkpoint))
    root = tmp_path_factory.mktemp("micro_rows")
    parts = build_steps_for_config(model_cfg, compile_cfg, root / "cache")
    return compile_bundle(model_cfg, compile_cfg, root / "bundle", parts, cache_dir=root / "cache")


@pytest.mark.slow
def test_real_model_rows_are_independent_of_the_batch_bucket(micro_rows):
    """micro's cpu kernels: requests moving between batch 1 and batch 2 as others join and end
    give the ids they get alone, greedy and seeded sampling alike."""
    session = Session.load(micro_rows)
    prompts = ["Hello", "The quick brown fox jumps", "a", "DeepSeek serves text over HTTP to clients", "x y", "1 2 3"]
    new = [20, 7, 30, 12, 25, 3]
    for kw in ({}, {"temperature": 0.9, "seed": 5}):
        alone = [session.generate_ids([p], n, **kw)[0] for p, n in zip(prompts, new)]
        for between in (0, 2):
            reqs = [Request(session.encode(p), n, **kw) for p, n in zip(prompts, new)]
            staggered(session, reqs, between)
            assert [r.generated for r in reqs] == alone, (kw, between)
