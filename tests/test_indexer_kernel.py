"""The indexer on the FP4 MQA-logits op (compile option `indexer: kernel`, graphs.dispatch.fp4_index_scores):
the operand bytes it builds decode to the QDQ'd values exactly, its scores are the float64 oracle's
rounded once to bf16, the mode reaches the graphs, the manifest and the cache key, the neuron lowering
keeps the op (where the NKI kernel goes) and the cpu lowering inlines it on the dynamic prefill."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from dsneuron.compiler import backend_neuron
from dsneuron.compiler.config import CompileConfig, load_config
from dsneuron.compiler.export import export_step
from dsneuron.compiler.lower import custom_ops_in, finish, inline_mode
from dsneuron.compiler.model_steps import GraphsStepFactory, build_model_parts
from dsneuron.graphs.config import ConfigError
from dsneuron.graphs.dispatch import fp4_index_scores
from dsneuron.graphs.numerics import indexer_mode
from dsneuron.graphs.quant import INDEX_K_FORMAT, fp4_act_quant_qdq, fp4_operand_bytes, quantize_state
from dsneuron.kernels_nki.formats import E2M1_VALUES, dequantize_e2m1, neuron_spelling
from dsneuron.kernels_nki.mqa_logits_ref import mqa_logits_kernel_ref, mqa_logits_ref
from dsneuron.kernels_nki.neuron_adapters import call_mqa_logits
from oracles import bf16_rne
from stand_in import run_cli
from test_mqa_logits import DENSE_CASES, make_mqa_inputs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).view(torch.int16)


def _every_code_at_every_scale() -> torch.Tensor:
    """bf16 [N, 32] blocks of e2m1 values times 2^k, k = -126..125 (6 * 2^125 is below bf16's max):
    all 16 codes in order and shuffled, and blocks whose largest code is each of 0.5 .. 6."""
    g = torch.Generator().manual_seed(0)
    table = torch.tensor(E2M1_VALUES)
    blocks = []
    for k in range(-126, 126):
        every = table[torch.arange(16).repeat(2)]
        blocks += [every, every[torch.randperm(32, generator=g)]]
        for top in range(1, 8):
            b = table[torch.randint(0, top + 1, (32,), generator=g)]
            b[0] = table[top]
            blocks.append(b)
        blocks[-9:] = [b * 2.0 ** k for b in blocks[-9:]]
    return torch.stack(blocks).to(torch.bfloat16)


@pytest.mark.parametrize("neuron", [False, True], ids=["cpu-spelling", "neuron-spelling"])
def test_operand_bytes_decode_to_the_values_exactly(neuron):
    g = torch.Generator().manual_seed(1)
    qdq = fp4_act_quant_qdq((torch.randn(512, 128, generator=g) * torch.logspace(-30, 30, 512).unsqueeze(1))
                            .to(torch.bfloat16), 32, "ue8m0")
    for v in (_every_code_at_every_scale(), qdq):
        if neuron:
            with neuron_spelling():
                packed, sf = fp4_operand_bytes(v)
        else:
            packed, sf = fp4_operand_bytes(v)
        assert packed.dtype == sf.dtype == torch.uint8
        assert packed.shape == (*v.shape[:-1], v.shape[-1] // 2) and sf.shape == (*v.shape[:-1], v.shape[-1] // 32)
        assert torch.equal(_bits(dequantize_e2m1(packed, sf)), _bits(v))  # -0.0 included


def test_operand_bytes_keep_negative_zero_and_refuse_a_partial_block():
    v = torch.zeros(1, 32, dtype=torch.bfloat16)
    v[0, 3] = -0.0
    packed, sf = fp4_operand_bytes(v)
    assert (packed[0, 1] >> 4) == 8 and torch.signbit(dequantize_e2m1(packed, sf)[0, 3])
    with pytest.raises(ValueError, match="multiple"):
        fp4_operand_bytes(torch.zeros(2, 48))


def _indexer_inputs(seed: int, B: int = 2, S: int = 37, H: int = 4, D: int = 128, T: int = 29):
    g = torch.Generator().manual_seed(seed)
    q = fp4_act_quant_qdq(torch.randn(B, S, H, D, generator=g).to(torch.bfloat16), 32, "ue8m0")
    k = fp4_act_quant_qdq(torch.randn(B, T, D, generator=g).to(torch.bfloat16), 32, "ue8m0")
    w = (torch.randn(B, S, H, generator=g) * 0.1).to(torch.bfloat16)
    return q, k, w


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_scores_are_the_exact_score_rounded_once(seed):
    q, k, w = _indexer_inputs(seed)
    exact = np.einsum("bshd,btd->bsht", q.double().numpy(), k.double().numpy())
    exact = (np.maximum(exact, 0) * w.double().numpy()[..., None]).sum(2)
    got = fp4_index_scores(q, quantize_state(k, INDEX_K_FORMAT), w)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 37, 29)
    # FP4 x FP4 products and their 128-term sums are exact in fp32 at these magnitudes, so the one
    # rounding is the bf16 cast of the fp32 head sum: at most one bf16 step from the exact value
    ref = bf16_rne(exact)
    step = np.abs(np.spacing(ref.astype(np.float32)).astype(np.float64)) * 2 ** 16
    assert np.all(np.abs(got.double().numpy() - ref) <= step)
    assert np.mean(got.double().numpy() == ref) > 0.99
    # the official expression rounds each head's dot and product to bf16: a named deviation
    official = torch.ops.dsneuron.mqa_logits_bf16(q, k, w).double().numpy()
    assert 0.5 < np.mean(official == ref) < 0.99


def test_the_kernel_convention_reference_behind_the_adapter_is_the_op():
    """What a StableHLO consumer runs in mqa_logits_kernel's place (the decomposition of its
    composite, compiler/stablehlo.py), through the adapter, is the op."""
    for case in DENSE_CASES[:6]:
        args = make_mqa_inputs(case)
        got = call_mqa_logits(mqa_logits_kernel_ref, *args, case.t)
        assert torch.equal(got.float().nan_to_num(), mqa_logits_ref(*args, case.t).float().nan_to_num()), case.id


def test_kernel_scores_keep_each_sequence_to_its_own_keys():
    q, k, w = _indexer_inputs(2, B=3)
    k = quantize_state(k, INDEX_K_FORMAT)  # the cache rows the op reads
    both = fp4_index_scores(q, k, w)
    for b in range(3):
        assert torch.equal(both[b], fp4_index_scores(q[b:b + 1], k[b:b + 1], w[b:b + 1])[0])


def test_indexer_mode_is_validated_and_scoped():
    raw = {"max_seq_len": 64, "batch_sizes": [1], "prefill_seq_lens": [16], "decode_context_lens": [64]}
    assert CompileConfig.from_dict(raw).indexer == "official"
    assert CompileConfig.from_dict({**raw, "indexer": "kernel"}).indexer == "kernel"
    with pytest.raises(ConfigError, match="indexer: must be one of"):
        CompileConfig.from_dict({**raw, "indexer": "fp8"})
    with pytest.raises(ValueError, match="indexer_mode"):
        with indexer_mode("bf16"):
            pass


def test_cli_refuses_an_unknown_indexer_before_reading_anything(tmp_path, monkeypatch, capsys):
    code = run_cli(monkeypatch, "compile", "--config", "micro", "--indexer", "bogus", "--out", str(tmp_path / "b"),
                   "--cache-dir", str(tmp_path / "cache"))
    assert code == 2 and "--indexer: must be one of official, kernel" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / "cache").exists()


@pytest.fixture(scope="module")
def micro_parts(tmp_path_factory, micro_checkpoint):
    """build_model_parts of micro (one prefill bucket of 32, decode capacity 64) in indexer mode
    "kernel" per target, made on first use."""
    model_cfg, compile_cfg, _ = load_config("micro")
    compile_cfg = dataclasses.replace(compile_cfg, batch_sizes=(1,), prefill_seq_lens=(32,), decode_context_lens=(64,),
                                      checkpoint=str(micro_checkpoint), indexer="kernel")
    cache, made = tmp_path_factory.mktemp("idx_cache"), {}

    def parts(target: str):
        if target not in made:
            made[target] = build_model_parts(model_cfg, compile_cfg, cache, target=target)
        return made[target]
    return parts


def _index_stage(parts, kind: str):
    seq = 32 if kind == "prefill" else 1
    graphs = parts.steps.stages(kind, 1, seq, 64, 16 if kind == "prefill" else 0, 8 if kind == "prefill" else 1, 32)
    return next(sg for sg in graphs if "_index" in sg.kind)


def test_the_mode_changes_the_fingerprint(micro_cfg):
    official, kernel = GraphsStepFactory(micro_cfg, {}), GraphsStepFactory(micro_cfg, {}, indexer="kernel")
    assert official.indexer == "official" and official.fingerprint() != kernel.fingerprint()


def test_neuron_lowering_keeps_the_mqa_logits_op_where_the_nki_kernel_goes(micro_parts):
    """In kernel mode the neuron graph calls dsneuron::mqa_logits, which the neuron lowering answers
    with mqa_logits_kernel's op (the official bf16 expression has no NKI kernel and is inlined)."""
    lowering = backend_neuron.lowering()
    parts = micro_parts("neuron")
    sg = _index_stage(parts, "decode")
    exported = export_step(sg.graph, parts.weights, sg.name, backend_neuron.INPUT_VIEWS, lowering, module_order=True,
                           neuron_spelling=True)
    finish(exported.program, lowering, sg.name)
    ops = custom_ops_in(exported.program)
    assert "dsneuron::nki_mqa_logits" in ops and "dsneuron::mqa_logits_bf16" not in ops
    assert backend_neuron.kernel_sources()["dsneuron::mqa_logits"]["kernel"].endswith(":mqa_logits_kernel")


