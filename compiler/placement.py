"""Where a model's tensors and work live across ranks, and the instances a plan is made for.

The one parallel rule (`placement`) that `dsneuron plan` counts with and the sharded compile
(compiler/parallel.py, compiler/sharded_bundle.py) splits the checkpoint by, with its checks
(`check_parallel`) and the per-rank weight bytes it gives (`weight_bytes`).

Parallel plan (the one rule, `placement`; the sharding work is to reuse it):
- world size = TP ranks, one rank per logical NeuronCore (trn2 at its default LNC=2: 4 per chip;
  trn1: 2 per chip). Expert parallelism runs inside the same ranks, as NxDI's MoE models do
  (neuronx-distributed-inference models/config.py MoENeuronConfig moe_tp_degree / moe_ep_degree,
  whose product is the tp_degree): the TP ranks form EP groups of moe_tp = TP / EP ranks each.
  Rank r = g * moe_tp + j is member j of EP group g.
- Attention: TP over heads. wq_b (output rows of the rank's heads), wo_a (the columns of the
  rank's heads: its group's rows), wo_b (row-parallel over o_groups*o_lora_rank inputs) and
  attn_sink are split; the sparse attention and wo_a's grouped product run on the rank's heads.
  Replicated: wq_a and q_norm (q_norm normalises the whole q_lora_rank vector), wkv and kv_norm
  (one MQA latent), the compressor, the indexer (its score sums over all index heads and feeds one
  top-k; split, it would all-reduce an S x T score matrix), the hyper-connection mixes, every
  norm, the router gate.
- MoE: routed experts split over the EP groups (E / EP experts per group), each expert's
  intermediate dimension split over the moe_tp ranks of its group (w1/w3 output rows, w2 input
  columns). The shared expert is TP-split over all ranks on its intermediate dimension when that
  splits into whole 32-blocks (moe_inter_dim % (TP * 32) == 0), else replicated (V4.1 at TP=64:
  2304 / 64 = 36, replicated).
- Embedding and head: split over TP by vocabulary rows (ceil(V / TP) per rank, the last rank
  fewer).
- Engram: the tables stay on the host, which sends only the looked-up rows; engram.wkv is
  row-parallel (input columns) when n_cols*head_dim splits into whole 32-blocks, else replicated;
  q_weight / k_weight replicated.
- A split dimension must split into whole 32-blocks (the FP8/FP4 scale blocks): invalid --tp/--ep
  are refused with the limit they break.

Instances (`INSTANCES`, per rank = per logical NeuronCore): trn2 chip 96 GiB HBM, 2.9 TB/s, 8
NeuronCore-v3 (aws-neuron-sdk about-neuron/arch/neuron-hardware/trainium2.rst; HBM per chip also
in docs/planning.md "Instances"), trn2.48xlarge = 16 chips, 1536 GiB, 46.4 TB/s
(trn2-arch.rst); trn2.3xlarge = one trn2 chip (AWS EC2 instance-type page; not in the Neuron
docs); trn1 chip 32 GiB, 820 GB/s, 2 NeuronCore-v2; trn1.32xlarge = 16 chips, trn1.2xlarge = 1
(trn1-arch.rst). The cpu target is this host: one rank, its physical memory, and its read bandwidth
as `--bandwidth-gbs` gives it, else measured when the plan is made (bench/cpu_gemm.py
`stream_gbs`: a 1 GiB fp32 sum, median of 3; README's bench measured 16.6-25.4 GB/s on the
development VM); the header line and the JSON's instance note say which.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from dsneuron import UserError
from dsneuron.graphs.config import ModelConfig

GiB = 2**30
BLOCK = 32  # FP8/FP4 scale block: a split dimension must split into whole blocks

# ----------------------------------------------------------------------------------------- instances


@dataclass(frozen=True)
class Instance:
    """An instance type: `chips` accelerator chips of `hbm_per_chip` bytes and `bw_per_chip`
    bytes/s, `ranks_per_chip` ranks (logical NeuronCores at the default LNC) per chip."""

    name: str
    chips: int
    ranks_per_chip: int
    hbm_per_chip: int
    bw_per_chip: float
    note: str = ""

    @property
    def ranks(self) -> int:
        return self.chips * self.ranks_per_chip

    @property
    def hbm_per_rank(self) -> int:
        return self.hbm_per_chip // self.ranks_per_chip

    @property
    def bw_per_rank(self) -> float:
        return self.bw_per_chip / self.ranks_per_chip


_TRN2 = dict(ranks_per_chip=4, hbm_per_chip=96 * GiB, bw_per_chip=2.9e12,
             note="trn2 chip: 8 NeuronCore-v3 as 4 logical cores at LNC=2, 96 GiB HBM, 2.9 TB/s")
_TRN1 = dict(ranks_per_chip=2, hbm_per_chip=32 * GiB, bw_per_chip=820e9,
             note="trn1 chip: 2 NeuronCore-v2, 32 GiB HBM, 820 GB/s")
#: neuron instances by name (module docstring gives the sources)
INSTANCES: dict[str, Instance] = {
    "trn2.3xlarge": Instance("trn2.3xlarge", 1, **_TRN2),
    "trn2.48xlarge": Instance("trn2.48xlarge", 16, **_TRN2),
    "trn2u.48xlarge": Instance("trn2u.48xlarge", 16, **_TRN2),
    "trn1.2xlarge": Instance("trn1.2xlarge", 1, **_TRN1),
    "trn1.32xlarge": Instance("trn1.32xlarge", 16, **_TRN1),
    "trn1n.32xlarge": Instance("trn1n.32xlarge", 16, **_TRN1),
}
#: runs of the host bandwidth measurement (kernels_nki/host_limits.py stream_gbs), median taken
HOST_BANDWIDTH_RUNS = 3


def check_bandwidth(gbs: float) -> float:
    """`gbs` (GB/s, 1e9 bytes/s) when it is a finite number > 0; else UserError naming --bandwidth-gbs."""
    if not (math.isfinite(gbs) and gbs > 0):
        raise UserError(f"--bandwidth-gbs {gbs}: must be a finite number of GB/s > 0")
    return gbs


def host_instance(bandwidth_gbs: float | None = None) -> Instance:
    """The cpu target: this host as one rank with its physical memory and a read bandwidth of
    `bandwidth_gbs` GB/s, or, when None, the bandwidth measured now (`stream_gbs`: allocates and
    sums 1 GiB, about a second). The note says which. Raises UserError for a bad bandwidth_gbs."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if bandwidth_gbs is not None:
        gbs, how = check_bandwidth(bandwidth_gbs), "given by --bandwidth-gbs"
    else:
        from dsneuron.kernels_nki.host_limits import stream_gbs

        gbs = stream_gbs(HOST_BANDWIDTH_RUNS)
        how = f"measured (1 GiB fp32 sum, median of {HOST_BANDWIDTH_RUNS})"
    return Instance("host", 1, 1, mem, gbs * 1e9, note=f"this host's memory; read bandwidth {gbs:.1f} GB/s {how}")


