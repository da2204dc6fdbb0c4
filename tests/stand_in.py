"""A small stand-in model with the step interface of graphs/steps.py, for compiler and runtime tests.

It has what the pipeline must handle in the real model, at toy size: weights of several dtypes
(fp32, bf16, fp8 e4m3 with an e8m0 scale; one fp32 weight stored bf16) shared by every step module, a non-persistent buffer
(embedded in each executable), engram ids added from a table, a custom op
(`dsneuron_test::gated_mix`, registered with torch.library like kernels_nki/ops.py), a state tensor
sized by the context capacity (`layers.L.kv`, one key row per position) and one that is not
(`layers.L.ring`, a sliding window of W rows, slot = position % W), right-padded prefill with a
valid length, and per-row decode positions.

Per layer, at position i with layer input x_i:  q = x W_q, k = x W_k (the key is also the value),
    a_i = softmax_j<=i(q_i . k_j / sqrt(D)) k_j,   w_i = sum of x_p over i-W < p <= i (zeros before 0),
    x'_i = gated_mix(x_i, a_i, 0.5) + 0.1 * w_i / W,      gated_mix(x, y, a) = x + a * tanh(y)
then logits_i = (rmsnorm(x_i) * g) @ head^T. `reference_logits` computes this directly in float64,
position by position, as the oracle for compiled prefill + decode.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import io
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

from dsneuron.compiler.compile import ModelParts, compile_bundle
from dsneuron.compiler.config import CompileConfig, load_config
from dsneuron.compiler.export import StepGraph
from dsneuron.graphs.config import ModelConfig
from dsneuron.kernels_nki.formats import ue8m0_to_float
from dsneuron.kernels_nki.engram_hash import NgramHasher

_GAIN = 0.5
_WINDOW_MIX = 0.1


@torch.library.custom_op("dsneuron_test::gated_mix", mutates_args=(), device_types="cpu")
def gated_mix(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """x + alpha * tanh(y); x, y fp32 of one shape. The torch reference the cpu lowering inlines."""
    return x + alpha * torch.tanh(y)


@gated_mix.register_fake
def _gated_mix_fake(x, y, alpha):
    return torch.empty_like(x)


@torch.library.custom_op("dsneuron_test::nki_gated_mix", mutates_args=(), device_types="cpu")
def nki_gated_mix(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """The call of a stand-in 'NKI kernel' of gated_mix (tests/test_neuron_target.py binds it the
    way kernels_nki/neuron_adapters.py binds the real kernels): the same values."""
    return x + alpha * torch.tanh(y)


@nki_gated_mix.register_fake
def _nki_gated_mix_fake(x, y, alpha):
    return torch.empty_like(x)


def in_order(kernel, *args, **kwargs):
    """A test adapter (kernels_nki/neuron_adapters.py NkiBinding.call): the kernel takes the op's
    arguments as they are."""
    return kernel(*args, **kwargs)


class StandInModel(nn.Module):
    """vocab_size V, dim D, n_layers, window W, engram (E, C) hash columns over a table of
    engram_rows rows. All weights are parameters without grad; `seed` makes them reproducible."""

    def __init__(self, vocab_size: int, window: int, dim: int = 16, n_layers: int = 2,
                 engram_dims: tuple[int, int] = (0, 0), engram_rows: int = 1, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        self.vocab_size, self.dim, self.window, self.engram_dims = vocab_size, dim, window, engram_dims
        self.embed = param(torch.randn(vocab_size, dim, generator=g))
        # an fp8 projection with a power-of-two e8m0 scale, as the real linears store them
        self.proj = param((torch.randn(dim, dim, generator=g) * 8).to(torch.float8_e4m3fn))
        self.proj_scale = param(torch.tensor([2.0 ** -round(math.log2(8 * dim ** 0.5))]).to(torch.float8_e8m0fnu))
        self.wq = nn.ParameterList([param(torch.randn(dim, dim, generator=g) / dim ** 0.5) for _ in range(n_layers)])
        self.wk = nn.ParameterList([param(torch.randn(dim, dim, generator=g) / dim ** 0.5) for _ in range(n_layers)])
        self.engram = param(torch.randn(engram_rows, dim, generator=g) * 0.1)
        # bf16 values held in fp32, as the real model promotes some bf16 checkpoint tensors at load
        self.norm = param((1 + 0.1 * torch.randn(dim, generator=g)).to(torch.bfloat16).float())
        self.head = param(torch.randn(vocab_size, dim, generator=g).to(torch.bfloat16))
        self.register_buffer("freq", torch.exp(-torch.arange(dim) / dim), persistent=False)

    def state_layout(self, batch: int, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out = {}
        for i in range(len(self.wq)):
            out[f"layers.{i}.kv"] = ((batch, capacity, self.dim), torch.float32)
            out[f"layers.{i}.ring"] = ((batch, self.window, self.dim), torch.float32)
        return out

    def init_state(self, batch: int, capacity: int) -> dict[str, torch.Tensor]:
        return {n: torch.zeros(shape, dtype=dt) for n, (shape, dt) in self.state_layout(batch, capacity).items()}

    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor, engram_ids: torch.Tensor) -> torch.Tensor:
        """tokens, positions int64 [B,S], engram_ids int64 [B,S,E,C] -> x fp32 [B,S,D]."""
        x = self.embed[tokens] + torch.sin(positions[..., None].float() * self.freq)
        x = x @ (self.proj.float() * ue8m0_to_float(self.proj_scale))
        return x + self.engram[engram_ids].sum(dim=(2, 3))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [B,D] -> logits fp32 [B,V]."""
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return y @ self.head.float().t()


