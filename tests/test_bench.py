"""The main benchmark's per-stage figures (bench/bundle.py): stage timers, bytes read, GEMM shapes."""

from __future__ import annotations

import os

import pytest

from dsneuron.bench.bundle import by_stage_kind, decode_bytes, gemm_shapes, stage_read_bytes
from dsneuron.runtime_min.session import Session


@pytest.fixture(scope="module")
def timed_decode(micro_bundle):
    """The micro bundle's session after a prompt and 4 decode steps run with the stage timers on."""
    session = Session.load(micro_bundle.path)
    ids = [0, 5, 9, 13, 17, 21, 25, 29, 33, 37]
    session.teacher_forced(ids, len(ids) - 4)  # loads the executables
    timers = session.runner.stage_timers()
    steps = session.teacher_forced(ids, len(ids) - 4)
    return session, timers, steps


def _bucket(session, kind):
    return next(b for b in session.manifest.buckets if b.kind == kind)


def test_stage_timers_time_every_stage_inside_the_step(timed_decode):
    session, timers, steps = timed_decode
    decode = _bucket(session, "decode")
    seconds = timers[("decode", decode.batch, decode.length)]
    assert set(seconds) == {st.name for st in decode.stages}
    assert all(s > 0 for s in seconds.values())
    assert sum(seconds.values()) <= sum(s.seconds for s in steps[1:])
    prefill = _bucket(session, "prefill")
    assert sum(timers[("prefill", prefill.batch, prefill.length)].values()) <= steps[0].seconds


def test_stage_read_bytes_match_the_checkpoint_bytes_a_token_reads(timed_decode, micro_bundle, micro_checkpoint):
    """Two independent counts: the executables' tensors (scales widened to fp32) and the checkpoint's
    safetensors headers (bench/bundle.py decode_bytes)."""
    session, _, _ = timed_decode
    model = micro_bundle.model_cfg.to_dict()
    read = stage_read_bytes(_bucket(session, "decode"), session.runner.weights, model)
    head = session.runner.weights["head.kernel_w"]
    assert read["head"] >= head.numel() * head.element_size()
    stored = decode_bytes(micro_checkpoint, model)
    assert stored <= sum(read.values()) <= 1.1 * stored


def test_by_stage_kind_sums_the_stages_of_a_kind(timed_decode):
    session, timers, steps = timed_decode
    decode = _bucket(session, "decode")
    seconds = timers[("decode", decode.batch, decode.length)]
    rows = by_stage_kind(decode, seconds, len(steps) - 1)
    assert sum(r["stages"] for r in rows) == len(decode.stages)
    ffn = next(r for r in rows if r["kind"].startswith("ffn"))
    assert ffn["stages"] == session.manifest.model_config["n_layers"]
    assert sum(r["s"] for r in rows) == pytest.approx(sum(seconds.values()) / (len(steps) - 1))


