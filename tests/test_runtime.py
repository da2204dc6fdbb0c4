"""runtime_min on the compiled stand-in bundle: executables vs eager, generation vs the float64 oracle,
padding, state growth across capacities, limits, EOS, streaming, sampling."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import stand_in
from stand_in import run_cli
from dsneuron import UserError
from dsneuron.runtime_min.bundle.schema import BundleError, TensorSpec
from dsneuron.runtime_min.bundle.schema import SEAL, content_sha256
from dsneuron.runtime_min.core.checks import check_context, check_params, check_seed
from dsneuron.runtime_min.core.runner import resize_state
from dsneuron.runtime_min.core.sampling import sample
from dsneuron.runtime_min.core.scheduler import TextStream
from dsneuron.runtime_min.session import Session


@pytest.fixture(scope="module")
def bundle():
    return stand_in.shared_bundle()


@pytest.fixture(scope="module")
def session(bundle):
    return Session.load(bundle[0])


def prompt_of(n_tokens: int) -> str:
    """An ASCII prompt of n_tokens tokens with the BOS (byte tokenizer: one token per character)."""
    return "abcdefghijklmnop"[:n_tokens - 1]


# ------------------------------------------------------------------------------------------ executables
def test_compiled_steps_equal_eager_steps(session, bundle):
    _, kit = bundle
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, kit.model.vocab_size, (2, 8), generator=g)
    valid = torch.tensor([8, 3])
    engram, _ = kit.hasher.hash(tokens, kit.hasher.initial_history(2), valid)
    exe = session.runner.executable("prefill", 2, 8)
    got = exe.run([tokens, valid, engram])
    want = kit.parts.steps.prefill(2, 8, 8).module(tokens, valid, engram)
    assert len(got) == len(want) == 5
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    state = [torch.randn(t.shape, generator=g) for t in want[1:]]
    state = [resize_state(t, TensorSpec("s", s.shape, "float32"), 0.0) for t, s in
             zip(state, session.runner.bucket("decode", 2, 16).inputs[3:])]
    feed, pos = torch.tensor([[5], [7]]), torch.tensor([9, 2])
    ids = torch.randint(0, 50, (2, 1, kit.hasher.n_layers, kit.hasher.n_cols), generator=g)
    got = session.runner.executable("decode", 2, 16).run([feed, pos, ids, *state])
    want = kit.parts.steps.decode(2, 16).module(feed, pos, ids, *state)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_executable_refuses_wrong_shapes(session):
    exe = session.runner.executable("prefill", 2, 8)
    with pytest.raises(ValueError, match="input tokens must be a contiguous torch.int64 \\[2, 8\\]"):
        exe.run([torch.zeros(2, 9, dtype=torch.int64), torch.ones(2, dtype=torch.int64),
                 torch.zeros(2, 9, 2, 4, dtype=torch.int64)])


# ------------------------------------------------------------------------------------------ generation
def test_greedy_matches_oracle_across_capacities(session, bundle):
    """Two prompts of different lengths in one batch; the longer one reaches capacity 16 exactly,
    so decode runs at capacity 8 and then on a grown state at 16."""
    _, kit = bundle
    prompts = ["hi", "h\u00e9llo"]  # 3 and 7 tokens with BOS
    got = session.generate_ids(prompts, max_new_tokens=9)
    for p, g in zip(prompts, got):
        assert g == kit.greedy(session.encode(p), 9)


def test_batch_rows_equal_separate_runs(session):
    both = session.generate(["hi", "h\u00e9llo"], max_new_tokens=6)
    alone = [session.generate(p, max_new_tokens=6) for p in ("hi", "h\u00e9llo")]
    assert both == alone
    assert isinstance(alone[0], str)


@pytest.mark.parametrize("n_tokens", [7, 8])  # b-1 and b of the only prefill bucket (8)
def test_prompt_lengths_up_to_the_bucket(session, bundle, n_tokens):
    _, kit = bundle
    p = prompt_of(n_tokens)
    assert len(session.encode(p)) == n_tokens
    assert session.generate_ids([p], max_new_tokens=3) == [kit.greedy(session.encode(p), 3)]


def test_prompt_longer_than_largest_bucket(session):
    with pytest.raises(UserError, match="prompt has 9 tokens; the largest prefill bucket of this bundle holds 8"):
        session.generate(prompt_of(9), max_new_tokens=1)


def test_empty_prompt(session):
    with pytest.raises(UserError, match="prompt 0 is empty"):
        session.generate("", max_new_tokens=1)
    with pytest.raises(UserError, match="prompt 1 is empty"):
        session.generate(["ok", ""], max_new_tokens=1)


def test_prompt_that_is_not_utf8_is_refused(session):
    """Undecodable command-line bytes reach Python as lone surrogates (PEP 383)."""
    with pytest.raises(UserError, match="prompt 0 is not valid UTF-8"):
        session.generate(b"ab\xff".decode("utf-8", "surrogateescape"), max_new_tokens=1)


def test_generation_that_exactly_fills_the_capacity(session, bundle):
    """7 prompt tokens + 10 new ones: the prefill holds positions 0..6 and gives the first token, 9
    decode steps feed positions 7..15, the tenth token is sampled and never fed: 16 positions, the
    largest capacity, exactly. The tokens are the float64 oracle's, up to an EOS."""
    _, kit = bundle
    ids = session.encode(prompt_of(7))
    got = session.generate_ids([prompt_of(7)], max_new_tokens=10)[0]
    want = kit.greedy(ids, 10)
    assert got == want[:len(got)]
    assert len(got) == 10 or want[len(got)] == kit.eos