def resolve_instance(target: str, name: str | None, bandwidth_gbs: float | None = None) -> Instance:
    """The instance of a plan; bandwidth_gbs: the cpu target's read bandwidth in GB/s (None:
    measured, `host_instance`). Raises UserError for an unknown target or instance, an instance or
    a bandwidth given with the neuron target, or a bad bandwidth."""
    if target == "cpu":
        if name is not None:
            raise UserError(f"--instance {name}: goes with --target neuron (the cpu target plans for this host)")
        return host_instance(bandwidth_gbs)
    if target != "neuron":
        raise UserError(f"--target {target!r}: must be cpu or neuron")
    if bandwidth_gbs is not None:
        raise UserError(f"--bandwidth-gbs {bandwidth_gbs}: goes with --target cpu (a neuron instance's bandwidth is "
                        "its chips' HBM bandwidth)")
    name = name or "trn2.48xlarge"
    if name not in INSTANCES:
        raise UserError(f"--instance {name!r}: unknown instance (known: {', '.join(INSTANCES)})")
    return INSTANCES[name]


# ----------------------------------------------------------------------------------------- parallel rule


@dataclass(frozen=True)
class Parallel:
    """tp ranks (the world size); ep expert-parallel groups inside them, moe_tp = tp / ep ranks each."""

    tp: int
    ep: int

    @property
    def world(self) -> int:
        return self.tp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep


