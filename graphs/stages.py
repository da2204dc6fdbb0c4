"""The step functions as a sequence of stage graphs: the unit the cpu target compiles.

A step (graphs.steps.prefill / decode) runs embed -> [engram] -> block 0 -> ... -> block n-1 -> head,
and each block is two stages: its attention half and its MoE half (graphs.model Block.attn_sublayer,
Block.ffn_sublayer). Each stage is a module with positional tensor inputs and outputs, and a `kind`:
the structure of the stage (an attention half's compress ratio and its role as kv, index or
candidate source or consumer; a MoE half's expert counts; an engram; the embedding; the head),
independent of which layer it is. Stages of one kind trace to the same graph with other weights, so
a compiler builds one executable per kind and step shape and reuses it for every layer of that kind
(the compile cost grows with the layer kinds, not the layers: tiny's 10 layers are 6 attention kinds
and 1 MoE kind, V4.1-Flash's 40 are 6 and 1 as well). The MoE half is the larger graph and the same
in every layer, which is why it is a stage of its own: it is compiled once per step shape, not once
per attention kind, and it is the unit expert parallelism shards.

Values flow between stages by name (the bundle's wiring):

| name | shape | dtype | what |
|---|---|---|---|
| tokens | [B, S] | int64 | data input |
| valid_len / pos | [B] | int64 | data input of prefill / decode; a chunk takes both (start, tokens) |
| last | [B] | int64 | the position the head reads: valid_len - 1 / 0 (derived on the host, `head_position`) |
| engram_ids.e | [B, S, C] | int64 | the hash ids of the e-th engram layer (the host splits engram_ids) |
| h, pre_mix | [B, S, hc, D] / [B, S, hc] | bf16 / fp32 | the hyper-connection stream between stages |
| layers.L.<state> | graphs.steps.state_layout | | layer L's decode state (prefill: outputs only) |
| layers.L.topk_idxs | [B, S, index_topk] | int32 | index source L's compressed selections |
| layers.L.candidates | [B, S, T] | bool | candidate source L's candidate mask (T = S // ratio in prefill, the cache's rows in decode and chunk) |
| logits | [B, V] | fp32 | the head's output ([B, S, V] in a verify: every position's) |
| probe.<stage> | | | captured stage tensors (probe bundles only) |

A block that reads another layer's cache (a consumer of kv source K) takes `layers.K.compress_kv`
(and `layers.K.index_k`) as inputs: the source's updated state, written by an earlier stage of
the same step. Prefill stages make their layer's fresh state themselves and return it; decode and
chunk stages take it as inputs. A speculative verify runs the chunk's stages with the head at
every position (`HeadAllStage`) instead of the last.
Running the stages in order is bit-identical to the step function (tests/test_stages.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .cache_rows import writes_in_place
from .config import ModelConfig
from .context import Capture, step_inputs
from .model import Transformer, all_head_logits, embed_stream, engram_at, head_logits
from .numerics import gemm_order, indexer_mode, kernel_numerics
from .steps import init_state, state_layout

#: the data inputs of each step besides engram_ids; a chunk (graphs/steps.py prefill_chunk) is a
#: prefill continuing from state at per-row start positions `pos`
DATA = {"prefill": ("tokens", "valid_len"), "decode": ("tokens", "pos"), "chunk": ("tokens", "pos", "valid_len")}


@dataclass
class Stage:
    """One stage of a step: `module(*inputs) -> outputs`, wired by name.

    name: "embed", "layers.L.engram", "layers.L.attn", "layers.L.ffn" or "head"; kind: the
    structural key (stages of one kind and step shape share an executable); inputs / outputs:
    wiring names, positional (probe outputs last, named "probe.<captured name>"); layer: the layer
    index (None for embed / head); per_token: the stage needs nothing of its step but the tokens'
    own values (no position, state or other token: embed, engram, MoE half, and the head, which is
    told the position to read by "last"), so one executable over a dynamic token count serves
    prefill and decode alike.
    """

    name: str
    kind: str
    module: nn.Module
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    layer: int | None = None
    per_token: bool = False


def attn_kind(cfg: ModelConfig, layer: int) -> str:
    """The structural key of block `layer`'s attention half: compress ratio, and whether it is a kv
    source (owns a compressed cache), an index source (runs an indexer), the candidate source, or an
    index source filtered by candidates. Attention halves with equal keys trace to the same graph."""
    r = cfg.compress_ratios[layer]
    parts = [f"attn_r{r}"]
    if r:
        if layer in cfg.kv_source_layers:
            parts.append("kv")
        if layer in cfg.index_source_layers:
            parts.append("index")
            if layer == cfg.candidate_source_layer:
                parts.append("candsrc")
            elif 0 <= cfg.candidate_source_layer < layer:
                parts.append("candfilter")
    return "_".join(parts)


def ffn_kind(cfg: ModelConfig, layer: int) -> str:
    """The structural key of block `layer`'s MoE half: its routed and activated expert counts (the
    same for every main layer, so one kind)."""
    n, k = cfg.moe_experts(layer)
    return f"ffn_e{n}_k{k}"


def _own_state(cfg: ModelConfig, layer: int, batch: int, capacity: int) -> list[str]:
    """Names of layer `layer`'s own state tensors, in state-layout order."""
    return [n for n in state_layout(cfg, batch, capacity) if n.startswith(f"layers.{layer}.")]


