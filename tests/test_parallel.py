"""Tensor and expert parallelism on the cpu target (compiler/parallel.py): a rank's shard holds what
the plan's placement rule says, two gloo processes (TP=2, EP=2) give one process's logits bit for
bit, and the chained sum is one process's order of adds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsneuron import UserError
from dsneuron.compiler.config import load_config
from dsneuron.compiler.parallel import Comm, check_shardable, held_bytes, run_sharded, shard_model
from dsneuron.compiler.placement import EXPERTS, TP, VOCAB, Parallel, placement
from dsneuron.graphs.golden import Golden


def _numels(model) -> dict[str, int]:
    return {n.replace("head.head.", "head."): p.numel() for n, p in model.named_parameters()}


def test_a_shard_holds_what_the_plans_placement_says(micro_cfg, micro_checkpoint):
    """Tensor by tensor, rank r of TP=2 / EP=2 keeps: all of a replicated (or host) tensor, half of
    a TP one, all or nothing of an expert (its EP group's experts), and its vocabulary rows of the
    embedding and head, as compiler/placement.py `placement` (which `dsneuron plan` counts) says."""
    max_len = load_config("micro")[1].max_seq_len
    par = Parallel(2, 2)
    per = -(-micro_cfg.vocab_size // 2)
    for rank in range(2):
        golden = Golden(micro_cfg, micro_checkpoint, max_len)
        before = _numels(golden.model)
        shard_model(golden.model, par, rank, Comm(rank, 1))
        after = _numels(golden.model)
        for name, n in before.items():
            where, got = placement(micro_cfg, par, name), after.get(name, 0)
            if where == EXPERTS:
                mine = int(name.split(".")[4]) // (micro_cfg.n_routed_experts // 2) == rank
                assert got == (n if mine else 0), name
            elif where == TP:
                assert got == n // 2, name
            elif where == VOCAB:
                rows = min(per, micro_cfg.vocab_size - rank * per) if name == "embed.weight" else per
                assert got == n // micro_cfg.vocab_size * rows, name
            else:
                assert got == n, name
        assert sum(after.values()) < 0.6 * sum(before.values())


@pytest.mark.parametrize("cpu_kernels", [False, True])
def test_two_ranks_give_one_process_tokens(micro_cfg, micro_checkpoint, micro_golden, cpu_kernels):
    """TP=2 with EP=2 over gloo: the prefill's and every decode step's logits are the single
    process's bit for bit (the ranks chain their partial sums in one process's order), in the
    golden's numerics and in the cpu target's (its kernels, the EP-sharded grouped-GEMM MoE)."""
    max_len = load_config("micro")[1].max_seq_len
    ids = [(37 * i + 11) % 5000 + 100 for i in range(24)]
    # the kernel run attaches prepared weights: on a model of its own, not the shared fixture's
    golden = Golden(micro_cfg, micro_checkpoint, max_len) if cpu_kernels else micro_golden
    one = [r.logits for r in golden.teacher_forced(ids, 16, cpu_kernels=cpu_kernels)]
    run = run_sharded(micro_cfg, micro_checkpoint, max_len, Parallel(2, 2), ids, 16, cpu_kernels=cpu_kernels,
                      timed=cpu_kernels)
    assert len(run.logits) == len(one) == 9
    # timed: a warm prefill is subtracted from the full run (an unwarmed one made this negative)
    if cpu_kernels:
        assert run.decode_s > 0 and run.collective_s is not None, (run.decode_s, run.collective_s)
    else:
        assert run.decode_s is None and run.collective_s is None
    for a, b in zip(one, run.logits):
        assert torch.equal(a, b), (a - b).abs().max().item()
    # each process ran on its shard: under 60% of the model (attention, experts and vocabulary halved)
    full = held_bytes(micro_golden.model)
    assert len(run.held) == 2 and all(h < 0.6 * full for h in run.held), (run.held, full)


def test_plans_the_cpu_target_does_not_shard_are_refused(micro_cfg):
    with pytest.raises(UserError, match=r"split over tp/ep=2 ranks.*--ep 2"):
        check_shardable(micro_cfg, Parallel(2, 1))
    with pytest.raises(UserError, match=r"--tp 4: must divide model.o_groups=2"):
        check_shardable(micro_cfg, Parallel(4, 4))
    # what plan.check_parallel refuses (a fresh-clone trial found these reaching a ZeroDivisionError
    # and a misleading message)
    with pytest.raises(UserError, match=r"--tp 0: must be a positive integer"):
        check_shardable(micro_cfg, Parallel(0, 0))
    with pytest.raises(UserError, match=r"--ep 4: must divide --tp 2"):
        check_shardable(micro_cfg, Parallel(2, 4))


def test_bad_run_arguments_are_refused_before_any_rank_starts(micro_cfg, micro_checkpoint, tmp_path):
    ids = list(range(100, 110))
    for bad, match in (((ids, 0), "n_prompt must be in 1..10"), ((list(range(100, 200)), 5), "exceed the context"),
                       (([micro_cfg.vocab_size] + ids, 5), "token ids must be in 0..")):
        with pytest.raises(ValueError, match=match):
            run_sharded(micro_cfg, micro_checkpoint, 64, Parallel(2, 2), *bad)
    with pytest.raises(UserError, match="is not a folder"):
        run_sharded(micro_cfg, tmp_path / "missing", 64, Parallel(2, 2), ids, 5)


def test_a_row_parallel_sum_continued_from_the_previous_ranks_is_one_processes(micro_golden):
    """quant.block_partials split at any block and added in turn (what Comm.chain runs across ranks)
    gives block_scaled_matmul bit for bit; bad operands are refused."""
    from dsneuron.graphs import quant as Q

    g = torch.Generator().manual_seed(4)
    a = Q.fp8_activation(torch.randn(3, 5, 128, generator=g).bfloat16())
    w = micro_golden.model.layers[0].attn.wo_b.dequantized()  # [256, 128]
    want = Q.block_scaled_matmul(a, w)
    parts = Q.block_partials(a, w)
    assert parts.shape == (4, 3, 5, w.shape[0])
    for cut in (1, 2, 3):
        first = Q.add_blocks(torch.zeros_like(want), parts[:cut])
        assert torch.equal(Q.add_blocks(first, parts[cut:]), want)
    with pytest.raises(ValueError, match="block_partials: need a fp32"):
        Q.block_partials(a.bfloat16(), w)


def test_a_rank_outside_the_world_is_refused(micro_cfg, micro_golden):
    with pytest.raises(ValueError, match=r"rank must be in 0..1, got 2"):
        shard_model(micro_golden.model, Parallel(2, 2), 2, Comm(2, 2))


def _compiled_stages_rank(rank: int, world: int, args: dict) -> None:
    """A process of test_compiled_sharded_stages: rank `rank` of `world` (1: the unsharded model, no
    process group) runs micro's prefill stages eagerly in GEMM order "kernel", AOTInductor-compiles
    an attention half and a MoE half (each holds a chain, the MoE half two) and saves what the
    executables return on the eager run's inputs."""
    import torch.distributed as dist

    from dsneuron.compiler.backend_cpu import compile_cpu, effective_flags
    from dsneuron.compiler.lower import inline_mode
    from dsneuron.graphs.stages import build_stages, head_position
    from dsneuron.runtime_min.bundle.schema import engram_columns

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}", rank=rank, world_size=world)
    try:
        golden = Golden(args["cfg"], args["checkpoint"], args["max_len"])
        shard_model(golden.model, Parallel(world, world), rank, Comm(rank, world))
        golden.attach_kernel_weights()
        stages = build_stages(golden.model, "prefill", 1, args["max_len"], order="kernel")
        t = torch.tensor([args["ids"]])
        env = {"tokens": t, "valid_len": torch.tensor([t.shape[1]]), **engram_columns(golden.engram_ids(t))}
        env["last"] = head_position(env)
        compiled = {}
        with torch.inference_mode():
            for st in stages:
                inputs = [env[n] for n in st.inputs]
                if st.name in args["stages"]:
                    with inline_mode("cpu"):
                        program = torch.export.export(st.module, tuple(inputs), strict=False)
                    calls = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
                    path = Path(args["out"]) / f"{st.name}.w{world}r{rank}.pt2"
                    compile_cpu(program, path, effective_flags())
                    compiled[st.name] = (list(torch._inductor.aoti_load_package(str(path))(*inputs)), calls)
                env.update(zip(st.outputs, st.module(*inputs)))
        torch.save(compiled, Path(args["out"]) / f"w{world}r{rank}.pt")
    finally:
        if world > 1:
            dist.destroy_process_group()