def test_generation_past_capacity_is_refused_up_front(session):
    with pytest.raises(UserError, match=r"prompt of 7 tokens \+ max_new_tokens 11 needs 17 positions .* exceeds the "
                                        r"context capacity of this bundle, 16 tokens.*max_new_tokens <= 10"):
        session.generate(prompt_of(7), max_new_tokens=11)


@pytest.mark.parametrize("prompt_len, new, fits", [(16, 1, True), (17, 1, False), (16, 2, False), (1, 16, True),
                                                   (1, 17, False), (8, 9, True), (8, 10, False)])
def test_context_rule_edges(prompt_len, new, fits):
    """prompt + new - 1 <= capacity 16: a prompt of exactly the capacity still gets its one token
    from the prefill logits, one position more is refused."""
    if fits:
        check_context(prompt_len, new, 16)
    else:
        with pytest.raises(UserError, match=rf"needs {prompt_len + new - 1} positions .* 16 tokens .*"
                                            rf"max_new_tokens <= {16 - prompt_len + 1}"):
            check_context(prompt_len, new, 16)


def test_more_prompts_than_the_largest_batch_bucket_queue(session):
    """3 prompts on a bundle of batch 2: the third waits for a free row (runtime_min/core/scheduler.py)."""
    assert session.generate(["a", "b", "c"], max_new_tokens=3) == [session.generate(p, max_new_tokens=3)
                                                                  for p in ("a", "b", "c")]


def test_bad_sampling_values(session):
    for kw in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0}):
        with pytest.raises(UserError):
            session.generate("a", **{"max_new_tokens": 1, **kw})