def _shared_inputs(cfg: ModelConfig, layer: int) -> dict[str, str]:
    """{shared key: wiring name} a block reads from earlier layers (graphs.model Attention `shared`)."""
    r = cfg.compress_ratios[layer]
    out: dict[str, str] = {}
    if not r:
        return out
    kv = cfg.kv_source_of(layer)
    if kv != layer:
        out["compress_kv"] = f"layers.{kv}.compress_kv"
        if layer in cfg.index_source_layers:
            out["index_k"] = f"layers.{kv}.index_k"
    if layer not in cfg.index_source_layers:
        out["topk_idxs"] = f"layers.{cfg.index_source_of(layer)}.topk_idxs"
    elif 0 <= cfg.candidate_source_layer < layer:
        out["candidates"] = f"layers.{cfg.candidate_source_layer}.candidates"
    return out


def _shared_outputs(cfg: ModelConfig, layer: int) -> dict[str, str]:
    """{shared key: wiring name} a block publishes for later layers besides its state."""
    out: dict[str, str] = {}
    if cfg.compress_ratios[layer] and layer in cfg.index_source_layers:
        out["topk_idxs"] = f"layers.{layer}.topk_idxs"
        if layer == cfg.candidate_source_layer:
            out["candidates"] = f"layers.{layer}.candidates"
    return out


class _Captures(nn.Module):
    """Stage modules whose forward may also return captured tensors (probe bundles): with `probes`
    set, forward returns the captured tensors after its outputs, in the order of the first call
    (which fixes `probe_names`; `trace_stages` makes that call on fake tensors)."""

    probes: bool = False
    probe_names: tuple[str, ...] | None = None
    #: the GEMM order the stage runs or traces with (graphs.numerics.gemm_order)
    order: str = "ascending"
    #: the indexer mode it runs or traces with (graphs.numerics.indexer_mode)
    indexer: str = "official"
    #: the cpu kernels' numerics it runs or traces with (graphs.numerics.kernel_numerics)
    numerics: str = "exact"

    def forward(self, *inputs: torch.Tensor):
        with gemm_order(self.order), indexer_mode(self.indexer), kernel_numerics(self.numerics):
            return self.run(*inputs)

    def _capture(self) -> Capture | None:
        return Capture() if self.probes else None

    def _finish(self, outs: tuple[torch.Tensor, ...], cap: Capture | None) -> tuple[torch.Tensor, ...]:
        if cap is None:
            return outs
        if self.probe_names is None:
            self.probe_names = tuple(cap.tensors)
        return (*outs, *[cap.tensors[n] for n in self.probe_names])