def test_gemm_shapes_of_a_prefill():
    from dsneuron.compiler.config import load_config

    model = load_config("tiny")[0].to_dict()  # widths that tell the projections apart
    shapes = gemm_shapes(model, 64)
    L, E, k = model["n_layers"], model["n_routed_experts"], model["n_activated_experts"]
    assert shapes[(64, model["dim"], model["q_lora_rank"])] == L  # wq_a
    assert shapes[(64 * k // E, model["dim"], model["moe_inter_dim"])] == 2 * E * L  # routed w1, w3 (FP4: K unpacked)
    # dim -> 512: shared w1, w3, attn.wkv (head_dim 512), a kv source's compressor wkv (+ wgate at ratio > 1)
    compressors = sum(1 + (model["compress_ratios"][i] > 1) for i in model["kv_source_layers"])
    assert shapes[(64, model["dim"], model["moe_inter_dim"])] == 3 * L + compressors
    r = model["compress_ratios"][model["index_source_layers"][0]]
    assert shapes[(64 // r, model["head_dim"], model["index_head_dim"])] >= 1  # indexer wk, on the compressed rows
    assert shapes[(1, model["dim"], model["vocab_size"])] == 1  # the head, at the last position
    assert not any(n == model["vocab_size"] and m == 64 for m, _, n in shapes)  # the embedding is a lookup


def test_numerics_side_by_side_table():
    """report_modes puts each numerics mode's prefill GFLOP/s (against its torch.mm bf16 and FMA
    peak), decode tok/s (against the roofline) and batch rows/s in one table; nothing for one mode."""
    import io

    from rich.console import Console

    from dsneuron.bench.bundle import report_modes

    def mode(prefill_s: float, decode_s: float) -> dict:
        return {"compile_cold_s": 60.0, "decode_step_s": {1: decode_s, 8: 2 * decode_s},
                "compiled": {"prefill_s": {715: prefill_s}, "decode_s": decode_s, "mm_bf16_gflops": 400.0,
                             "fma_peak_gflops": 200.0, "read_gbs": 20.0, "stages": {}}}

    r = {"config": "tiny", "host_cores": 2, "prefill_flops": {715: 100e9}, "decode_bytes": 400e6,
         "modes": {"exact": mode(1.0, 0.04), "fast": mode(0.5, 0.025)}}
    out = io.StringIO()
    report_modes(r, Console(file=out, width=400))
    text = out.getvalue()
    assert "100 GFLOP/s = 25% of torch.mm bf16 (400), 50% of FMA peak (200)" in text  # exact
    assert "200 GFLOP/s = 50% of torch.mm bf16 (400), 100% of FMA peak (200)" in text  # fast
    assert "40.00 tok/s = 80% of the 400 MB roofline at 20.0 GB/s" in text  # fast: 20 ms roofline / 25 ms
    assert "100.0 rows/s, 4.00x batch 1" in text  # exact: batch 8 at twice the step time
    out = io.StringIO()
    report_modes({**r, "modes": {"exact": r["modes"]["exact"]}}, Console(file=out))
    assert out.getvalue() == ""
    # a host without a bf16 dot product (torch.mm bf16 below the fp32 FMA peak): no share of it
    slow_mm = {k: {**v, "compiled": {**v["compiled"], "mm_bf16_gflops": 1.0}} for k, v in r["modes"].items()}
    out = io.StringIO()
    report_modes({**r, "modes": slow_mm}, Console(file=out, width=400))
    text = out.getvalue()
    assert "100 GFLOP/s = no bf16 GEMM on this host (torch.mm bf16 1, below the FMA peak), 50% of FMA peak" in text
    assert "% of torch.mm bf16" not in text


def test_decode_ab_puts_two_bundles_side_by_side(micro_bundle, capsys):
    """bench/decode_ab.py on the micro bundle against itself: one row for its decode batch and one
    for a prefill, both sides timed, the same logits on the same steps."""
    from dsneuron.bench.decode_ab import decode_round, main

    main([str(micro_bundle.path), str(micro_bundle.path), "--rounds", "2", "--steps", "3", "--position", "5",
          "--prefill", "5"])
    out = capsys.readouterr().out
    for label in ("1 ", "prefill 5 "):
        row = next(line for line in out.splitlines() if line.strip("│ ").startswith(label))
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert float(cells[1]) > 0 and float(cells[2]) > 0 and cells[4] == "yes", out
    seconds, logits = decode_round(Session.load(micro_bundle.path).runner, 1, 3, 5)
    assert seconds > 0 and len(logits) == 3 and not all(logits[0].equal(x) for x in logits[1:])
    # the same bundle with the exact kernels' scale folding off on the OLD side: the same logits
    main([str(micro_bundle.path), str(micro_bundle.path), "--rounds", "2", "--steps", "3", "--position", "5",
          "--old-env", "DSNEURON_EXACT_NO_FOLD=1"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip("│ ").startswith("1 "))
    assert row.strip("│").split("│")[4].strip() == "yes"
    assert "DSNEURON_EXACT_NO_FOLD" not in os.environ
    for bad in ("JUSTANAME", "=1", "==1"):
        with pytest.raises(SystemExit, match="NAME=VALUE"):
            main([str(micro_bundle.path), str(micro_bundle.path), "--old-env", bad])
    with pytest.raises(SystemExit) as missing:  # no traceback for a missing bundle: its reason, exit 2
        main([str(micro_bundle.path), str(micro_bundle.path) + "-missing"])
    assert missing.value.code == 2 and "missing" in capsys.readouterr().err
    for bad, says in ((["--rounds", "0"], "--rounds must be >= 1"), (["--prefill", "0"], "--prefill must be >= 1"),
                      (["--verify", "-1"], "--verify must be >= 0")):
        with pytest.raises(SystemExit, match=says):
            main([str(micro_bundle.path), str(micro_bundle.path), *bad])
    with pytest.raises(SystemExit) as long:  # a prompt past the largest prefill bucket: the runner's reason
        main([str(micro_bundle.path), str(micro_bundle.path), "--position", "5", "--prefill", "100000"])
    assert long.value.code == 2 and "100000 tokens" in capsys.readouterr().err


def test_decode_ab_environment_sets_for_old_and_unsets_for_new(monkeypatch):
    """The OLD side sees NAME=VALUE, the NEW side no NAME even when the caller exported it, and the
    caller's value comes back afterwards."""
    from dsneuron.bench.decode_ab import environment

    monkeypatch.setenv("DSN_TEST_AB", "caller")
    with environment("DSN_TEST_AB", "1"):
        assert os.environ["DSN_TEST_AB"] == "1"
    with environment("DSN_TEST_AB", None):
        assert "DSN_TEST_AB" not in os.environ
    assert os.environ["DSN_TEST_AB"] == "caller"