class Prefill(nn.Module):
    """forward(tokens [B,S], valid_len [B], engram_ids [B,S,E,C]) -> (logits [B,V], *state at capacity)."""

    def __init__(self, model: StandInModel, capacity: int):
        super().__init__()
        self.model, self.capacity = model, capacity

    def forward(self, tokens, valid_len, engram_ids):
        m = self.model
        B, S = tokens.shape
        W, D = m.window, m.dim
        pos = torch.arange(S).expand(B, S)
        valid = (pos < valid_len[:, None])[..., None]
        x = m.embed_tokens(tokens, pos, engram_ids)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        last = valid_len - 1
        slots = torch.arange(W)
        # ring slot s holds the latest real position p <= last with p % W == s
        src = slots + W * torch.div(last[:, None] - slots, W, rounding_mode="floor")
        has = (src >= 0)[..., None]
        src = src.clamp(0, S - 1)[..., None].expand(B, W, D)
        state = []
        for wq, wk in zip(m.wq, m.wk):
            q, k = x @ wq, x @ wk
            scores = (q @ k.transpose(1, 2) / D ** 0.5).masked_fill(~causal, float("-inf"))
            attn = scores.softmax(-1) @ k
            csum = x.cumsum(1)
            shifted = torch.cat([torch.zeros(B, min(W, S), D), csum[:, :S - W] if S > W else csum[:, :0]], 1)
            wsum = csum - shifted[:, :S]
            kv = torch.cat([torch.where(valid, k, 0.0), torch.zeros(B, self.capacity - S, D)], 1)
            ring = torch.where(has, x.gather(1, src), 0.0)
            state += [kv, ring]
            x = torch.ops.dsneuron_test.gated_mix(x, attn, _GAIN) + _WINDOW_MIX * wsum / W
        x_last = x.gather(1, last[:, None, None].expand(B, 1, D))[:, 0]
        return (m.logits(x_last), *state)


class Decode(nn.Module):
    """forward(tokens [B,1], pos [B], engram_ids [B,1,E,C], *state) -> (logits [B,V], *state')."""

    def __init__(self, model: StandInModel, capacity: int):
        super().__init__()
        self.model, self.capacity = model, capacity

    def forward(self, tokens, pos, engram_ids, *state):
        m = self.model
        B = tokens.shape[0]
        W, D = m.window, m.dim
        x = m.embed_tokens(tokens, pos[:, None], engram_ids)
        seen = (torch.arange(self.capacity) <= pos[:, None])[:, None, :]
        new_state = []
        for i, (wq, wk) in enumerate(zip(m.wq, m.wk)):
            kv, ring = state[2 * i], state[2 * i + 1]
            q, k = x @ wq, x @ wk
            kv = kv.scatter(1, pos[:, None, None].expand(B, 1, D), k)
            ring = ring.scatter(1, (pos % W)[:, None, None].expand(B, 1, D), x)
            scores = (q @ kv.transpose(1, 2) / D ** 0.5).masked_fill(~seen, float("-inf"))
            attn = scores.softmax(-1) @ kv
            new_state += [kv, ring]
            x = torch.ops.dsneuron_test.gated_mix(x, attn, _GAIN) + _WINDOW_MIX * ring.sum(1, keepdim=True) / W
        return (m.logits(x[:, 0]), *new_state)