class EmbedStage(_Captures):
    """tokens [B, S] -> (h, pre_mix)."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.embed, self.hc = model.embed, model.cfg.hc_mult

    def run(self, tokens: torch.Tensor):
        return self._finish(embed_stream(self.embed, self.hc, tokens), self._capture())  # captures nothing


class EngramStage(_Captures):
    """(h, engram_ids.e [B, S, C]) -> h: the engram of layer `layer`."""

    def __init__(self, model: Transformer, layer: int):
        super().__init__()
        self.engram, self.layer = model.layers[layer].engram, layer

    def run(self, h: torch.Tensor, hash_ids: torch.Tensor):
        cap = self._capture()
        return self._finish((engram_at(self.engram, self.layer, h, hash_ids, cap),), cap)


def _half(block: nn.Module, which: str) -> nn.Module:
    """A shallow copy of `block` (graphs.model Block) that shares its tensors and keeps only one half's
    modules, `which` ("attn" or "ffn") and `which`_norm, and its hc_`which`_* parameters and buffers."""
    half = copy.copy(block)
    half._modules = {k: v for k, v in block._modules.items() if k in (which, f"{which}_norm")}
    half._parameters = {k: v for k, v in block._parameters.items() if k.startswith(f"hc_{which}_")}
    half._buffers = {k: v for k, v in block._buffers.items() if k.startswith(f"hc_{which}_")}
    return half


class AttnStage(_Captures):
    """The attention half of block `layer` (graphs.model Block.attn_sublayer) in a prefill, decode
    or chunk step, with the RoPE tables; it holds only the attention's parameters, so attention
    halves of one kind have the same parameters and buffers.

    forward(h, pre_mix, valid_len | pos | pos and valid_len, *own state (decode, chunk), *shared inputs)
        -> (h, pre_mix, *own state, *shared outputs, *probes); the pre_mix out is the one the MoE
        half of the same layer collapses the stream with.

    in_place (decode only): the caches a decode step writes one row of (`in_place_names`: the
    window ring, the compressed KV and indexer keys) are written into the input tensors
    (graphs/cache_rows.py `writes_in_place`) and are not outputs; the caller owns those inputs
    (runtime_min/executors/executor_cpu.py StagedExecutable copies them once a step).
    """

    def __init__(self, model: Transformer, layer: int, step: str, batch: int, capacity: int, in_place: bool = False):
        super().__init__()
        cfg = model.cfg
        self.cfg, self.layer, self.step, self.capacity = cfg, layer, step, capacity
        self.block = _half(model.layers[layer], "attn")
        for name in ("rope_cos_0", "rope_sin_0", "rope_cos_1", "rope_sin_1"):
            self.register_buffer(name, getattr(model, name), persistent=False)
        self.state_names = _own_state(cfg, layer, batch, capacity)
        # the caches a decode step writes one row of, through graphs/cache_rows.py write_slot
        written = ("window_kv", "compress_kv", "index_k") if in_place and step == "decode" else ()
        #: the own state written in place (class docstring)
        self.in_place_names = tuple(n for n in self.state_names if n.endswith(written))
        #: the own state the stage returns: the rest
        self.returned_state = tuple(n for n in self.state_names if n not in self.in_place_names)
        self.shared_in = _shared_inputs(cfg, layer)
        self.shared_out = _shared_outputs(cfg, layer)

    @property
    def input_names(self) -> tuple[str, ...]:
        own = tuple(self.state_names) if self.step != "prefill" else ()
        return ("h", "pre_mix", *DATA[self.step][1:], *own, *self.shared_in.values())

    @property
    def output_names(self) -> tuple[str, ...]:
        return ("h", "pre_mix", *self.returned_state, *self.shared_out.values())

    def run(self, h: torch.Tensor, pre_mix: torch.Tensor, lens: torch.Tensor, *rest: torch.Tensor):
        B, S = h.shape[:2]
        cap = self._capture()
        if self.step == "prefill":
            positions = torch.arange(S, device=h.device).unsqueeze(0).expand(B, S)
            ctx = step_inputs(self, S, positions, lens, None, cap)
            fresh = init_state(self.cfg, B, self.capacity, h.device)
            state = {n: fresh[n] for n in self.state_names}
        elif self.step == "chunk":  # lens: the start positions, then the valid lengths (steps.prefill_chunk)
            valid_len, rest = rest[0], rest[1:]
            positions = (lens.unsqueeze(1) + torch.arange(S, device=h.device)).clamp(max=self.capacity - 1)
            ctx = step_inputs(self, S, positions, valid_len, lens, cap)
            state = dict(zip(self.state_names, rest[:len(self.state_names)]))
            rest = rest[len(self.state_names):]
        else:
            ctx = step_inputs(self, 1, lens.unsqueeze(1), None, lens, cap)
            state = dict(zip(self.state_names, rest[:len(self.state_names)]))
            rest = rest[len(self.state_names):]
        shared = dict(zip(self.shared_in, rest))
        new: dict[str, torch.Tensor] = {}
        if self.in_place_names:
            with writes_in_place():
                h, pre_mix = self.block.attn_sublayer(h, pre_mix, ctx, state, new, shared)
            for n in self.in_place_names:
                if new.get(n) is not state[n]:  # a write that did not go through write_slot
                    raise RuntimeError(f"layers.{self.layer} decode: {n} was not written in place")
        else:
            h, pre_mix = self.block.attn_sublayer(h, pre_mix, ctx, state, new, shared)
        outs = (h, pre_mix, *[new.get(n, state[n]) for n in self.returned_state], *[shared[k] for k in self.shared_out])
        return self._finish(outs, cap)


class FfnStage(_Captures):
    """The MoE half of block `layer` (graphs.model Block.ffn_sublayer): (h, pre_mix) -> (h, pre_mix).
    It has no state, position or shared input, so one kind serves every layer of the step."""

    def __init__(self, model: Transformer, layer: int):
        super().__init__()
        self.block, self.layer = _half(model.layers[layer], "ffn"), layer

    def run(self, h: torch.Tensor, pre_mix: torch.Tensor):
        cap = self._capture()
        return self._finish(self.block.ffn_sublayer(h, pre_mix, cap, routed=False), cap)


class HeadStage(_Captures):
    """(h, pre_mix, last) -> logits [B, V] at position last[b] of row b (`head_position`)."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.norm, self.head = model.norm, model.head

    def run(self, h: torch.Tensor, pre_mix: torch.Tensor, last: torch.Tensor):
        cap = self._capture()
        return self._finish((head_logits(self.norm, self.head, h, pre_mix, last, cap),), cap)


