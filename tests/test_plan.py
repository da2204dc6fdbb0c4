"""`dsneuron plan` (compiler/plan.py): the packaged v4.1-flash config, and the plan's numbers against
independent computations (checkpoint_spec sums, real init_state tensors, a real eager FLOP count),
TP/EP splits summing back to one rank, refused inputs, the printed table."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from stand_in import run_cli
from dsneuron.compiler import placement as PL
from dsneuron.compiler import plan as P
from dsneuron.compiler.buckets import PlannedBucket
from dsneuron.compiler.config import CompileConfig, load_config
from dsneuron.graphs.engram import engram_layout
from dsneuron.graphs.spec import checkpoint_spec


@functools.lru_cache(maxsize=8)
def _spec(cfg):
    return checkpoint_spec(cfg, engram_layout(cfg).num_embeddings)


# ------------------------------------------------------------------------------- the packaged config
def test_v41_flash_config_loads_validates_and_allocates_nothing():
    """load_config + engram layout + checkpoint_spec of the real model, in a fresh process: the
    engram tables have the released row counts, and peak RSS stays that of a bare torch import."""
    code = ("import resource, torch; base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "from dsneuron.compiler.config import load_config\n"
            "from dsneuron.graphs.engram import engram_layout\n"
            "from dsneuron.graphs.spec import checkpoint_spec\n"
            "m, c, _ = load_config('v4.1-flash'); m.validate()\n"
            "rows = engram_layout(m).num_embeddings; spec = checkpoint_spec(m, rows)\n"
            "print(list(rows), spec['layers.1.engram.embed.weight'].shape, m.dim, m.n_layers, c.max_seq_len,\n"
            "      (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.split(")")
    assert out[0].startswith("[384006168, 384016682] (384006168, 256"), r.stdout
    dim, layers, seq, rss_mib = map(int, r.stdout.split(")")[-1].split())
    assert (dim, layers, seq) == (5120, 40, 65536)
    assert rss_mib < 300, f"loading the v4.1-flash config grew RSS by {rss_mib} MiB"


# ------------------------------------------------------------------------------- weights and state
@pytest.mark.parametrize("name,tp,ep", [("micro", 4, 2), ("tiny", 8, 4), ("v4.1-flash", 64, 64), ("v4.1-flash", 32, 8)])
def test_weight_split_sums_back_to_one_rank(name, tp, ep):
    """Split placements sum over the ranks to the single-rank bytes, replicated ones are whole on
    every rank, and one rank holds every checkpoint byte that is neither on the host nor DSpark."""
    cfg = load_config(name)[0]
    spec = _spec(cfg)
    one = PL.weight_bytes(cfg, PL.Parallel(1, 1), spec)[0]
    assert sum(one.values()) == sum(PL.spec_bytes(s) for s in spec.values())
    assert one[PL.UNUSED] == sum(PL.spec_bytes(s) for n, s in spec.items() if n.startswith("mtp."))
    assert one[PL.HOST] == sum(PL.spec_bytes(s) for n, s in spec.items() if ".engram.embed." in n)
    many = PL.weight_bytes(cfg, PL.Parallel(tp, ep), spec)
    assert len(many) == tp
    split = sum(r[PL.TP] + r[PL.VOCAB] + r[PL.EXPERTS] for r in many)
    # what moved to replication (the shared expert, engram.wkv when they do not split) is counted once
    moved = many[0][PL.REPLICATED] - one[PL.REPLICATED]
    assert split + moved == one[PL.TP] + one[PL.VOCAB] + one[PL.EXPERTS]
    assert all(r[PL.REPLICATED] == many[0][PL.REPLICATED] for r in many)
    assert sum(r[PL.EXPERTS] for r in many) == one[PL.EXPERTS]


def test_v41_flash_weights_per_rank_at_tp64():
    """The numbers the README quotes: every rank holds the same bytes, the shared expert is
    replicated (2304 / 64 = 36 is not a whole number of 32-blocks), 6 experts per rank."""
    cfg = load_config("v4.1-flash")[0]
    spec = _spec(cfg)
    par = PL.Parallel(64, 64)
    ranks = PL.weight_bytes(cfg, par, spec)
    assert len({tuple(r.values()) for r in ranks}) == 1
    assert PL.placement(cfg, par, "layers.5.ffn.shared_experts.w1.weight") == PL.REPLICATED
    expert = sum(PL.spec_bytes(s) for n, s in spec.items() if n.startswith("layers.0.ffn.experts.0."))
    assert ranks[0][PL.EXPERTS] == 6 * 40 * expert
    assert PL._expert_owner(cfg, par, "layers.0.ffn.experts.383.w1.weight") == (63,)


def test_state_bytes_are_the_real_init_state_tensors():
    from dsneuron.graphs.steps import init_state

    for name in ("micro", "tiny"):
        cfg = load_config(name)[0]
        for batch, cap in ((1, 64), (2, 128)):
            real = sum(t.nbytes for t in init_state(cfg, batch, cap).values())
            assert P.state_bytes(cfg, batch, cap) == real


# ------------------------------------------------------------------------------- FLOPs
def test_custom_op_formulas_match_their_torch_references():
    """The two attention custom ops are counted by formula; their torch references (float64 bmm /
    einsum) counted by FlopCounterMode give the same number."""
    from dsneuron.kernels_nki.mqa_logits_ref import mqa_logits_bf16_ref
    from dsneuron.kernels_nki.sparse_attn_ref import sparse_attn_ref

    B, S, H, D, N, K = 2, 3, 4, 128, 100, 192
    q = torch.randn(B, S, H, D).to(torch.bfloat16)
    kv = torch.randn(B, N, D).to(torch.bfloat16)
    idx = torch.randint(-1, N, (B, S, K), dtype=torch.int32)
    with FlopCounterMode(display=False) as fc:
        sparse_attn_ref(q, kv, torch.zeros(H), idx, 0.1)
    assert fc.get_total_flops() == P._sparse_attn_flops(q.shape, kv.shape, (H,), idx.shape, 0.1)
    T = 37
    k = torch.randn(B, T, D).to(torch.bfloat16)
    w = torch.randn(B, S, H).to(torch.bfloat16)
    with FlopCounterMode(display=False) as fc:
        mqa_logits_bf16_ref(q, k, w)
    assert fc.get_total_flops() == P._mqa_logits_bf16_flops(q.shape, k.shape, w.shape)


def _real_step_flops(cfg, bucket: PlannedBucket, routed: bool = True) -> int:
    """FLOPs of one real eager step of `cfg` (uninitialised weights: the count does not depend on
    values), ascending order, the MoE in its routed loop (each expert on the tokens routed to it)
    or, routed=False, as the exported steps run it (expert blocks, graphs/moe_blocks.py)."""
    from dsneuron.graphs.model import Transformer
    from dsneuron.graphs.numerics import gemm_order
    from dsneuron.graphs.steps import decode, init_state, n_engram_cols, prefill
    from dsneuron.kernels_nki.formats import neuron_spelling

    model = Transformer(cfg, engram_layout(cfg).num_embeddings, bucket.capacity)
    for p in model.parameters():  # zeros: no NaN from uninitialised bytes
        p.data = torch.zeros_like(p)
    E, C = n_engram_cols(cfg)
    B, S = bucket.batch, bucket.seq_len
    tokens = torch.zeros(B, S, dtype=torch.int64)
    ids = torch.zeros(B, S, E, C, dtype=torch.int64)
    fc = FlopCounterMode(display=False, custom_mapping=P.custom_flops())
    with fc, gemm_order("ascending"), neuron_spelling(), torch.no_grad():
        if bucket.kind == "prefill":
            prefill(model, tokens, torch.full((B,), S), ids, routed=routed)
        else:
            decode(model, tokens, torch.full((B,), bucket.capacity - 1), ids, init_state(cfg, B, bucket.capacity), routed=routed)
    return fc.get_total_flops()


def test_decode_flops_match_a_real_count_and_split_over_ranks():
    cfg = load_config("micro")[0]
    b = PlannedBucket("decode", 1, 1, 64)
    flops, by_where = P.count_flops(cfg, PL.Parallel(1, 1), 64, b)
    assert flops == [_real_step_flops(cfg, b)]
    # micro's shared expert (128) and engram.wkv (128 inputs) split at tp 4 as at tp 1: same placements
    par = PL.Parallel(4, 2)
    assert all(PL.placement(cfg, par, n) == PL.placement(cfg, PL.Parallel(1, 1), n) for n in _spec(cfg) if "experts" not in n)
    split = P.flops_per_rank(cfg, par, by_where)
    assert math.isclose(sum(split), flops[0] + (par.world - 1) * by_where[PL.REPLICATED])
    assert split[0] == split[3] and by_where[PL.TP] > 0 and by_where[PL.EXPERTS] > 0


@pytest.mark.slow
def test_prefill_flops_match_a_real_count_of_the_exported_moe():
    """A prefill's count is the exported step's: its MoE in expert blocks, padded (between the
    routed loop's count and 1.25x its expert work)."""
    for name, s in (("micro", 32), ("tiny", 128)):
        cfg = load_config(name)[0]
        b = PlannedBucket("prefill", 1, s, 128 if name == "tiny" else 64)
        counted, by_where = P.count_flops(cfg, PL.Parallel(1, 1), b.capacity, b)
        assert counted == [_real_step_flops(cfg, b, routed=False)], name
        routed = _real_step_flops(cfg, b)
        assert routed < counted[0] <= routed + 0.25 * by_where[PL.EXPERTS], name


def test_v4_1_flash_prefill_expert_rows_within_the_pad_limit():
    """V4.1-Flash's neuron prefill buckets compute at most 1.25x the routed expert rows (every
    expert on every token was 384 / 6 = 64x)."""
    cfg = load_config("v4.1-flash")[0]
    for s in (1024, 4096, 16384):
        assert 1.0 <= P.expert_rows_factor(cfg, 0, s) <= 1.25
    assert P.expert_rows_factor(cfg, 0, 1) == 1.0  # a decode token gathers its 6 experts


# ------------------------------------------------------------------------------- refused inputs
@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "--tp 3: must divide model.n_heads=4"),
    (["--tp", "4", "--ep", "3"], "--ep 3: must divide model.n_routed_experts=8"),
    (["--tp", "256"], "--tp 256: trn2.48xlarge has 64 ranks"),
    (["--tp", "0"], "--tp 0: must be a positive integer"),  # not "--ep 8": that is the default derived from --tp
    (["--tp", "4", "--ep", "-2"], "--ep -2: must be a positive integer"),
    (["--instance", "trn9.huge"], "--instance 'trn9.huge': unknown instance"),
])
def test_bad_splits_and_instances_exit_2(monkeypatch, capsys, args, message):
    assert run_cli(monkeypatch, "plan", "--config", "micro", "--target", "neuron", *args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_plan_that_does_not_fit_exits_2_naming_the_numbers(monkeypatch, capsys):
    """V4.1-Flash on one trn2 chip: refused before any fake run, naming bucket, rank, need and have."""
    assert run_cli(monkeypatch, "plan", "--config", "v4.1-flash", "--target", "neuron", "--instance", "trn2.3xlarge") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "plan does not fit trn2.3xlarge: bucket decode b1 s65536 on rank 0 needs at least" in err, err
    assert "the rank has 24.00 GiB" in err


def test_cpu_target_counts_the_engram_tables_in_its_memory(monkeypatch, capsys):
    """On the cpu target the host is the rank: the 2 x 384M-row engram tables are in its memory."""
    assert run_cli(monkeypatch, "plan", "--config", "v4.1-flash") == 2
    err = " ".join(capsys.readouterr().err.split())
    need = float(err.split("needs at least ")[1].split(" GiB")[0])
    model = load_config("v4.1-flash")[0]
    w = PL.weight_bytes(model, PL.Parallel(1, 1), _spec(model))[0]
    assert w[PL.HOST] / 2**30 > 180 and need >= (PL.device_bytes(w) + w[PL.HOST]) / 2**30 - 0.01, err
    assert "the cpu target is this one host" in err and "--tp" not in err.split("GiB;")[-1], err


def test_cpu_target_takes_one_rank_and_no_instance(monkeypatch, capsys):
    assert run_cli(monkeypatch, "plan", "--config", "micro", "--instance", "trn2.48xlarge") == 2
    assert "--instance trn2.48xlarge: goes with --target neuron" in capsys.readouterr().err
    assert run_cli(monkeypatch, "plan", "--config", "micro", "--tp", "2") == 2
    assert "--tp 2: host has 1 rank (the cpu target runs one process)" in capsys.readouterr().err


# ------------------------------------------------------------------------------- the command
@pytest.mark.slow
def test_plan_command_prints_the_table_and_writes_json(monkeypatch, capsys, tmp_path):
    """micro with one prefill and one decode bucket on 4 trn2 ranks: the table rows, the JSON figures
    against the independent ones above, and the stage kinds of graphs/stages.py."""
    from dsneuron.graphs.stages import attn_kind

    model, _, _ = load_config("micro")
    cfg = tmp_path / "micro1.json"
    comp = CompileConfig(64, (1,), (16,), (64,))
    cfg.write_text(json.dumps({"model": model.to_dict(), "compile": comp.to_dict()}))
    out = tmp_path / "plan.json"
    monkeypatch.setenv("COLUMNS", "250")
    rc = run_cli(monkeypatch, "plan", "--config", str(cfg), "--target", "neuron", "--instance", "trn2.3xlarge",
                 "--tp", "4", "--ep", "2", "--json", str(out))
    text = capsys.readouterr().out
    assert rc == 0, text
    for needle in ("prefill b1 s16", "decode b1 s64", "0-3", "fits", "stage kinds to compile", "roofline"):
        assert needle in text, needle
    data = json.loads(out.read_text())
    assert data["fits"] and data["parallel"] == {"tp": 4, "ep": 2, "moe_tp": 2, "world": 4}
    spec = _spec(model)
    par = PL.Parallel(4, 2)
    assert data["weights_per_rank"] == PL.weight_bytes(model, par, spec)
    dec = data["buckets"][1]
    assert dec["state"] == P.state_bytes(model, 1, 64) and dec["activation"] > dec["activation_weight_copies"] > 0
    assert math.isclose(sum(dec["flops_by_placement"].values()), P.count_flops(model, PL.Parallel(1, 1), 64, PlannedBucket("decode", 1, 1, 64))[0][0])
    assert dec["need"][0] == dec["weights"][0] + dec["state"] + dec["activation"]
    assert set(data["stage_kinds"]) >= {attn_kind(model, L) for L in range(model.n_layers)}
    assert data["decode_read"]["total"] > 0 and data["roofline_s_per_token"] > 0


@pytest.mark.slow
def test_long_context_table_grows_with_the_capacity():
    """`plan --contexts`: per capacity the state is the state layout's bytes, a decode step reads
    the weights plus the state it touches (all of it but the compressed KV rows it does not
    attend to: `decode_state_read`), and a chunk is counted."""
    cfg, cc, _ = load_config("micro")
    plan = P.make_plan(cfg, cc, "neuron", "trn2.3xlarge", 4, 2, contexts=[256, 64], chunk_len=16)
    rows = plan.contexts
    assert [x.capacity for x in rows] == [64, 256]
    for x in rows:
        assert x.state == P.state_bytes(cfg, 1, x.capacity)
        assert x.decode_read == plan.decode["slowest_rank"] + P.decode_state_read(cfg, x.capacity)
        assert 0 < P.decode_state_read(cfg, x.capacity) <= x.state
        assert x.chunk_flops > 0 and x.chunk_activation > 0 and x.chunks == -(-(x.capacity - 16) // 16)
    assert 0 < rows[1].decode_read - rows[0].decode_read <= rows[1].state - rows[0].state
    assert rows[1].chunk_flops > rows[0].chunk_flops  # the indexer scores every compressed row
    assert "contexts" in plan.to_dict()


def test_decode_state_read_grows_by_the_indexer_keys_only():
    """Past index_topk compressed rows, a longer context adds to a decode step's reads only the
    indexer keys it scores: the compressed KV is read at the index_topk rows it attends to."""
    from dsneuron.compiler.plan import decode_state_read, state_bytes
    from dsneuron.graphs.steps import state_layout

    cfg = load_config("tiny")[0]
    small, large = 1024, 4096
    assert small // max(cfg.compress_ratios) > cfg.index_topk

    def index_k(capacity):
        return sum(shape[1] * shape[2] for name, (shape, _) in state_layout(cfg, 1, capacity).items()
                   if name.endswith(".index_k"))

    assert decode_state_read(cfg, large) - decode_state_read(cfg, small) == index_k(large) - index_k(small)
    assert decode_state_read(cfg, large) < state_bytes(cfg, 1, large)


# ------------------------------------------------------------------------------- the cpu target's bandwidth
def _micro_decode_only(tmp_path):
    """micro with one decode bucket only, as a config file (the fast plan: one fake decode run)."""
    model, _, _ = load_config("micro")
    cfg = tmp_path / "micro_decode.json"
    cfg.write_text(json.dumps({"model": model.to_dict(), "compile": CompileConfig(64, (1,), (16,), (64,)).to_dict()}))
    return cfg


def test_cpu_bandwidth_flag_sets_the_roofline_and_says_so(monkeypatch, capsys, tmp_path):
    """--bandwidth-gbs 40: the header names it as given, the JSON's per-rank bandwidth is 40e9 B/s and
    the roofline is the slowest rank's bytes at 40 GB/s; nothing is measured."""
    import dsneuron.kernels_nki.host_limits as host_limits

    monkeypatch.setattr(host_limits, "stream_gbs", lambda runs: pytest.fail("measured although --bandwidth-gbs was given"))
    monkeypatch.setenv("COLUMNS", "250")
    out = tmp_path / "plan.json"
    assert run_cli(monkeypatch, "plan", "--config", str(_micro_decode_only(tmp_path)), "--bandwidth-gbs", "40",
                   "--json", str(out)) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "read bandwidth 40.0 GB/s given by --bandwidth-gbs" in text, text
    data = json.loads(out.read_text())
    assert data["instance"]["bw_per_rank"] == 40e9
    assert math.isclose(data["roofline_s_per_token"], data["decode_read"]["slowest_rank"] / 40e9)


def test_cpu_bandwidth_is_measured_without_the_flag(monkeypatch):
    """Without --bandwidth-gbs the host's bandwidth is stream_gbs's figure (here a stand-in 12.5),
    and the note says it was measured; the real measurement is a positive finite figure."""
    import dsneuron.kernels_nki.host_limits as host_limits

    real = host_limits.stream_gbs(1)
    assert math.isfinite(real) and real > 0
    monkeypatch.setattr(host_limits, "stream_gbs", lambda runs: 12.5)
    inst = PL.resolve_instance("cpu", None)
    assert inst.bw_per_rank == 12.5e9 and "read bandwidth 12.5 GB/s measured" in inst.note, inst.note


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_bad_bandwidth_exits_2(monkeypatch, capsys, value):
    assert run_cli(monkeypatch, "plan", "--config", "micro", "--bandwidth-gbs", value) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--bandwidth-gbs" in err and "must be a finite number of GB/s > 0" in err, err


def test_bandwidth_flag_goes_with_the_cpu_target(monkeypatch, capsys):
    assert run_cli(monkeypatch, "plan", "--config", "micro", "--target", "neuron", "--bandwidth-gbs", "40") == 2
    assert "--bandwidth-gbs 40.0: goes with --target cpu" in capsys.readouterr().err
    assert run_cli(monkeypatch, "plan", "--config", "micro", "--bandwidth-gbs", "fast") == 2