class StandInFactory:
    """The compiler's StepFactory for the stand-in: step graphs at any bucket, sharing `model`'s weights."""

    def __init__(self, model: StandInModel):
        self.model = model

    def fingerprint(self) -> str:
        """This file's source and the model's dimensions: everything the step graphs depend on."""
        m = self.model
        dims = (m.vocab_size, m.dim, len(m.wq), m.window, m.engram_dims, tuple(m.engram.shape))
        return hashlib.sha256(Path(__file__).read_bytes() + repr(dims).encode()).hexdigest()

    def init_state(self, batch: int, capacity: int) -> dict[str, torch.Tensor]:
        return self.model.init_state(batch, capacity)

    def prefill(self, batch: int, seq_len: int, capacity: int) -> StepGraph:
        E, C = self.model.engram_dims
        inputs = (("tokens", torch.zeros(batch, seq_len, dtype=torch.int64)),
                  ("valid_len", torch.full((batch,), seq_len, dtype=torch.int64)),
                  ("engram_ids", torch.zeros(batch, seq_len, E, C, dtype=torch.int64)))
        return StepGraph(Prefill(self.model, capacity), inputs, ("logits", *self.model.state_layout(batch, capacity)))

    def decode(self, batch: int, capacity: int) -> StepGraph:
        E, C = self.model.engram_dims
        state = self.model.init_state(batch, capacity)
        inputs = (("tokens", torch.zeros(batch, 1, dtype=torch.int64)), ("pos", torch.zeros(batch, dtype=torch.int64)),
                  ("engram_ids", torch.zeros(batch, 1, E, C, dtype=torch.int64)), *state.items())
        return StepGraph(Decode(self.model, capacity), inputs, ("logits", *state))


def weights_of(model: StandInModel) -> dict[str, torch.Tensor]:
    """The weights a bundle stores: every parameter, by its module path."""
    return {name: p.detach() for name, p in model.named_parameters()}


@torch.no_grad()
def reference_logits(model: StandInModel, tokens: list[int], engram_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Oracle: logits float64 [L, V] at every position of one sequence, computed directly from the
    formula in the module docstring (no state, no padding, no buckets). engram_ids int64 [L, E, C]."""
    m = model
    L, W, D = len(tokens), m.window, m.dim
    E, C = m.engram_dims
    ids = torch.zeros(L, E, C, dtype=torch.int64) if engram_ids is None else engram_ids
    f64 = torch.float64
    pos = torch.arange(L, dtype=f64)
    x = m.embed.to(f64)[torch.tensor(tokens)] + torch.sin(pos[:, None] * m.freq.to(f64))
    x = x @ (m.proj.to(f64) * 2.0 ** (m.proj_scale.view(torch.uint8).to(f64) - 127)) + m.engram.to(f64)[ids].sum(dim=(1, 2))
    for wq, wk in zip(m.wq, m.wk):
        q, k = x @ wq.to(f64), x @ wk.to(f64)
        out = torch.empty_like(x)
        for i in range(L):
            a = torch.softmax(k[:i + 1] @ q[i] / D ** 0.5, 0) @ k[:i + 1]
            w = x[max(0, i - W + 1):i + 1].sum(0)
            out[i] = x[i] + _GAIN * torch.tanh(a) + _WINDOW_MIX * w / W
        x = out
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * m.norm.to(f64)
    return y @ m.head.to(f64).t()


def byte_tokenizer(folder: Path) -> tuple[list[Path], dict[str, int]]:
    """Write a byte-level tokenizer.json (256 byte tokens + <bos> + <eos>, no merges) into `folder`.

    Multi-byte characters become several tokens, so streaming must hold back partial characters.
    Returns ([tokenizer.json path], {"bos": id, "eos": id, "vocab": size}).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<eos>"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    return [path, folder / "tokenizer_config.json"], {"bos": tok.token_to_id("<bos>"), "eos": tok.token_to_id("<eos>"),
                                                      "vocab": tok.get_vocab_size()}


def engram_params(vocab_size: int, n_layers: int = 2, max_ngram: int = 3, n_heads: int = 2) -> dict:
    """A valid NgramHasher params dict for a toy vocab: identity token map, small odd multipliers,
    distinct primes per (layer, n, head), offsets = exclusive prefix sums of each layer's primes."""
    primes_pool = [p for p in range(11, 400) if all(p % d for d in range(2, int(p ** 0.5) + 1))]
    it = iter(primes_pool)
    primes = [[[next(it) for _ in range(n_heads)] for _ in range(max_ngram - 1)] for _ in range(n_layers)]
    offsets, totals = [], []
    for layer in primes:
        flat = [p for row in layer for p in row]
        offsets.append([sum(flat[:i]) for i in range(len(flat))])
        totals.append(sum(flat))
    return {"layer_ids": list(range(n_layers)), "max_ngram_size": max_ngram, "n_heads": n_heads,
            "compressed_vocab_size": vocab_size, "pad_id": 0, "token_map": list(range(vocab_size)),
            "multipliers": [[2 * (7 * l + k) + 1 for k in range(max_ngram)] for l in range(n_layers)],
            "primes": primes, "offsets": offsets, "num_embeddings": totals}


