"""A micro bundle compiled with `--numerics fast` (batch bucket 2: one prefill bucket of 16, one
decode bucket of 64, no probes): its manifest declares it, its executables call the fast GEMM ops,
its generated text is deterministic, `compare` against the golden (which re-runs with the bundle's
numerics) is within FAST_FLOOR_FACTOR of the floors, the scheduler and the server give each request
the text it gets alone while it shares the batch bucket with others (fast numerics' batch
invariance, issue 43's goal), and the CLI refuses an unknown mode with exit code 2."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dsneuron.compiler.compare import compare_sequence, end_to_end_verdict
from dsneuron.compiler.config import load_config
from dsneuron.runtime_min.core.scheduler import Request
from dsneuron.runtime_min.session import Session
from in_process import TIMEOUT, client, served

#: the fast-mode tolerance of `compare`'s end-to-end verdict: the bundle's mean 1 - cos may be this
#: many times the larger floor's (reversed K blocks, nudged embedding). Fast numerics rounds every
#: GEMM's activation to bf16 (the head's fp32 input included) and sums in pairs, a deviation of a
#: few bf16 steps per GEMM where the floors' is one reordering or one step: README "Two numerics modes"
FAST_FLOOR_FACTOR = 8.0


@pytest.fixture(scope="module")
def fast_bundle(tmp_path_factory, micro_checkpoint):
    """About 4-5 minutes on 2 cores (two AOTInductor compiles). Batch bucket 2 alone, so that two
    requests share a decode step at no more executables than batch 1 would take."""
    from dsneuron.compiler.compile import build_steps_for_config, compile_bundle

    model_cfg, compile_cfg, _ = load_config("micro")
    compile_cfg = dataclasses.replace(compile_cfg, batch_sizes=(2,), prefill_seq_lens=(16,), decode_context_lens=(64,),
                                      chunked_prefill=False, checkpoint=str(micro_checkpoint), numerics="fast")
    root = tmp_path_factory.mktemp("micro_fast")
    parts = build_steps_for_config(model_cfg, compile_cfg, root / "cache")
    return compile_bundle(model_cfg, compile_cfg, root / "bundle", parts, cache_dir=root / "cache")


def test_fast_bundle_declares_and_calls_the_fast_ops(fast_bundle):
    s = Session.load(fast_bundle)
    assert s.manifest.numerics == "fast" and s.manifest.schema_version == 6  # 6: decode caches written in place
    assert {"dsneuron::gemm_fast", "dsneuron::gemm_fast_segments"} <= set(s.manifest.compiler["custom_ops"])
    assert "dsneuron::gemm_panels" in s.manifest.compiler["custom_ops"]  # the fp32 mHC projections stay exact


def test_a_decode_step_writes_its_caches_in_place_on_a_copy(fast_bundle):
    """graphs/stages.py AttnStage.in_place_names: the decode buckets' attention stages write one row of
    the window ring, compressed KV and indexer keys into their input tensors, which the executor
    copies first (runtime_min/executors/executor_cpu.py): the state a step is given is unchanged,
    the one it returns has the row written, and an older schema version is refused for it."""
    from dsneuron.runtime_min.bundle.schema import BundleError, Manifest, written_in_place

    runner = Session.load(fast_bundle).runner
    given = runner.prefill([[1, 104, 105], [1, 120, 121]]).state
    kept = {n: t.clone() for n, t in given.tensors.items()}
    step = runner.decode(torch.tensor([7, 9]), torch.tensor([3, 3]), given)
    written = written_in_place(step.bucket)
    assert written and {n.rsplit(".", 1)[1] for n in written} == {"window_kv", "compress_kv", "index_k"}
    assert all(torch.equal(given.tensors[n], kept[n]) for n in kept)
    assert all(not torch.equal(step.state.tensors[n], kept[n]) for n in written if n.endswith("window_kv"))
    assert not any(written_in_place(b) for b in runner.manifest.buckets if b.kind == "prefill")
    old = dataclasses.replace(runner.manifest, schema_version=5)
    with pytest.raises(BundleError, match="write state in place need schema version 6"):
        Manifest.from_json(old.to_json())


class _Rows:
    """A stage package that records the token rows of its stream input (h, or the tokens), then runs."""

    def __init__(self, loader, seen: list[int]):
        self.loader, self.seen = loader, seen

    def boxed_run(self, args):
        self.seen.append(args[-1].size(1) if args[-1].dim() >= 2 else -1)
        return self.loader.boxed_run(args)


def test_per_token_stages_run_on_the_valid_rows_alone(fast_bundle):
    """A prefill of prompts of 3 and 5 tokens runs at the bucket's padded token count, and its
    per-token stages (the MoE halves, engram, head: schema.Stage.per_token) on 5 rows only
    (executor_cpu._run_rows); the logits and the state are the bits of the same call with every
    stage at the padded count."""
    runner = Session.load(fast_bundle).runner
    prompts = [[1, 104, 105], [1, 120, 121, 122, 123]]
    length = runner.lengths("prefill", 2)[0]
    exe = runner.executable("prefill", 2, length)
    padded = exe.bucket.padded_len(5)
    assert padded > 5, "the test needs a prompt shorter than its padded token count"
    flagged = {st.name for st in exe.bucket.stages if st.per_token}
    assert {"embed", "head"} <= flagged and all(n in flagged for n in (st.name for st in exe.bucket.stages)
                                                 if n.endswith((".ffn", ".engram")))
    assert not any(st.per_token for st in exe.bucket.stages if st.name.endswith(".attn"))
    ffn = [i for i, st in enumerate(exe.bucket.stages) if st.name.endswith(".ffn")]
    original = list(exe._stages)
    seen: list[int] = []
    try:
        for i in ffn:
            loader, *rest = exe._stages[i]
            exe._stages[i] = (_Rows(loader, seen), *rest)
        trimmed = runner.prefill(prompts)
        assert seen == [5] * len(ffn)
        seen.clear()
        exe._stages = [(*entry[:4], False) for entry in exe._stages]
        whole = runner.prefill(prompts)
        assert seen == [padded] * len(ffn)
    finally:
        exe._stages = original
    assert torch.equal(trimmed.logits, whole.logits)
    assert all(torch.equal(trimmed.state.tensors[n], whole.state.tensors[n]) for n in whole.state.tensors)


def test_fast_bundle_text_is_deterministic(fast_bundle):
    first = Session.load(fast_bundle).generate_ids(["Hello world"], 8)
    assert Session.load(fast_bundle).generate_ids(["Hello world"], 8) == first


def test_fast_bundle_compares_within_the_fast_floor(fast_bundle, micro_golden):
    ids = torch.randint(0, 128000, (15,), generator=torch.Generator().manual_seed(1)).tolist()
    v = end_to_end_verdict(compare_sequence(Session.load(fast_bundle), micro_golden, "random", ids, 11))
    assert v["bundle"] <= FAST_FLOOR_FACTOR * max(v["floor"], v["nudge"]), v


PROMPTS = ["Hello world", "The ship sails", "a b c", "Once upon"]
NEW = [7, 3, 9, 5]


def _alone(session, prompt: str, n: int) -> Request:
    """`prompt` generated alone: one request through a scheduler of its own (row 0 of bucket 2)."""
    r = Request(session.encode(prompt), n)
    s = session.scheduler()
    s.submit(r)
    s.run()
    return r


def test_fast_scheduler_gives_each_request_its_alone_tokens(fast_bundle):
    """Four requests on two rows, staggered: they join, share decode steps and leave at different
    steps, one moves from row 1 into a freed row 0; each one's ids are those it gets alone."""
    session = Session.load(fast_bundle)
    alone = [_alone(session, p, n).generated for p, n in zip(PROMPTS, NEW)]
    reqs = [Request(session.encode(p), n) for p, n in zip(PROMPTS, NEW)]
    s = session.scheduler()
    for r in reqs:
        s.submit(r)
        s.step()
    s.run()
    assert [r.generated for r in reqs] == alone


