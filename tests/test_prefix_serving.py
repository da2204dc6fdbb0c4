"""The prefix cache wired in (runtime_min/core/runner.py snapshot/restore/prefill_job(prefix=...),
runtime_min/core/scheduler.py, `dsneuron serve --prefix-cache-gib`): a prompt started from a snapshot
gives the logits, state and text it gets without the cache, bit for bit.

On the micro bundle of tests/conftest.py (batch 1, prefill 16, capacity 64, no chunk bucket: the
rest of a prompt after a snapshot runs as decode steps, the numerics of a chunk); the chunk path
on a micro bundle with chunk buckets is `-m slow` (tests/test_chunked_prefill.py's chunk_session).
The expected values are the runs without the cache, never values recorded from the cache.
"""

from __future__ import annotations

import urllib.request

import pytest
import torch

from dsneuron.runtime_min.core.prefix_cache import PrefixCache
from dsneuron.runtime_min.core.runner import Runner
from dsneuron.runtime_min.core.scheduler import Request, Scheduler
from dsneuron.runtime_min.session import Session
from in_process import client, served

PROMPT = [1, 45, 300, 7, 88, 123, 9, 410, 52, 61, 77, 230, 19, 3]  # 14 tokens, within the 16-token prefill


@pytest.fixture(scope="module")
def session(micro_bundle):
    return Session.load(micro_bundle.path)


def same_row(a, b) -> bool:
    """Row 0 of two Steps: logits, every state tensor and the engram history, bit for bit."""
    if not torch.equal(a.logits[0], b.logits[0]) or a.state.tensors.keys() != b.state.tensors.keys():
        return False
    if (a.state.history is None) != (b.state.history is None):
        return False
    if a.state.history is not None and not torch.equal(a.state.history[0], b.state.history[0]):
        return False
    return all(torch.equal(v[0], b.state.tensors[k][0]) for k, v in a.state.tensors.items())


def assert_resumes_bit_for_bit(runner: Runner, ids: list[int], lengths: list[int]) -> None:
    """A start from the snapshot after ids[:n] equals the whole prompt's prefill for every n."""
    whole = runner.prefill_job(ids).run()
    for n in lengths:
        snap = runner.snapshot(runner.prefill_job(ids[:n]).run().state, 0)
        kept = {k: v.clone() for k, v in snap.state.items()}
        job = runner.prefill_job(ids, prefix=(n, snap))
        assert same_row(job.run(), whole), n
        assert job.started == n and job.fed == len(ids)
        assert all(torch.equal(v, kept[k]) for k, v in snap.state.items())  # the cached copy is left unchanged
    other = ids[:1] + [t + 1 for t in ids[1:]]
    snap = runner.snapshot(runner.prefill_job(other[:len(ids) - 1]).run().state, 0)
    assert not same_row(runner.prefill_job(ids, prefix=(len(ids) - 1, snap)).run(), whole)  # it can tell


def test_a_start_from_a_snapshot_equals_the_whole_prefill(session):
    assert_resumes_bit_for_bit(session.runner, PROMPT, [1, 2, 7, 13])


def test_a_prefix_must_leave_at_least_one_token(session):
    runner = session.runner
    snap = runner.snapshot(runner.prefill_job(PROMPT[:3]).run().state, 0)
    for n in (0, len(PROMPT)):
        with pytest.raises(ValueError, match="must be 1..13"):
            runner.prefill_job(PROMPT, prefix=(n, snap))


def generate(session, prompts: list[list[int]], cache: PrefixCache | None, max_tokens: int = 6) -> list[Request]:
    """The prompts one after another through one scheduler (with `cache`), greedy."""
    s = Scheduler(session.runner, session.decode, prefix_cache=cache)
    done = []
    for ids in prompts:
        done.append(s.submit(Request(list(ids), max_tokens)))
        s.run()
    return done