def _splits(size: int, n: int) -> bool:
    """size splits n ways into whole FP8/FP4 scale blocks."""
    return size % (n * BLOCK) == 0


def default_parallel(cfg: ModelConfig, inst: Instance, tp: int | None, ep: int | None) -> Parallel:
    """--tp defaults to every rank of the instance, --ep to gcd(tp, n_routed_experts) (as many EP
    groups as the experts and ranks allow)."""
    tp = inst.ranks if tp is None else tp
    ep = math.gcd(tp, cfg.n_routed_experts) if ep is None else ep
    return Parallel(tp, ep)


def check_parallel(cfg: ModelConfig, par: Parallel, inst: Instance) -> None:
    """Refuse a tp/ep that the parallel rule cannot place (UserError naming the flag and the limit)."""
    tp, ep = par.tp, par.ep
    for flag, n in (("--tp", tp), ("--ep", ep)):  # one flag at a time: --ep's default derives from --tp
        if n < 1:
            raise UserError(f"{flag} {n}: must be a positive integer")
    if tp > inst.ranks:
        raise UserError(f"--tp {tp}: {inst.name} has {inst.ranks} rank{'s' if inst.ranks != 1 else ''}"
                        + (f" ({inst.chips} chips x {inst.ranks_per_chip} logical NeuronCores)" if inst.name != "host" else
                           " (the cpu target runs one process)"))
    if cfg.n_heads % tp:
        raise UserError(f"--tp {tp}: must divide model.n_heads={cfg.n_heads} (attention is split by heads)")
    if cfg.o_groups % tp and tp % cfg.o_groups:
        raise UserError(f"--tp {tp}: must divide model.o_groups={cfg.o_groups} or be a multiple of it "
                        "(each rank's heads must sit in whole output groups or in one group)")
    if not _splits(cfg.o_groups * cfg.o_lora_rank, tp):
        raise UserError(f"--tp {tp}: o_groups*o_lora_rank={cfg.o_groups * cfg.o_lora_rank} does not split into {tp} "
                        f"parts of whole {BLOCK}-blocks (wo_b is row-parallel)")
    if cfg.n_routed_experts % ep:
        raise UserError(f"--ep {ep}: must divide model.n_routed_experts={cfg.n_routed_experts}")
    if tp % ep:
        raise UserError(f"--ep {ep}: must divide --tp {tp} (expert parallelism runs inside the TP ranks: "
                        "tp = ep x moe_tp, as NxDI's moe_ep_degree x moe_tp_degree)")
    if not _splits(cfg.moe_inter_dim, par.moe_tp):
        raise UserError(f"--ep {ep}: each expert would be split over tp/ep={par.moe_tp} ranks, but "
                        f"model.moe_inter_dim={cfg.moe_inter_dim} does not split into {par.moe_tp} parts of whole "
                        f"{BLOCK}-blocks; use a larger --ep")


#: placements (`placement`)
REPLICATED, TP, VOCAB, EXPERTS, HOST, UNUSED = "replicated", "tp", "vocab", "experts", "host", "unused"
_TP_SPLIT = ("attn.wq_b", "attn.wo_a", "attn.wo_b", "attn.attn_sink")


