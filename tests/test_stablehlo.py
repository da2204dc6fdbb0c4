"""The neuron target's StableHLO (compiler/stablehlo.py), proven on this CPU with XLA
(runtime_min/executors/executor_stablehlo.py).

Unit level: each respelling and fix-up of the lowering on a small program, executed by XLA and
compared bit for bit with torch; the NKI kernel composite (name, attributes, decomposition) and
its execution through the decomposition; the portable artifact; the errors.

Model level: `dsneuron compile --config micro --target neuron --stablehlo-only --probes --speculative
dspark` (every micro bucket, verify buckets included, as a user runs it), then every bucket's module
executed by XLA against the same step run eagerly by torch (compiler/stablehlo_check.py), logits
within `dsneuron compare`'s floor; speculative decoding through the verify modules; and
stage by stage, `dsneuron compare`'s local re-runs of every stage on the module's own recorded
inputs: within 2 bf16 ulps or a named deviation (compiler/compare.py `local_deviations`). tiny's
smallest prefill and decode buckets the same way, in `-m slow`.

NOT covered here: neuronx-cc, the NKI kernels inside a NEFF (their composites run through their
torch references), Trainium's own arithmetic.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from stand_in import run_cli
from dsneuron.compiler.export import CompileError
from dsneuron.compiler.stablehlo import (COMPOSITE_PREFIX, KernelOp, TARGET_VERSION, artifact_text, lower_program,
                                         parse_module)
from dsneuron.runtime_min.bundle.schema import BundleError, Manifest
from dsneuron.runtime_min.executors.executor_stablehlo import compile_module, to_numpy, to_torch


def _run(module, *args: torch.Tensor) -> list[torch.Tensor]:
    import jax

    exe = compile_module(module.artifact(), "test")
    return [to_torch(o) for o in exe.execute([jax.device_put(to_numpy(a)) for a in args])]


def _lower(fn, *args, kernels=None):
    class M(torch.nn.Module):
        def forward(self, *xs):
            out = fn(*xs)
            return out if isinstance(out, tuple) else (out,)

    return lower_program(torch.export.export(M(), args, strict=False), kernels, "test")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# ------------------------------------------------------------------------------------------ the lowering
def test_integer_ops_torch_mlir_gets_wrong_or_through_float64_are_exact():
    """Floor division and remainder of negative integers (torch-mlir lowers the first through
    float64, the second with stablehlo.remainder's truncation), shifts by a constant and by a
    tensor (not lowered at all): bit for bit with torch, and no float64 in the module."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-1000, 1000, (256,), generator=g)
    b = torch.randint(1, 9, (256,), generator=g) * torch.where(torch.rand(256, generator=g) < 0.5, -1, 1)
    s = torch.randint(0, 8, (256,), generator=g, dtype=torch.int32)

    def fn(a, b, s):
        i = a.to(torch.int32)
        return (a // 4, torch.div(a, -3, rounding_mode="floor"), a // b, a % 5, a % b, torch.remainder(a, -3),
                i >> 3, i << s, i >> s)

    module = _lower(fn, a, b, s)
    assert module.facts().f64_ops == 0
    for got, want in zip(_run(module, a, b, s), fn(a, b, s)):
        assert torch.equal(got, want)


def test_sorts_are_stable_and_unsigned_compares_are_unsigned():
    """The model's one tie rule (graphs/model.py stable_topk_indices): among equal scores the lower
    index first, which an unstable sort does not promise; a compare of bytes >= 0x80 as unsigned."""
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 1.0, 2.0, 3.0] * 4])
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)

    def fn(x, u):
        return torch.sort(x, dim=-1, descending=True, stable=True).indices, (u >= 0x80), (u == 255)

    module = _lower(fn, scores, raw)
    assert "is_stable = true" in module.text and "is_stable = false" not in module.text
    for got, want in zip(_run(module, scores, raw), fn(scores, raw)):
        assert torch.equal(got, want)