@pytest.mark.slow  # about 60 s: two ranks and one process each compile two stages
def test_compiled_sharded_stages_give_the_unsharded_executables_bits(micro_cfg, micro_checkpoint, tmp_path):
    """AOTInductor executables of sharded stages (TP=2, EP=2), run in two gloo processes, call the
    chain ops and return what the unsharded executables return, bit for bit, on both ranks."""
    import torch.multiprocessing as mp

    from dsneuron.runtime_min.sharded import free_port

    names = ("layers.1.attn", "layers.1.ffn")
    args = {"cfg": micro_cfg, "checkpoint": micro_checkpoint, "max_len": load_config("micro")[1].max_seq_len,
            "ids": [(37 * i + 11) % 5000 + 100 for i in range(16)], "stages": names, "out": str(tmp_path),
            "port": free_port()}
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_compiled_stages_rank, args=(r, w, args)) for r, w in ((0, 2), (1, 2), (0, 1))]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    want = torch.load(tmp_path / "w1r0.pt")
    for r in range(2):
        got = torch.load(tmp_path / f"w2r{r}.pt")
        for name in names:
            outs, calls = got[name]
            assert "dsneuron.chain_recv.default" in calls and "dsneuron.chain_pass.default" in calls, calls
            assert "dsneuron.chain_recv.default" not in want[name][1]
            assert len(outs) == len(want[name][0])
            for a, b in zip(outs, want[name][0]):
                assert torch.equal(a, b), name


def test_bench_parallel_refuses_an_unwritable_json_before_running(tmp_path, capsys):
    """A --json the figures cannot be written to exits 2 on stderr before the minutes of runs."""
    from dsneuron.bench import parallel as bench_parallel

    for bad, says in ((tmp_path / "no" / "r.json", "does not exist"), (tmp_path, "is a folder")):
        with pytest.raises(SystemExit) as e:
            bench_parallel.main(["--config", "micro", "--json", str(bad)])
        assert e.value.code == 2
        assert says in capsys.readouterr().err