# ---------------------------------------------------------------------------------------------- kits
# The stand-in bucket plan: one prefill bucket (batch 2, 8 tokens, state at capacity 8) and decode
# at capacities 8 and 16, so generation past position 7 grows the state. micro's model config
# supplies the plan constraints (ratios 1 and 2, candidate block 4 -> capacities multiple of 8),
# with the window and vocabulary of the stand-in.
STAND_IN_COMPILE = {"max_seq_len": 16, "batch_sizes": [2], "prefill_seq_lens": [8], "decode_context_lens": [8, 16]}
STAND_IN_WINDOW = 4


@dataclass
class Kit:
    """Everything to compile and check the stand-in: configs, the ModelParts, the model and hasher."""

    model_cfg: ModelConfig
    compile_cfg: CompileConfig
    parts: ModelParts
    model: StandInModel
    hasher: NgramHasher
    bos: int
    eos: int

    def greedy(self, tokens: list[int], n: int) -> list[int]:
        """Oracle greedy continuation of `tokens` by n tokens (no EOS stop)."""
        seq = list(tokens)
        for _ in range(n):
            ids = self.hasher.hash_sequence(torch.tensor([seq]))[0]
            seq.append(int(reference_logits(self.model, seq, ids)[-1].argmax()))
        return seq[len(tokens):]


def make_kit(folder: Path, compile_overrides: dict | None = None) -> Kit:
    """A stand-in kit whose tokenizer files live in `folder`."""
    tok_files, tok = byte_tokenizer(folder / "tok")
    base, _, _ = load_config("micro")
    model_cfg = dataclasses.replace(base, vocab_size=tok["vocab"], window_size=STAND_IN_WINDOW, bos_token_id=tok["bos"],
                                    eos_token_id=tok["eos"], dspark_noise_token_id=0)
    compile_cfg = CompileConfig.from_dict({**STAND_IN_COMPILE, **(compile_overrides or {})})
    params = engram_params(tok["vocab"])
    hasher = NgramHasher(params)
    model = StandInModel(tok["vocab"], STAND_IN_WINDOW, engram_dims=(hasher.n_layers, hasher.n_cols),
                         engram_rows=max(params["num_embeddings"]))
    parts = ModelParts(StandInFactory(model), weights_of(model), tok_files, {"engram": params},
                       stored_dtypes={"norm": torch.bfloat16})
    return Kit(model_cfg, compile_cfg, parts, model, hasher, tok["bos"], tok["eos"])


_SHARED: dict[str, tuple[Path, Kit]] = {}


def shared_bundle() -> tuple[Path, Kit]:
    """The stand-in bundle, really compiled once per test process (about 3 x 10 s of AOTInductor on
    an idle 2-core host) and shared read-only; copy it before changing anything. Also returns the
    kit; its compile cache sits beside the bundle (`<root>/cache`)."""
    if "bundle" not in _SHARED:
        root = Path(tempfile.mkdtemp(prefix="dsneuron-stand-in-"))
        atexit.register(shutil.rmtree, root, True)
        kit = make_kit(root)
        out = compile_bundle(kit.model_cfg, kit.compile_cfg, root / "bundle", kit.parts, cache_dir=root / "cache",
                             console=Console(file=io.StringIO()))
        _SHARED["bundle"] = (out, kit)
    return _SHARED["bundle"]


# The plan of the served stand-in (tests/test_server.py): batch buckets 1, 2 and 4, a prefill bucket
# that holds a short chat prompt of the byte tokenizer, and room to generate.
SERVE_COMPILE = {"max_seq_len": 128, "batch_sizes": [1, 2, 4], "prefill_seq_lens": [64], "decode_context_lens": [128]}


def serve_bundle() -> tuple[Path, Kit]:
    """The stand-in compiled with SERVE_COMPILE once per test process (6 AOTInductor compiles,
    about a minute on an idle 2-core host), shared read-only like `shared_bundle`; its folder is
    named `bundle`, the model name `dsneuron serve` gives it."""
    if "serve" not in _SHARED:
        root = Path(tempfile.mkdtemp(prefix="dsneuron-stand-in-serve-"))
        atexit.register(shutil.rmtree, root, True)
        kit = make_kit(root, SERVE_COMPILE)
        out = compile_bundle(kit.model_cfg, kit.compile_cfg, root / "bundle", kit.parts, cache_dir=root / "cache",
                             console=Console(file=io.StringIO()))
        _SHARED["serve"] = (out, kit)
    return _SHARED["serve"]


def run_cli(monkeypatch, *args) -> int:
    """Run `dsneuron ARGS` in-process through the console-script entry point; returns its exit code."""
    import sys

    from dsneuron.compiler import cli

    monkeypatch.setattr(sys, "argv", ["dsneuron", *args])
    try:
        cli.main()
    except SystemExit as e:
        return e.code
    return 0