def test_neuron_spelling_codecs_run_on_xla_as_torch_casts_them():
    """The e4m3 decode, round and encode of the neuron spelling, as StableHLO on XLA, against
    torch's float8 casts: every byte and every bf16 pattern."""
    from dsneuron.kernels_nki.formats import e4m3_round, e4m3_to_bytes, e4m3_to_float, neuron_spelling

    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    every_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().clamp(-448, 448)

    def fn(b, x):
        r = e4m3_round(x)
        return e4m3_to_float(b), r, e4m3_to_bytes(r.nan_to_num(0.0))

    with neuron_spelling():
        module = _lower(fn, every_byte, every_bf16)
    decoded, rounded, encoded = _run(module, every_byte, every_bf16)
    want = every_bf16.to(torch.float8_e4m3fn)
    same = (_bits(decoded) == _bits(every_byte.view(torch.float8_e4m3fn).float())) | decoded.isnan()
    assert bool(same.all()) and int(decoded.isnan().sum()) == 2
    assert bool(((_bits(rounded) == _bits(want.float())) | rounded.isnan()).all())
    finite = ~every_bf16.isnan()
    assert torch.equal(encoded[finite], want.view(torch.uint8)[finite])


@torch.library.custom_op("dsneuron_test::nki_scaled_sum", mutates_args=(), device_types="cpu")
def _nki_scaled_sum(x: torch.Tensor, y: torch.Tensor, scale: float, mode: str) -> torch.Tensor:
    return (x * y).sum(-1, keepdim=True) * scale + (x if mode == "add" else -x)


@_nki_scaled_sum.register_fake
def _(x, y, scale, mode):
    return torch.empty_like(x)


SCALED_SUM = {"dsneuron_test::nki_scaled_sum": KernelOp("dsneuron_test::nki_scaled_sum", "somewhere.kernels:scaled_sum",
                                                        "ab" * 32, _nki_scaled_sum._init_fn)}