def test_stops_at_eos(tmp_path, bundle, session):
    src, kit = bundle
    for p in ("a", "b", "hi", "xyz", "hello"):
        ref = kit.greedy(session.encode(p), 4)
        if ref[2] not in ref[:2]:
            break
    else:
        pytest.skip("no prompt whose third greedy token is new")
    copy = tmp_path / "eos"
    shutil.copytree(src, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["tokenizer"]["eos_token_id"] = ref[2]
    m[SEAL] = content_sha256(m)  # an edit on purpose: seal it again (schema.py)
    (copy / "manifest.json").write_text(json.dumps(m))
    assert Session.load(copy).generate_ids([p], max_new_tokens=4) == [ref[:2]]


def test_streaming_pieces_concatenate_to_the_text(session):
    pieces: dict[int, list[str]] = {0: [], 1: []}
    texts = session.generate(["hi", "h\u00e9llo"], max_new_tokens=9, stream=lambda i, s: pieces[i].append(s))
    assert ["".join(pieces[i]) for i in (0, 1)] == texts


def test_text_stream_holds_back_partial_characters(session):
    text = "a\u00e9\u4e16\U0001f642b"
    ids = session.tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) == len(text.encode()) == 11  # byte tokens
    stream = TextStream(lambda x: session.tokenizer.decode(x, skip_special_tokens=True))
    pieces = [stream.push(t) for t in ids]
    assert [p for p in pieces if p] == ["a", "\u00e9", "\u4e16", "\U0001f642", "b"]
    assert stream.finish() == ""


def test_seeded_sampling_is_reproducible(session):
    a = session.generate_ids(["hi"], max_new_tokens=6, temperature=1.5, top_p=0.9, seed=7)
    b = session.generate_ids(["hi"], max_new_tokens=6, temperature=1.5, top_p=0.9, seed=7)
    assert a == b


def test_seed_range(session):
    """torch.Generator takes a seed as an unsigned 64-bit integer: the ends of that range work, the
    values past them are refused by name instead of overflowing (2**64) or wrapping around (-1)."""
    for seed in (0, 2**64 - 1):
        assert len(session.generate_ids(["hi"], max_new_tokens=2, temperature=1.0, seed=seed)[0]) <= 2
    for seed in (2**64, -1, 1.5, True):
        with pytest.raises(UserError, match=r"seed must be an integer in 0\.\.18446744073709551615 \(2\*\*64 - 1\)"):
            session.generate_ids(["hi"], max_new_tokens=2, temperature=1.0, seed=seed)
    check_seed(None)


def test_tiny_temperature_is_greedy(session):
    """T = 1e-40 overflowed logits / T in fp32; computed as (logits - max) / T in float64 it is the
    greedy choice (no ties in the stand-in's logits)."""
    greedy = session.generate_ids(["hi", "h\u00e9llo"], max_new_tokens=6)
    assert session.generate_ids(["hi", "h\u00e9llo"], max_new_tokens=6, temperature=1e-40, seed=0) == greedy