def test_the_scheduler_starts_from_the_longest_prefix_and_keeps_prompt_and_completion(session):
    """Turn 1, then turn 2 = turn 1's prompt + its completion + new tokens: turn 2 starts from the
    snapshot taken when turn 1 ended (its prompt and completion but the last sampled token, which
    was never fed), and every text is the one without the cache; the same prompt again starts
    from its own whole-prompt snapshot (kept with its logits)."""
    cache = PrefixCache(1 << 30)
    first = generate(session, [PROMPT[:8]], cache)[0]
    fed = PROMPT[:8] + first.generated[:-1]
    assert first.finish_reason == "length" and len(cache) >= 2
    second_ids = PROMPT[:8] + first.generated + [5, 6]
    assert len(second_ids) <= 16
    again = generate(session, [second_ids, second_ids], cache)
    alone = generate(session, [second_ids], None)[0]
    assert [r.generated for r in again] == [alone.generated] * 2 and again[0].text == alone.text
    st = cache.stats()
    assert st["hits"] == 2 and st["misses"] == 1
    # turn 2: the end-of-request snapshot (len(fed)); the repeat: its whole prompt, which turn 2's
    # prefill left with its logits (the end snapshot of turn 2 is longer than the prompt: no match)
    assert st["tokens_saved"] == len(fed) + len(second_ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_prompt_sent_again_runs_no_call_and_gets_the_same_text(session, temperature):
    """The whole prompt cached with its logits: the repeat runs no prefill call at all and
    generates what the prompt gets without the cache (greedy, and sampled with one seed); a cache
    whose snapshots lack logits (end-of-request only) cannot serve a whole prompt."""
    cache = PrefixCache(1 << 30)
    s = Scheduler(session.runner, session.decode, prefix_cache=cache)
    first = s.submit(Request(list(PROMPT), 6, temperature=temperature, seed=7))
    s.run()
    calls = []
    real = session.runner.prefill_job
    session.runner.prefill_job = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        again = s.submit(Request(list(PROMPT), 6, temperature=temperature, seed=7))
        s.run()
    finally:
        del session.runner.prefill_job
    alone = Scheduler(session.runner, session.decode)
    ref = alone.submit(Request(list(PROMPT), 6, temperature=temperature, seed=7))
    alone.run()
    assert calls == [] and again.generated == first.generated == ref.generated
    assert cache.stats()["hits"] == 1 and cache.stats()["tokens_saved"] == len(PROMPT)
    n, snap = cache.longest_prefix(PROMPT)
    assert n == len(PROMPT) and snap.logits is not None
    bare = PrefixCache(1 << 30)  # the same state, kept without logits: not a start for the whole prompt
    bare.insert(PROMPT, session.runner.snapshot(session.runner.prefill_job(PROMPT).run().state, 0))
    s = Scheduler(session.runner, session.decode, prefix_cache=bare)
    r = s.submit(Request(list(PROMPT), 6, temperature=temperature, seed=7))
    s.run()
    assert r.generated == ref.generated and bare.stats()["misses"] == 1


def test_a_cache_too_small_for_one_snapshot_stores_nothing_and_changes_nothing(session):
    cache = PrefixCache(1000)  # a micro state row is ~25 kB
    out = generate(session, [PROMPT, PROMPT], cache)
    assert len(cache) == 0 and cache.stats()["hits"] == 0
    assert out[0].generated == out[1].generated == generate(session, [PROMPT], None)[0].generated


def test_openai_client_gets_the_same_text_with_the_cache_and_metrics_count_it(session):
    """Over 127.0.0.1 with the official client: the same completions (a prompt, then it extended)
    with --prefix-cache-gib 1 and without; /metrics counts the hits and tokens saved."""
    prompts = ["Hello there", "Hello there, how are"]
    texts = {}
    for gib in (0, 1):
        with served(session, prefix_cache_bytes=gib << 30) as (url, _):
            c = client(url)
            texts[gib] = [c.completions.create(model="bundle", prompt=p, max_tokens=5, temperature=0).choices[0].text
                          for p in prompts]
            metrics = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
        lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in metrics.splitlines() if ln.startswith("dsneuron_prefix")}
        if gib == 0:
            assert not lines  # no cache, no cache metrics
        else:
            assert lines["dsneuron_prefix_cache_queries_total"] == 2 and lines["dsneuron_prefix_cache_hits_total"] == 1
            n = len(session.encode(prompts[0]))
            assert lines["dsneuron_prefix_cache_hit_tokens_total"] >= n - 1
            assert lines["dsneuron_prefix_cache_bytes"] > 0 and lines["dsneuron_prefix_cache_entries"] >= 2
    assert texts[1] == texts[0] and all(texts[0])