def test_a_kernel_call_becomes_one_composite_any_consumer_runs():
    """Each call of a kernel op is one `stablehlo.composite "dsneuron.nki.<kernel>"` carrying the
    kernel's name, its module's sha256 and the call's constant arguments; calls of one signature
    share one decomposition, which XLA runs in the kernel's place."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def fn(x, y):
        op = torch.ops.dsneuron_test.nki_scaled_sum
        return op(x + 1, y, 0.5, "add") * 2 + op(x, y, 0.5, "add") + op(x, y, 0.25, "sub")

    module = _lower(fn, x, y, kernels=SCALED_SUM)
    facts = module.facts()
    assert facts.composites == {COMPOSITE_PREFIX + "scaled_sum": 3} and facts.ops["composite"] == 3
    text = module.text
    assert text.count("func.func private @nki_scaled_sum_impl_") == 2  # two signatures (0.5 add, 0.25 sub)
    assert 'kernel = "somewhere.kernels:scaled_sum"' in text and f'kernel_sha256 = "{"ab" * 32}"' in text
    assert 'mode = "sub"' in text and "scale = 2.500000e-01 : f32" in text
    torch.testing.assert_close(_run(module, x, y)[0], fn(x, y), rtol=1e-6, atol=1e-6)  # XLA sums the 8 in its order


def test_a_custom_op_without_a_kernel_is_named():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(CompileError, match=r"test: the graph still calls dsneuron_test::nki_scaled_sum, which has no "
                                           r"NKI kernel binding"):
        _lower(lambda x, y: torch.ops.dsneuron_test.nki_scaled_sum(x, y, 1.0, "add"), x, y)


def test_the_portable_artifact_round_trips_at_its_version():
    x = torch.randn(3, 5)
    module = _lower(lambda x: (x * 2).exp(), x)
    artifact = module.artifact()
    assert artifact[:4] == b"ML\xefR"  # MLIR bytecode (the VHLO dialect of the portable artifact)
    back = parse_module(artifact_text(artifact))
    assert back.facts().ops == module.facts().ops and back.facts().arguments == 1
    with pytest.raises(CompileError, match="not serializable at version 0.1.0"):
        module.artifact("0.1.0")
    with pytest.raises(CompileError, match="not a StableHLO module"):
        parse_module("this is not MLIR")
    assert TARGET_VERSION.count(".") == 2


def test_the_executor_names_what_is_missing_without_jax(monkeypatch, tmp_path):
    import builtins

    from dsneuron.runtime_min.executors import executor_stablehlo

    real_import = builtins.__import__

    def no_jax(name, *args, **kwargs):
        if name == "jax" or name.startswith("jax."):
            raise ImportError("No module named 'jax'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_jax)
    with pytest.raises(BundleError, match=r"needs jax and jaxlib \(pip install -e '.\[test\]'\)"):
        executor_stablehlo.compile_module(b"", "bucket")


def test_stablehlo_only_is_refused_off_neuron_and_with_sharding(monkeypatch, capsys, tmp_path):
    out = tmp_path / "b"
    assert run_cli(monkeypatch, "compile", "--config", "micro", "--stablehlo-only", "--out", str(out)) == 2
    assert "--stablehlo-only goes with --target neuron (got --target cpu)" in capsys.readouterr().err
    assert run_cli(monkeypatch, "compile", "--config", "micro", "--target", "neuron", "--stablehlo-only", "--tp", "2",
                   "--out", str(out)) == 2
    assert "--tp 2 with --stablehlo-only" in capsys.readouterr().err
    assert not out.exists()


# ------------------------------------------------------------------------------------------ micro, every bucket
@pytest.fixture(scope="module")
def micro_stablehlo(tmp_path_factory):
    """`dsneuron compile --config micro --target neuron --stablehlo-only --probes --speculative dspark`:
    all 12 buckets (6 prefill, 2 decode, 2 chunk, a verify and a draft at batch 1; about 4 minutes
    on 2 cores) and
    the drafter's tensors, as a user runs it, in a process of its own: this one may have
    JAX's threads up already, after which the compile would not fork its workers (compiler/staged.py
    threaded_runtimes) and run one task at a time."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("micro_stablehlo")
    r = subprocess.run([sys.executable, "-m", "dsneuron.compiler.cli", "compile", "--config", "micro", "--target",
                        "neuron", "--stablehlo-only", "--probes", "--speculative", "dspark", "--out", str(root / "bundle"), "--cache-dir",
                        str(root / "cache")], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    return root


def _micro_plan():
    """(model config, the plan `compile --config micro --target neuron --speculative dspark` compiles)."""
    from dsneuron.compiler.buckets import plan_buckets
    from dsneuron.compiler.config import load_config

    model_cfg, compile_cfg, _ = load_config("micro")
    block = model_cfg.dspark_block_size
    return model_cfg, plan_buckets(compile_cfg, model_cfg).with_chunks().with_verify(1 + block).with_draft(block)


def test_every_micro_bucket_is_one_stablehlo_module_with_the_kernels_as_composites(micro_stablehlo):
    bundle = micro_stablehlo / "bundle"
    m = Manifest.from_json((bundle / "manifest.json").read_text())
    model_cfg, plan = _micro_plan()
    assert len(m.buckets) == len(plan.buckets) == 12
    kinds = sorted(b.kind for b in m.buckets)
    assert (kinds.count("chunk"), kinds.count("verify"), kinds.count("draft")) == (2, 1, 1)
    (verify,) = [b for b in m.buckets if b.kind == "verify"]
    T = len(model_cfg.dspark_target_layer_ids)
    assert verify.batch == 1 and [(o.name, o.shape, o.dtype) for o in verify.outputs[:2]] == [
        ("logits", (1, 4, model_cfg.vocab_size), "float32"), ("main_hidden", (1, 4, T * model_cfg.dim), "bfloat16")]
    assert m.compile_config["speculative"] == "dspark" and m.schema_version == 7
    W = model_cfg.window_size  # a speculative prefill also returns what seeds the drafter's rings
    assert all([(o.name, o.shape, o.dtype) for o in b.outputs[1:2]] == [
        ("main_hidden", (b.batch, min(W, b.seq_len), T * model_cfg.dim), "bfloat16")] for b in m.buckets if b.kind == "prefill")
    assert (m.target, m.compiler["backend"], m.compiler["flags"]) == ("neuron", "stablehlo", ["--stablehlo-only"])
    assert m.compiler["custom_ops"]["dsneuron::sparse_attn"] == "kernel"
    assert m.toolchain["stablehlo"]["artifact"] == TARGET_VERSION and m.toolchain["torch_mlir"]
    layers = model_cfg.n_layers
    for b in m.buckets:
        record = m.compiler["stablehlo"][b.file]
        facts = record["facts"]
        assert b.file.endswith(".mlirbc") and record["format"] == "stablehlo-portable-artifact"
        assert facts["arguments"] == len(b.weights) + len(b.inputs) and facts["results"] == len(b.outputs)
        assert facts["float8_types"] == [] and facts["f64_ops"] == 0 and facts["ops"]["while"] == 0
        # the drafter's stages attend through the same kernel
        assert facts["composites"] == {COMPOSITE_PREFIX + "sparse_attn_kernel": layers if b.kind != "draft" else
                                       model_cfg.n_mtp_layers}
        assert facts["ops"]["custom_call"] == 0 and facts["largest_constant"] <= 4096  # weights are arguments
        text = bundle / "buckets" / record["text"]  # a module this small comes as text too
        assert text.read_text().startswith("module") and m.files[f"buckets/{record['text']}"]


@pytest.mark.slow  # 90 s: the next test still runs the modules one prompt uses, through compare
def test_every_micro_bucket_executes_within_the_floor_of_the_eager_step(micro_stablehlo):
    """Each bucket's module, compiled by XLA from the bundle's file, on inputs that exercise it
    (prefill rows of several lengths; a decode step and a chunk on an eager prefill's state), against the step
    run eagerly by torch: no output all zeros where the eager one is not, and the logits' 1 - cos,
    averaged over the buckets, within `dsneuron compare`'s floor averaged the same way. Per
    bucket both are one sample of how far micro's random weights carry a last-bit difference (a
    bucket's can be a few times its floor: measured up to 1.7x, at 0.3x on average)."""
    from dsneuron.compiler.compile import build_steps_for_config, step_graph
    from dsneuron.compiler.config import load_config
    from dsneuron.compiler.stablehlo_check import bucket_inputs, compare_outputs, eager_outputs, logits_within_floor
    from dsneuron.kernels_nki.engram_hash import NgramHasher
    from dsneuron.runtime_min.session import Session

    model_cfg, compile_cfg, _ = load_config("micro")
    compile_cfg = dataclasses.replace(compile_cfg, speculative="dspark")  # as the bundle was compiled
    parts = build_steps_for_config(model_cfg, compile_cfg, micro_stablehlo / "cache", probes=True, target="neuron")
    session = Session.load(micro_stablehlo / "bundle")
    hasher = NgramHasher(parts.host_params["engram"])
    _, plan = _micro_plan()
    measured = {}
    for pb in plan.buckets:
        graph = step_graph(parts.steps, pb)
        prefill_len = min(b.seq_len for b in plan.buckets if b.kind == "prefill" and b.batch == pb.batch)
        inputs = bucket_inputs(parts.steps, hasher, model_cfg, pb, prefill_len)
        got = session.runner.executable(pb.kind, pb.batch, pb.length).run(inputs)
        report = compare_outputs(model_cfg, pb.label, graph.outputs, got, eager_outputs(graph.module, inputs))
        measured[pb.label] = logits_within_floor(report)
        assert not [a.name for a in report.outputs if a.zero_mismatch], pb.label
        logits = next(a for a in report.outputs if a.name.endswith("logits"))
        assert math.isfinite(logits.max_rel) and logits.cos > 0.9, (pb.label, logits)
        if pb.kind == "draft":  # in one GEMM order both ways (no floor): the same block to fp32 rounding
            assert logits.max_rel < 1e-4, (pb.label, logits)
    assert len(measured) == 12
    bundle, floor = (sum(v[i] for v in measured.values()) / len(measured) for i in (0, 1))
    assert bundle <= floor, measured


@pytest.fixture(scope="module")
def micro_runner(micro_stablehlo):
    """One runner of the micro StableHLO bundle for the tests that run it: XLA compiles each module
    once, on first use."""
    from dsneuron.runtime_min.session import Session

    return Session.load(micro_stablehlo / "bundle").runner


def test_a_prompt_runs_as_chunks_on_the_stablehlo_bundle(micro_runner):
    """The neuron target's chunk buckets, run on XLA:CPU through the runtime: a 40-token prompt as a
    prefill of 16 and chunks of 16 (each padded to the static chunk of 64) gives the one-shot
    prefill's logits within 1 - cos < 0.02 (two graphs sum in two orders, and micro's random weights
    turn a last-bit difference into a flipped expert or top-k choice now and then: measured 2e-5
    and 5e-3 in two processes; a chunk fed past its capacity, out of contract, measured 0.21), and
    a prefix-cache start after 32 tokens gives the chunked run's logits bit for bit (its last chunk
    call, from the same state)."""
    import torch

    from dsneuron.compiler.compare import logit_metrics

    runner = micro_runner
    assert runner.lengths("chunk", 1) == [64]
    ids = torch.randint(3, 128000, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    whole = runner.prefill_job(ids).run()
    chunked = runner.prefill_job(ids, chunk=16).run()
    assert chunked.bucket.kind == "chunk"
    assert 1 - logit_metrics(chunked.logits[0], whole.logits[0])["cos"] < 0.02
    first = runner.prefill_job(ids[:32], chunk=16).run()
    resumed = runner.prefill_job(ids, prefix=(32, runner.snapshot(first.state, 0))).run()
    assert resumed.bucket.kind == "chunk"
    assert torch.equal(resumed.logits[0], chunked.logits[0])


class _OracleDrafter:
    """TEST-ONLY drafter: proposes the continuation of `seq` (prompt + plain greedy tokens) after
    the fed token, with draft `wrong_at` replaced by another token in every step (None: never
    wrong). It reads nothing of the model: the verify's mechanics, not a drafter."""

    block = 3  # micro's dspark_block_size

    def __init__(self, seq: list[int], wrong_at: int | None):
        self.seq, self.wrong_at = seq, wrong_at
        self.seeded: list[tuple[int, ...]] = []

    def start(self, batch):
        return None

    def seed(self, cache, main_hidden, start, count):
        self.seeded.append(tuple(main_hidden.shape))
        return None

    def propose(self, cache, token, pos, k, temperature, generator):
        out = torch.zeros(1, k, dtype=torch.int64)
        for j in range(k):
            t = self.seq[min(int(pos[0]) + 2 + j, len(self.seq) - 1)]
            out[0, j] = t + 1 if j == self.wrong_at else t
        return out, None


def _same_or_a_flip_the_logits_explain(got: list[int], got_logits, want: list[int], want_logits) -> int:
    """How many leading tokens of `got` are `want`'s; where they first differ, the two best logits
    of the plain run lie closer than the two runs' logits differ there (two modules summing in two
    orders flip a near tie, nothing else)."""
    n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    if n < len(want):
        top = want_logits[n].topk(2).values
        assert float(top[0] - top[1]) <= 2 * float((got_logits[n] - want_logits[n]).abs().max()), (n, top)
    return n


def test_speculation_runs_on_the_stablehlo_verify_buckets(micro_runner):
    """DSpark's verify on the neuron target's own buckets, run on XLA:CPU through the runtime.
    Teacher-forced: a verify of 4 tokens gives the logits plain decode steps give for them, at 2
    of the 4 positions within 1 - cos < 0.02 (the chunk test's bound) and at all within 0.5 (two
    modules sum in two orders, and XLA:CPU's order varies between processes; micro's random
    weights turn such a last-bit difference into a flipped expert choice now and then: measured
    1e-14 at three positions and 6e-4 at the fourth alone, 5e-3 and 0.145 in the full suite's
    process; on an AVX2-only host in the full suite 0.005, 0.006, 0.068 and 0.144), and main_hidden bf16 [1, 4, T*D]. Generated, with a TEST-ONLY oracle drafter (always right, or
    wrong at its second draft: a replay every step): plain greedy decoding's tokens, or the same
    up to a flip that the two runs' logits explain; the oracle's drafts kept (mean acceptance
    above 2 of at most 4); main_hidden seeding the drafter after the prefill (the prefill bucket
    returns the prompt's last window_size positions) and after every verify. The bundle's own
    drafter, eager and as its draft bucket (what `run` and `serve` draft with), through the
    loop and through the scheduler (`serve --speculative-tokens`): the first token the plain
    run's, every request to its length."""
    from dsneuron.compiler.compare import logit_metrics
    from dsneuron.graphs.config import ModelConfig
    from dsneuron.graphs.dspark import bundle_drafter
    from dsneuron.runtime_min.core import speculative as sp
    from dsneuron.runtime_min.core.drafter import CompiledDrafter
    from dsneuron.runtime_min.core.scheduler import Request
    from dsneuron.runtime_min.session import Session

    runner = micro_runner
    cfg = ModelConfig.from_dict(runner.manifest.model_config)
    T = len(cfg.dspark_target_layer_ids)
    prompt, n = [5, 17, 23, 99, 1234, 40000], 10
    step = runner.prefill([prompt], 1)
    tokens, chosen, states = [int(step.logits[0].argmax())], [step.logits[0]], [step.state]
    while len(tokens) < n:
        step = runner.decode(torch.tensor([tokens[-1]]), torch.tensor([len(prompt) + len(tokens) - 1]), states[-1])
        states.append(step.state)
        tokens.append(int(step.logits[0].argmax()))
        chosen.append(step.logits[0])
    v = runner.verify(torch.tensor([tokens[:4]]), torch.tensor([len(prompt)]), torch.tensor([4]), states[0],
                      cfg.dspark_target_layer_ids)
    assert v.main_hidden.shape == (1, 4, T * cfg.dim) and v.main_hidden.dtype == torch.bfloat16
    far = sorted(1 - logit_metrics(v.logits[0, j], chosen[j + 1])["cos"] for j in range(4))
    assert far[1] < 0.02 and far[3] < 0.5, far

    target = sp.RunnerTarget(runner)
    for wrong_at in (None, 1):
        oracle = _OracleDrafter(prompt + tokens, wrong_at)
        res = sp.generate(target, oracle, [prompt], n, 3)
        # first the prefill's seed (its bucket's last min(window, 16) positions), then each verify's kept ones
        assert oracle.seeded[0] == (1, min(cfg.window_size, 16), T * cfg.dim)
        assert set(oracle.seeded[1:]) <= {(1, s, T * cfg.dim) for s in (1, 2, 3, 4)}
        kept = _same_or_a_flip_the_logits_explain(res.tokens[0], res.logits[0], tokens, chosen)
        if kept == n and wrong_at is None:
            assert res.stats.mean_acceptance > 2, res.stats
        elif kept == n:  # the second draft wrong: at most 2 tokens a step, a replay whenever one was offered
            assert max(res.stats.accepted) <= 2 and res.stats.replays > 0, res.stats
    eager = bundle_drafter(runner.bundle, cfg, runner.max_capacity, order="fused")
    compiled = CompiledDrafter(runner)
    for drafter in (eager, compiled):
        res = sp.generate(target, drafter, [prompt], n, 3)
        _same_or_a_flip_the_logits_explain(res.tokens[0], res.logits[0], tokens, chosen)

    session = Session(runner)

    def scheduled(speculation=None):
        sch = session.scheduler(speculation=speculation)
        reqs = [sch.submit(Request(session.encode(text), max_tokens=6)) for text in ("Hello there", "a")]
        sch.run()
        return [(r.generated, r.finish_reason) for r in reqs]

    speculation = sp.Speculation(compiled, 3)
    spec, plain = scheduled(speculation), scheduled()
    assert [(g[0], len(g), f) for g, f in spec] == [(g[0], 6, "length") for g, f in plain]
    assert speculation.counts.steps > 0


def test_the_draft_bucket_drafts_what_the_eager_drafter_drafts(micro_runner):
    """The drafter's bucket on XLA:CPU (runtime_min/core/drafter.py) against the eager DSpark from
    the bundle's stored tensors, both seeded with a verify's main_hidden (4 positions: one call)
    and then with 21 more positions (more than window_size 16: only the last 16 can stay, written
    in one call): the same greedy drafts, and rings that differ in at most 1 element in 1,000
    (an FP8 code of main_kv one rounding apart). Sampled: q is the softmax of the returned logits,
    each row a distribution. A batch of 2 rows fits no draft bucket: ValueError naming the
    largest."""
    from dsneuron.graphs.config import ModelConfig
    from dsneuron.graphs.dspark import bundle_drafter
    from dsneuron.runtime_min.core.drafter import CompiledDrafter

    runner = micro_runner
    cfg = ModelConfig.from_dict(runner.manifest.model_config)
    eager = bundle_drafter(runner.bundle, cfg, runner.max_capacity, order="fused")
    compiled = CompiledDrafter(runner)
    assert (compiled.block, compiled.seed_len, compiled.window) == (3, cfg.window_size, cfg.window_size)
    prompt = [5, 17, 23, 99, 1234, 40000]
    state = runner.prefill([prompt], 1).state
    v = runner.verify(torch.tensor([[7, 8, 9, 10]]), torch.tensor([6]), torch.tensor([4]), state,
                      cfg.dspark_target_layer_ids)
    g = torch.Generator().manual_seed(0)
    long = (torch.randn(1, 21, v.main_hidden.size(2), generator=g) * 4).to(torch.bfloat16)
    caches = [d.seed(d.start(1), v.main_hidden, v.pos, v.count) for d in (eager, compiled)]
    token, pos = torch.tensor([11]), torch.tensor([9])
    for step in range(2):
        drafts = [d.propose(c, token, pos, 3, 0.0, None)[0] for d, c in zip((eager, compiled), caches)]
        assert torch.equal(drafts[0], drafts[1]), (step, drafts)
        rings = [caches[0].rings[0], caches[1].rings[0]]
        assert float((rings[0] != rings[1]).float().mean()) <= 1e-3, step
        caches = [d.seed(c, long, torch.tensor([10]), torch.tensor([21])) for d, c in zip((eager, compiled), caches)]
        token, pos = torch.tensor([12]), torch.tensor([30])
    _, q = compiled.propose(caches[1], token, pos, 2, 0.7, torch.Generator().manual_seed(1))
    assert q.shape == (1, 2, cfg.vocab_size) and torch.allclose(q.sum(-1), torch.ones(1, 2, dtype=q.dtype))
    with pytest.raises(ValueError, match="largest draft bucket takes 1"):
        compiled.propose(compiled.start(2), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 3,
                         0.0, None)


def test_every_micro_stage_is_within_2_ulps_or_a_named_deviation(micro_stablehlo):
    """`dsneuron compare` on the probe bundle, one prompt: end to end within the floor; stage by
    stage, the golden stage re-run on the module's recorded input within 2 bf16 ulps, or one of
    the deviations a target that sums in its own order shows (compare.py `local_deviations`: an
    fp32 stage a few fp32 ulps off, an FP8/FP4 QDQ one quantisation step off at isolated
    elements, a QDQ inside a stage moving isolated elements, the attention reading a flipped
    compressed entry); every selection (top-k, candidates, experts) the golden's."""
    from dsneuron.compiler.compare import compare_bundle, end_to_end_verdict, local_deviations, worst_local

    reports = compare_bundle(micro_stablehlo / "bundle", [("short", "Hello")], n_decode=3,
                             cache_dir=micro_stablehlo / "cache", log=lambda line: None)
    (rep,) = reports
    assert end_to_end_verdict(rep)["ok"], end_to_end_verdict(rep)
    assert rep.stages and len(rep.steps) == 4
    unexplained = [d for d in local_deviations(rep) if d[3] is None]
    assert unexplained == [], unexplained
    assert worst_local(rep, "rows_differ") == ("", 0.0)
    json.dumps(rep.to_dict())  # what --json writes


@pytest.mark.slow
def test_tiny_smallest_buckets_within_the_floor_stage_by_stage(tmp_path, monkeypatch):
    """tiny's smallest prefill (b1 s128) and decode (b1 s1024) buckets as StableHLO, run by XLA
    through `dsneuron compare` on its probe bundle (several minutes)."""
    from dsneuron.compiler.compare import compare_bundle, end_to_end_verdict, local_deviations

    cfg = json.loads((Path(__file__).resolve().parent.parent / "compiler" / "configs" / "tiny.json").read_text())
    cfg["compile"].update(prefill_seq_lens=[128], decode_context_lens=[1024])
    (tmp_path / "tiny.json").write_text(json.dumps(cfg))
    assert run_cli(monkeypatch, "compile", "--config", str(tmp_path / "tiny.json"), "--target", "neuron",
                   "--stablehlo-only", "--probes", "--out", str(tmp_path / "b")) == 0
    (rep,) = compare_bundle(tmp_path / "b", [("short", "Hello world")], n_decode=2, log=lambda line: None)
    assert end_to_end_verdict(rep)["ok"], end_to_end_verdict(rep)
    assert [d for d in local_deviations(rep) if d[3] is None] == []