def test_fast_server_gives_each_client_its_alone_text(fast_bundle):
    """Four concurrent completions from the in-process server on two rows: each text is the one
    the request gets alone."""
    session = Session.load(fast_bundle)
    want = [_alone(session, p, n).text for p, n in zip(PROMPTS, NEW)]
    with served(session) as (url, _):
        def one(job):
            prompt, n = job
            return client(url).completions.create(model="bundle", prompt=prompt, max_tokens=n,
                                                  temperature=0).choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(one, zip(PROMPTS, NEW), timeout=TIMEOUT * 2))
    assert got == want


def test_unknown_numerics_exits_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dsneuron.compiler.cli", "compile", "--config", "micro", "--numerics", "foo",
                        "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "--numerics: must be one of exact, fast (got 'foo')" in r.stderr
    assert not (tmp_path / "b").exists()


def test_a_short_prompt_admitted_beside_a_chunked_one_leaves_it_running(fast_bundle):
    """Two rows: a prompt whose prefill takes two calls (its first 4 tokens, then the rest from
    their snapshot: the job a chunked prefill or a resumed prefix makes) is mid-prefill when a
    short one is admitted to the other row and prefills whole; the first still finishes, and
    both get the tokens they get alone."""
    from dsneuron.runtime_min.core.runner import PrefillJob

    session = Session.load(fast_bundle)
    runner = session.runner
    first, second = (session.encode(p) for p in ("The ship sails far away", "Hello world"))
    alone = [_alone(session, "The ship sails far away", 5).generated, _alone(session, "Hello world", 4).generated]

    real = runner.prefill_job

    def two_calls(ids):
        head = runner.prefill([ids[:4]])
        yield 4, head
        return real(ids, prefix=(4, runner.snapshot(head.state, 0))).run()

    runner.prefill_job = lambda ids, **k: PrefillJob(two_calls(list(ids)), len(ids)) if list(ids) == first \
        else real(ids, **k)
    try:
        s = session.scheduler()
        a, b = Request(first, 5), Request(second, 4)
        s.submit(a)
        s.submit(b)
        s.step()  # a's first call, then b admitted beside it and prefilled whole
        assert s._prefilling is a and b.generated
        s.run()
    finally:
        del runner.prefill_job
    assert a.finish_reason == b.finish_reason == "length" and [a.generated, b.generated] == alone