def test_cpu_lowering_inlines_the_op_on_the_dynamic_prefill_and_keeps_the_bits(micro_parts):
    parts = micro_parts("cpu")
    sg = _index_stage(parts, "prefill")
    lowering = inline_mode("cpu")
    exported = export_step(sg.graph, parts.weights, sg.name, {}, lowering, module_order=True)
    record = finish(exported.program, lowering, sg.name)
    assert record.get("dsneuron::mqa_logits") == "inline"
    assert "dsneuron::mqa_logits" not in custom_ops_in(exported.program)
    # at a shorter prompt than the example (the token dimension is dynamic), the inlined graph
    # computes what the eager stage computes
    S = 24
    examples = [t[:, :S].clone() if name in ("tokens", "h", "pre_mix") or name.endswith(".topk_idxs") else t
                for name, t in sg.graph.inputs]
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else t for t in examples]
    lens = [i for i, (name, _) in enumerate(sg.graph.inputs) if name == "valid_len"]
    for i in lens:
        inputs[i] = torch.full_like(inputs[i], S)
    weights = [parts.weights[n] for n in exported.weights]
    got = exported.program.module()(*weights, *inputs)
    with torch.no_grad():
        want = sg.graph.module(*inputs)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_manifest_records_the_mode(micro_bundle):
    manifest = json.loads((micro_bundle.path / "manifest.json").read_text())
    assert manifest["compiler"]["indexer"] == "official"
    assert manifest["compile_config"]["indexer"] == "official"