# ------------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_tiny_temperature_samples_the_maxima_evenly(temperature):
    """Oracle: as T -> 0, softmax(l / T) puts mass 1/k on each of the k maxima and 0 elsewhere."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 3.0, 2.999]]).expand(4000, 5)
    got = sample(logits, temperature, generator=torch.Generator().manual_seed(0))
    assert set(got.tolist()) == {1, 3}
    assert abs((got == 1).float().mean().item() - 0.5) < 0.04  # binomial sd at n = 4000 is 0.008


@pytest.mark.parametrize("temperature", [1e6, 1e300, 1.7e308])
def test_huge_temperature_is_uniform(temperature):
    logits = torch.tensor([[10.0, -10.0, 0.0, 3.0]]).expand(8000, 4)
    got = sample(logits, temperature, generator=torch.Generator().manual_seed(1))
    shares = torch.bincount(got, minlength=4).double() / 8000
    assert bool(((shares - 0.25).abs() < 0.03).all())  # sd 0.005


def test_temperature_matches_the_float64_softmax():
    """An ordinary T: the draw frequencies follow softmax(l / T) computed by hand in float64."""
    logits = torch.tensor([[0.0, 0.5, 1.0, 1.5]])
    T = 0.7
    e = [math.exp(x / T) for x in logits[0].tolist()]
    want = [v / sum(e) for v in e]
    got = sample(logits.expand(20000, 4), T, generator=torch.Generator().manual_seed(2))
    shares = (torch.bincount(got, minlength=4).double() / 20000).tolist()
    assert all(abs(a - b) < 0.015 for a, b in zip(shares, want))  # sd <= 0.0035


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1e-9])
def test_temperature_must_be_finite_and_not_negative(temperature):
    with pytest.raises(UserError, match="temperature must be a finite number >= 0"):
        check_params(temperature, 1.0)
    with pytest.raises(UserError, match="temperature must be a finite number >= 0"):
        sample(torch.zeros(1, 4), temperature)


def test_greedy_takes_lowest_id_among_ties():
    assert sample(torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 0.0, 0.0]])).tolist() == [1, 0]


@pytest.mark.parametrize("top_p, support", [(0.5, {0}), (0.7, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_support(top_p, support):
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(4000, 4)
    got = sample(logits, temperature=1.0, top_p=top_p, generator=torch.Generator().manual_seed(0))
    assert set(got.tolist()) == support


def test_top_p_renormalises():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(20000, 4)
    got = sample(logits, temperature=1.0, top_p=0.7, generator=torch.Generator().manual_seed(3))
    share = (got == 0).float().mean().item()
    # 0.5 / 0.8 = 0.625; binomial sd at n = 20000 is 0.0034
    assert abs(share - 0.625) < 0.02


# ------------------------------------------------------------------------------------------ state resize
def test_resize_state_grows_and_shrinks_one_dimension():
    t = torch.arange(6.0).reshape(1, 3, 2)
    grown = resize_state(t, TensorSpec("kv", (1, 5, 2), "float32"), -1.0)
    assert grown.tolist() == [[[0, 1], [2, 3], [4, 5], [-1, -1], [-1, -1]]]
    assert resize_state(grown, TensorSpec("kv", (1, 3, 2), "float32"), -1.0).tolist() == t.tolist()
    with pytest.raises(BundleError, match="only one capacity-dependent dimension"):
        resize_state(t, TensorSpec("kv", (2, 5, 2), "float32"), 0.0)


# ------------------------------------------------------------------------------------------ CLI
def test_cli_run_streams_the_generation(monkeypatch, capsys, bundle, session):
    code = run_cli(monkeypatch, "run", str(bundle[0]), "--prompt", "hi", "--max-new-tokens", "5")
    out = capsys.readouterr().out
    assert code == 0
    assert out == session.generate("hi", max_new_tokens=5) + "\n"


def test_cli_run_seed_out_of_range_exits_2(monkeypatch, capsys, bundle):
    for seed in (str(2**64), "-1"):
        assert run_cli(monkeypatch, "run", str(bundle[0]), "--prompt", "hi", "--max-new-tokens", "2",
                       "--temperature", "1", "--seed", seed) == 2
        err = capsys.readouterr().err
        assert f"seed must be an integer in 0..{2**64 - 1}" in err and "Traceback" not in err


def test_cli_run_tiny_temperature(monkeypatch, capsys, bundle, session):
    code = run_cli(monkeypatch, "run", str(bundle[0]), "--prompt", "hi", "--max-new-tokens", "5", "--temperature", "1e-40")
    out = capsys.readouterr().out
    assert code == 0
    assert out == session.generate("hi", max_new_tokens=5) + "\n"


def test_cli_run_bad_input_exits_2(monkeypatch, capsys, bundle):
    code = run_cli(monkeypatch, "run", str(bundle[0]), "--prompt", prompt_of(9))
    assert code == 2
    assert "largest prefill bucket of this bundle holds 8" in capsys.readouterr().err
    code = run_cli(monkeypatch, "run", str(bundle[0]), "--prompt", "hi", "--max-new-tokens", "20")
    assert code == 2
    assert "context capacity of this bundle, 16 tokens" in capsys.readouterr().err
    assert run_cli(monkeypatch, "run", str(bundle[0]), "--prompt", "") == 2
    assert "prompt 0 is empty" in capsys.readouterr().err