def placement(cfg: ModelConfig, par: Parallel, name: str) -> str:
    """Where a checkpoint tensor (`layers.3.attn.wq_b.weight`, its `.scale`) or the FLOPs of a module
    (`layers.3.attn.wq_b`; `layers.3.attn` itself: the sparse attention and wo_a's grouped product;
    `layers.3.ffn` itself: the routed experts) live: REPLICATED on every rank, TP split evenly over
    the ranks, VOCAB split by vocabulary rows, EXPERTS (by EP group, then moe_tp), HOST (engram
    tables) or UNUSED (DSpark, not run in basic mode). The rule: module docstring."""
    if name.startswith("mtp."):
        return UNUSED
    if name.split(".")[0] in ("embed", "head"):
        return VOCAB
    if not name.startswith("layers."):
        return REPLICATED  # the final norm
    rest = name.split(".", 2)[2] if name.count(".") >= 2 else ""
    for suffix in (".weight", ".scale"):
        if rest.endswith(suffix):
            rest = rest[: -len(suffix)]
            break
    if rest.startswith("engram.embed"):
        return HOST
    if rest.startswith("engram.wkv"):
        n_in = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        return TP if _splits(n_in, par.tp) else REPLICATED
    if rest.startswith("ffn.experts") or rest == "ffn":
        return EXPERTS
    if rest.startswith("ffn.shared_experts"):
        return TP if _splits(cfg.moe_inter_dim, par.tp) else REPLICATED
    if rest in ("attn", *_TP_SPLIT):
        return TP
    return REPLICATED


def vocab_rows(cfg: ModelConfig, par: Parallel, rank: int) -> int:
    """How many vocabulary rows (embed / head) rank `rank` holds: ceil(V / tp) each, the rest on the last."""
    per = -(-cfg.vocab_size // par.tp)
    return max(0, min(per, cfg.vocab_size - rank * per))


def _expert_owner(cfg: ModelConfig, par: Parallel, name: str) -> tuple[int, ...]:
    """Ranks holding a slice of `layers.L.ffn.experts.E.*`: the moe_tp ranks of E's EP group."""
    e = int(name.split(".")[4])
    n_exp, _ = cfg.moe_experts(int(name.split(".")[1]))
    g = e // (n_exp // par.ep)
    return tuple(range(g * par.moe_tp, (g + 1) * par.moe_tp))


def spec_bytes(spec) -> int:
    """The bytes of one checkpoint tensor spec (graphs/spec.py: safetensors dtype name and shape)."""
    size = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}[spec.dtype]
    return size * math.prod(spec.shape)


def weight_bytes(cfg: ModelConfig, par: Parallel, spec: dict) -> list[dict[str, int]]:
    """Per rank, {placement: bytes} of the checkpoint tensors `spec` (graphs/spec.py) it holds;
    HOST and UNUSED are the totals kept off the device (the same on every rank's row)."""
    ranks = [dict.fromkeys((REPLICATED, TP, VOCAB, EXPERTS, HOST, UNUSED), 0) for _ in range(par.world)]
    for name, s in spec.items():
        where, n = placement(cfg, par, name), spec_bytes(s)
        if where in (REPLICATED, HOST, UNUSED):
            for r in ranks:
                r[where] += n
        elif where == TP:
            if n % par.tp:
                raise UserError(f"--tp {par.tp}: {name} ({n} bytes) does not split evenly")
            for r in ranks:
                r[TP] += n // par.tp
        elif where == VOCAB:
            row = n // s.shape[0]
            for i, r in enumerate(ranks):
                r[VOCAB] += row * vocab_rows(cfg, par, i)
        else:
            for i in _expert_owner(cfg, par, name):
                ranks[i][EXPERTS] += n // par.moe_tp
    return ranks


def device_bytes(w: dict[str, int]) -> int:
    """The bytes of a `weight_bytes` row that sit in the rank's HBM."""
    return w[REPLICATED] + w[TP] + w[VOCAB] + w[EXPERTS]


def rank_config(cfg: ModelConfig, par: Parallel) -> ModelConfig:
    """The model one rank computes under the parallel rule, for its activations: its heads (and
    output groups), its EP group's experts each cut to moe_inter_dim / moe_tp, its vocabulary
    rows; everything replicated unchanged. Not validated (it is not a model one would run)."""
    if par.tp == 1 and par.ep == 1:
        return cfg
    groups = cfg.o_groups // par.tp if cfg.o_groups % par.tp == 0 else 1
    n_exp = cfg.n_routed_experts // par.ep
    return dataclasses.replace(
        cfg, n_heads=cfg.n_heads // par.tp, o_groups=groups, n_routed_experts=n_exp,
        n_activated_experts=min(cfg.n_activated_experts, n_exp), moe_inter_dim=cfg.moe_inter_dim // par.moe_tp,
        vocab_size=-(-cfg.vocab_size // par.tp))