class HeadAllStage(_Captures):
    """(h, pre_mix) -> logits fp32 [B, S, V] at every position: a speculative verify's head, one
    read of the vocabulary projection for all of a call's positions (graphs/dspark.py
    `logits_from_capture`; graphs/model.py `all_head_logits`). Each position's logits are
    HeadStage's there: the kernels give a row the same bits whatever the rows beside it."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.norm, self.head = model.norm, model.head

    def run(self, h: torch.Tensor, pre_mix: torch.Tensor):
        cap = self._capture()
        return self._finish((all_head_logits(self.norm, self.head, h, pre_mix),), cap)


def head_position(env: dict[str, torch.Tensor]) -> torch.Tensor:
    """The wiring value "last", int64 [B]: the position within the call whose logits the head
    returns, valid_len - 1 in a prefill (env has valid_len), 0 in a decode step (env has pos).
    The runtime derives it the same way (runtime_min/executors/executor_cpu.py StagedExecutable)."""
    return env["valid_len"] - 1 if "valid_len" in env else torch.zeros_like(env["pos"])


def build_stages(model: Transformer, step: str, batch: int, capacity: int, order: str = "ascending",
                 indexer: str = "official", numerics: str = "exact", in_place: bool = False) -> list[Stage]:
    """The stages of a prefill, decode, chunk or verify step of `model` at (batch, capacity), in
    run order, each running with GEMM order `order` (the golden's "ascending" by default; the
    compiled steps trace theirs), indexer mode `indexer` and kernel numerics `numerics`; in_place: a
    decode step's attention stages write their one-row caches into their inputs (AttnStage). A
    verify is the chunk's stages with the head at every position (HeadAllStage, kind "head_all").
    Raises ValueError for an unknown step."""
    if step not in (*DATA, "verify"):
        raise ValueError(f"build_stages: step must be one of {(*DATA, 'verify')}, got {step!r}")
    verify, step = step == "verify", "chunk" if step == "verify" else step
    cfg = model.cfg
    stages = [Stage("embed", "embed", EmbedStage(model), ("tokens",), ("h", "pre_mix"), per_token=True)]
    for L in range(cfg.n_layers):
        if model.layers[L].engram is not None:
            e = cfg.engram_layer_ids.index(L)
            stages.append(Stage(f"layers.{L}.engram", "engram", EngramStage(model, L), ("h", f"engram_ids.{e}"), ("h",), L,
                                per_token=True))
        attn = AttnStage(model, L, step, batch, capacity, in_place)
        stages.append(Stage(f"layers.{L}.attn", attn_kind(cfg, L), attn, attn.input_names, attn.output_names, L))
        stages.append(Stage(f"layers.{L}.ffn", ffn_kind(cfg, L), FfnStage(model, L), ("h", "pre_mix"), ("h", "pre_mix"), L,
                            per_token=True))
    if verify:
        stages.append(Stage("head", "head_all", HeadAllStage(model), ("h", "pre_mix"), ("logits",), per_token=True))
    else:
        stages.append(Stage("head", "head", HeadStage(model), ("h", "pre_mix", "last"), ("logits",), per_token=True))
    for st in stages:
        st.module.order, st.module.indexer, st.module.numerics = order, indexer, numerics
    return stages


def with_probes(stages: list[Stage]) -> list[Stage]:
    """The stages with probe outputs on: each stage's outputs gain "probe.<captured name>" after
    its own, once `trace_stages` has fixed the names."""
    for st in stages:
        st.module.probes = True
    return stages


def trace_stages(stages: list[Stage], env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the stages on fake tensors made from `env` (no arithmetic; shapes and dtypes only) and
    return every wiring value's fake tensor. Fixes each probing stage's probe names and appends
    them to its outputs. A stage of a kind already traced on inputs of the same shapes and dtypes
    is not run again (its outputs are those of the first, as stages of one kind trace to one
    graph); a probing stage always runs, since its probe names carry its layer."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # static input shapes (env's); the shape env is there for data-dependent sizes (routed MoE)
    env = {**env, "last": head_position(env)}
    traced: dict[tuple, tuple[torch.Tensor, ...]] = {}
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()) as mode:
        values = {n: mode.from_tensor(t, static_shapes=True) for n, t in env.items()}
        for st in stages:
            args = [values[n] for n in st.inputs]
            key = (st.kind, *((tuple(a.shape), a.dtype) for a in args))
            if st.module.probes or key not in traced:
                traced[key] = st.module(*args)
            outs = tuple(torch.empty_like(t) for t in traced[key])
            if st.module.probes:
                own = tuple(n for n in st.outputs if not n.startswith("probe."))
                st.outputs = own + tuple("probe." + n for n in st.module.probe_names)
            values.update(zip(st.outputs, outs))
    return values


def step_outputs(cfg: ModelConfig, batch: int, capacity: int) -> tuple[str, ...]:
    """What a staged step returns, as the single-graph steps do: logits, then the state."""
    return ("logits", *state_layout(cfg, batch, capacity))


def run_stages(stages: list[Stage], env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run `stages` eagerly in order on the wiring values `env` (data inputs, and the state for a
    decode step); returns env with every stage output added (later writes of a name win), and
    "last" (`head_position`)."""
    env = {**env, "last": head_position(env)}
    for st in stages:
        outs = st.module(*[env[n] for n in st.inputs])
        env.update(zip(st.outputs, outs))
    return env
