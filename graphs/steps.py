"""The step API with explicit state: what each bucket's executable computes, and the eager golden.

    prefill(tokens[B,S], valid_len[B], engram_ids[B,S,E,C]) -> (logits[B,V] fp32, *state)
    decode(tokens[B,1], pos[B], engram_ids[B,1,E,C], *state) -> (logits[B,V] fp32, *state')
    prefill_chunk(tokens[B,S], pos[B], valid_len[B], engram_ids[B,S,E,C], *state) -> (logits[B,V] fp32, *state')
    verify_chunk(tokens[B,S], pos[B], valid_len[B], engram_ids[B,S,E,C], *state)
        -> (logits[B,S,V] fp32, main_hidden[B,S,T*D] bf16, *state')

Prefill starts a sequence at position 0, so it takes no state and returns a complete one. A chunk
(chunked prefill) continues a sequence from its state: row b's valid_len[b] tokens sit at
positions pos[b] .. pos[b] + valid_len[b] - 1 (any pos; right padding after), and the call reads
and extends the window ring, the compressed KV, the compressor's pending partial group, the indexer
keys and the candidate blocks exactly as that many decode steps in order would. The official
reference has no chunked prefill (prefill only at start_pos 0, decode one token at a time:
deepseek-ai/DeepSeek-V4.1-Flash:inference/generate.py), so a chunk's numerics are the reference's decode
composed: each query attends over decode's index list at its position (the window W wide, oldest
first, then the compressed top-k over the whole cache), and its compressed groups pool the slots
decode would hold. With the golden's exact GEMMs a chunk is bit-identical to its decode steps
(tests/test_chunked_prefill.py). Logits are those of each row's last valid token. Engram hash ids
are computed on the host (`dsneuron.kernels_nki.engram_hash`); E = 0 for models without engram.

State layout (`state_layout`), all sized by batch B and context capacity M = max_seq_len:

| name | shape | dtype | what |
|---|---|---|---|
| layers.L.window_kv | [B, W, hd + hd/fp8_block_size] | uint8 | sliding-window ring, slot = position % W: FP8 e4m3 x UE8M0 |
| layers.L.compress_kv | [B, M // r, hd/2 + hd/16] | uint8 | kv-source L's compressed KV: FP4 e2m1 x e4m3 per 16 |
| layers.L.index_k | [B, M // r, ihd/2 + ihd/32] | uint8 | kv+index-source L's indexer keys: FP4 e2m1 x UE8M0 per 32 |
| layers.L.kv_state | [B, r, head_dim] | fp32 | ratio>1 source: tokens of the group being filled |
| layers.L.score_state | [B, r, head_dim] | fp32 | their gate scores (-inf = slot empty) |

hd = head_dim, ihd = index_head_dim. The three caches hold their values as the reference quantises
them, one row per token (or compressed group): the codes, then one scale byte per block
(graphs/quant.py `StateFormat`; e2m1 two to a byte, even element low; UE8M0 as its exponent byte).
Decoding a row gives exactly the QDQ'd bf16 values the model computes with.

The engram n-gram history is host state (the hasher keeps each row's last max_ngram-1 token ids).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig
from .context import Capture
from .model import Transformer
from .numerics import gemm_order, indexer_mode
from .quant import COMPRESS_KV_FORMAT, INDEX_K_FORMAT, StateFormat, window_format


def state_format(cfg: ModelConfig, name: str) -> tuple[StateFormat, int] | None:
    """(format, K values per row) of the byte-format state tensor `name` ("layers.L.window_kv",
    ".compress_kv", ".index_k"), None for the fp32 compressor state; decode its rows with
    quant.dequantize_state(rows, K, format)."""
    kind = name.rsplit(".", 1)[-1]
    if kind == "window_kv":
        return window_format(cfg.fp8_block_size), cfg.head_dim
    if kind == "compress_kv":
        return COMPRESS_KV_FORMAT, cfg.head_dim
    if kind == "index_k":
        return INDEX_K_FORMAT, cfg.index_head_dim
    return None


def state_layout(cfg: ModelConfig, batch: int, max_seq_len: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Ordered {name: (shape, dtype)} of the decode state; see the module docstring.

    Raises ValueError when max_seq_len is not a multiple of every compress ratio.
    """
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def rows(name: str, n: int) -> None:
        fmt, K = state_format(cfg, name)
        out[name] = ((batch, n, fmt.row_bytes(K)), torch.uint8)

    for L in range(cfg.n_layers):
        rows(f"layers.{L}.window_kv", cfg.window_size)
        r = cfg.compress_ratios[L]
        if L in cfg.kv_source_layers:
            if max_seq_len % r:
                raise ValueError(f"max_seq_len={max_seq_len} must be a multiple of compress ratio {r} (layer {L})")
            rows(f"layers.{L}.compress_kv", max_seq_len // r)
            if L in cfg.index_source_layers:
                rows(f"layers.{L}.index_k", max_seq_len // r)
            if r > 1:
                out[f"layers.{L}.kv_state"] = ((batch, r, cfg.head_dim), torch.float32)
                out[f"layers.{L}.score_state"] = ((batch, r, cfg.head_dim), torch.float32)
    return out


def init_state(cfg: ModelConfig, batch: int, max_seq_len: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A fresh state: zeros, except score_state at -inf (an empty compressor slot)."""
    state = {}
    for name, (shape, dtype) in state_layout(cfg, batch, max_seq_len).items():
        fill = -math.inf if name.endswith("score_state") else 0.0
        state[name] = torch.full(shape, fill, dtype=dtype, device=device)
    return state


def n_engram_cols(cfg: ModelConfig) -> tuple[int, int]:
    """(E, C): engram layers and hash columns per layer of the engram_ids input."""
    if not cfg.engram_layer_ids:
        return 0, 0
    return len(cfg.engram_layer_ids), (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads


def prefill(model: Transformer, tokens: torch.Tensor, valid_len: torch.Tensor, engram_ids: torch.Tensor,
            capture: Capture | None = None, routed: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """tokens int64 [B,S] (right-padded), valid_len int64 [B] in 1..S, engram_ids int64 [B,S,E,C]
    -> (logits fp32 [B,V] at position valid_len-1, state)."""
    B, S = tokens.shape
    positions = torch.arange(S, device=tokens.device).unsqueeze(0).expand(B, S)
    ctx = model.inputs(S, positions, valid_len, None, capture)
    state = init_state(model.cfg, B, model.max_seq_len, tokens.device)
    logits, new = model.run(tokens, ctx, engram_ids, state, valid_len - 1, routed)
    return logits, {name: new.get(name, state[name]) for name in state}


def decode(model: Transformer, tokens: torch.Tensor, pos: torch.Tensor, engram_ids: torch.Tensor, state: dict[str, torch.Tensor],
           capture: Capture | None = None, routed: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """tokens int64 [B,1] at positions pos int64 [B] (< max_seq_len) -> (logits fp32 [B,V], state')."""
    ctx = model.inputs(1, pos.unsqueeze(1), None, pos, capture)
    logits, new = model.run(tokens, ctx, engram_ids, state, torch.zeros_like(pos), routed)
    return logits, {name: new.get(name, state[name]) for name in state}


def prefill_chunk(model: Transformer, tokens: torch.Tensor, pos: torch.Tensor, valid_len: torch.Tensor,
                  engram_ids: torch.Tensor, state: dict[str, torch.Tensor], capture: Capture | None = None,
                  routed: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A chunk of a prefill (module docstring): tokens int64 [B,S] (right-padded), row b's
    valid_len[b] in 1..S tokens at positions pos[b] .. pos[b] + valid_len[b] - 1 (pos int64 [B],
    pos + valid_len <= max_seq_len), engram_ids int64 [B,S,E,C] (hashed with the history before
    pos), state at the model's capacity -> (logits fp32 [B,V] at each row's last valid token,
    state'). Padding positions past the capacity read the last RoPE row and write nothing."""
    B, S = tokens.shape
    positions = (pos.unsqueeze(1) + torch.arange(S, device=tokens.device)).clamp(max=model.max_seq_len - 1)
    ctx = model.inputs(S, positions, valid_len, pos, capture)
    logits, new = model.run(tokens, ctx, engram_ids, state, valid_len - 1, routed)
    return logits, {name: new.get(name, state[name]) for name in state}


class _Only(Capture):
    """A Capture of the named stage tensors alone (what a verify reads), so that the others are
    neither copied eagerly nor kept in a traced graph."""

    def __init__(self, names):
        super().__init__()
        self.names = frozenset(names)

    def __call__(self, name: str, t: torch.Tensor | None) -> None:
        if name in self.names:
            super().__call__(name, t)


def verify_chunk(model: Transformer, tokens: torch.Tensor, pos: torch.Tensor, valid_len: torch.Tensor,
                 engram_ids: torch.Tensor, state: dict[str, torch.Tensor], capture: Capture | None = None,
                 routed: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A speculative verify: `prefill_chunk` of the same inputs (the same state', bit for bit),
    returning instead of the last token's logits the logits fp32 [B,S,V] at every position (the
    head on each position's final stream, graphs/dspark.py `logits_from_capture`) and main_hidden
    bf16 [B,S,T*D] (the stream entering each DSpark target layer's attention, averaged over its hc
    copies: `main_hidden_from_capture`). Positions past a row's valid_len hold padding's values.
    capture: a full Capture to record every stage as well (a probe build); else only what the
    verify reads is recorded. Raises ValueError for a model without DSpark target layers."""
    from .dspark import logits_from_capture, main_hidden_from_capture, target_stream_names

    cfg = model.cfg
    if not cfg.dspark_target_layer_ids:
        raise ValueError("verify_chunk: the model has no DSpark target layers (dspark_target_layer_ids)")
    L = cfg.n_layers - 1
    cap = capture if capture is not None else _Only({f"layers.{L}.out", f"layers.{L}.hc_ffn.pre",
                                                      *target_stream_names(cfg)})
    _, state = prefill_chunk(model, tokens, pos, valid_len, engram_ids, state, cap, routed)
    return logits_from_capture(model, cap), main_hidden_from_capture(model, cap, tokens), state


def prefill_seed(model: Transformer, tokens: torch.Tensor, valid_len: torch.Tensor, engram_ids: torch.Tensor,
                 window: int, capture: Capture | None = None, routed: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """`prefill`, also returning main_hidden bf16 [B, W, T*D] (W = min(window, S)) at each row's
    last W prompt positions, max(0, valid_len - W) onward (a row shorter than W: its valid_len
    positions, then copies of its last): all of a prompt the DSpark drafter's rings keep (window =
    window_size rows; graphs/dspark.py `DSpark.seed`), from a graph that is read at one position
    (the neuron target's prefill, `--speculative dspark`) without returning the whole [B, S, T*D].
    capture: a full Capture to record every stage as well (a probe build)."""
    from .dspark import main_hidden_from_capture, target_stream_names

    if not model.cfg.dspark_target_layer_ids:
        raise ValueError("prefill_seed: the model has no DSpark target layers (dspark_target_layer_ids)")
    B, S = tokens.shape
    W = min(window, S)
    cap = capture if capture is not None else _Only(target_stream_names(model.cfg))
    logits, state = prefill(model, tokens, valid_len, engram_ids, cap, routed)
    hidden = main_hidden_from_capture(model, cap, tokens)
    first = (valid_len - W).clamp(min=0)
    rows = torch.minimum(first.unsqueeze(1) + torch.arange(W, device=tokens.device), (valid_len - 1).unsqueeze(1))
    return logits, hidden.gather(1, rows.unsqueeze(-1).expand(B, W, hidden.size(2))), state


class _Probes:
    """Stage probes of a step module: with `probes` set, the step also returns every tensor the
    model's Capture records (graphs.context), in `probe_names()` order, after the state.
    Used to build probe bundles for the stage-by-stage golden comparison (`dsneuron compare`)."""

    probes: bool = False
    _probe_names: list[str] | None = None

    def probe_names(self) -> list[str]:
        """Names of the captured stages at this step's shapes, found by one run on fake tensors
        (no arithmetic; a few seconds); [] without probes."""
        if not self.probes:
            return []
        if self._probe_names is None:
            from torch._subclasses.fake_tensor import FakeTensorMode
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            cap = Capture()
            with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()) as mode:
                self._run(*[mode.from_tensor(t) for t in self.example_inputs()], capture=cap)
            self._probe_names = list(cap.tensors)
        return self._probe_names

    def forward(self, *inputs):
        # _run returns (logits, [main_hidden,] state): what comes before the state is returned first
        cap = Capture() if self.probes else None
        *outs, state = self._run(*inputs, capture=cap)
        probes = [cap.tensors[n] for n in self.probe_names()] if cap is not None else []
        return (*outs, *[state[n] for n in self.state_names], *probes)


class PrefillStep(_Probes, nn.Module):
    """Exportable prefill at a fixed (batch, seq_len) bucket; weights are `model`'s parameters.

    order: the K-block order of every block-scaled GEMM (graphs.numerics.gemm_order); "fused" by
    default, one GEMM node per projection, which keeps the graph (and its compile time) small.
    indexer: the indexer mode (graphs.numerics.indexer_mode), "official" by default.
    probes: also return every captured stage tensor (see _Probes).
    seed_window: > 0: also return main_hidden at each row's last min(seed_window, S) positions
    (`prefill_seed`: what a speculative compile's drafter is seeded with).

    forward(tokens int64 [B,S], valid_len int64 [B], engram_ids int64 [B,S,E,C])
        -> (logits fp32 [B,V], [main_hidden bf16 [B,W,T*D],] *state tensors in state_layout order)
    """

    def __init__(self, model: Transformer, batch: int, seq_len: int, order: str = "fused", probes: bool = False,
                 indexer: str = "official", seed_window: int = 0):
        super().__init__()
        self.model, self.batch, self.seq_len, self.order, self.probes = model, batch, seq_len, order, probes
        self.indexer, self.seed_window = indexer, seed_window
        self.state_names = list(state_layout(model.cfg, batch, model.max_seq_len))

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        E, C = n_engram_cols(self.model.cfg)
        B, S = self.batch, self.seq_len
        return (torch.zeros(B, S, dtype=torch.int64), torch.full((B,), S, dtype=torch.int64),
                torch.zeros(B, S, E, C, dtype=torch.int64))

    def _run(self, tokens, valid_len, engram_ids, capture: Capture | None = None):
        with gemm_order(self.order), indexer_mode(self.indexer):
            if self.seed_window:
                return prefill_seed(self.model, tokens, valid_len, engram_ids, self.seed_window, capture)
            return prefill(self.model, tokens, valid_len, engram_ids, capture)


class DecodeStep(_Probes, nn.Module):
    """Exportable decode of one token per row at a fixed batch and the model's context capacity
    (order and indexer as in PrefillStep).

    forward(tokens int64 [B,1], pos int64 [B], engram_ids int64 [B,1,E,C], *state)
        -> (logits fp32 [B,V], *state')
    """

    def __init__(self, model: Transformer, batch: int, order: str = "fused", probes: bool = False,
                 indexer: str = "official"):
        super().__init__()
        self.model, self.batch, self.order, self.probes, self.indexer = model, batch, order, probes, indexer
        self.state_names = list(state_layout(model.cfg, batch, model.max_seq_len))

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        E, C = n_engram_cols(self.model.cfg)
        B = self.batch
        state = init_state(self.model.cfg, B, self.model.max_seq_len)
        return (torch.zeros(B, 1, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                torch.zeros(B, 1, E, C, dtype=torch.int64), *[state[n] for n in self.state_names])

    def _run(self, tokens, pos, engram_ids, *state_tensors, capture: Capture | None = None):
        with gemm_order(self.order), indexer_mode(self.indexer):
            return decode(self.model, tokens, pos, engram_ids, dict(zip(self.state_names, state_tensors)), capture)


class ChunkStep(PrefillStep):
    """Exportable chunk of a prefill (`prefill_chunk`) at a fixed batch, a fixed seq_len and the
    model's context capacity (constructed as PrefillStep): the neuron target's chunk bucket, whose
    shapes are static.

    forward(tokens int64 [B,S], pos int64 [B], valid_len int64 [B], engram_ids int64 [B,S,E,C], *state)
        -> (logits fp32 [B,V] at each row's last valid token, *state')
    """

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        E, C = n_engram_cols(self.model.cfg)
        B, S = self.batch, self.seq_len
        state = init_state(self.model.cfg, B, self.model.max_seq_len)
        return (torch.zeros(B, S, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                torch.full((B,), S, dtype=torch.int64), torch.zeros(B, S, E, C, dtype=torch.int64),
                *[state[n] for n in self.state_names])

    def _run(self, tokens, pos, valid_len, engram_ids, *state_tensors, capture: Capture | None = None):
        with gemm_order(self.order), indexer_mode(self.indexer):
            return prefill_chunk(self.model, tokens, pos, valid_len, engram_ids,
                                 dict(zip(self.state_names, state_tensors)), capture)


class VerifyStep(ChunkStep):
    """Exportable speculative verify (`verify_chunk`) at a fixed batch, a fixed seq_len (1 + k
    tokens: the last accepted token and k drafts) and the model's context capacity, constructed
    as PrefillStep: the bucket of a target whose graph cannot be tapped stage by stage (the neuron
    target's; the cpu target reads the same tensors from its staged chunk bucket).

    forward(tokens int64 [B,S], pos int64 [B], valid_len int64 [B], engram_ids int64 [B,S,E,C], *state)
        -> (logits fp32 [B,S,V], main_hidden bf16 [B,S,T*D], *state', *probes)
    """

    def _run(self, tokens, pos, valid_len, engram_ids, *state_tensors, capture: Capture | None = None):
        with gemm_order(self.order), indexer_mode(self.indexer):
            return verify_chunk(self.model, tokens, pos, valid_len, engram_ids,
                                dict(zip(self.state_names, state_tensors)), capture)
