"""The eager golden model: the step functions run at exact (unpadded) shapes, one prompt at a time,
with the routed MoE of the reference (model.py MoE.forward) and host-side engram hashing.

This is what compiled bundles are compared against. It follows the official V4.1 inference code
(see graphs/model.py for the named deviations, all shape-only).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from dsneuron.kernels_nki.engram_hash import NgramHasher

from .checkpoint import load_checkpoint
from .config import ModelConfig
from .engram import engram_layout, engram_params
from .context import Capture
from .model import Linear, Transformer
from .numerics import gemm_order
from .steps import decode, prefill, prefill_chunk
from .weights import build_model, model_weights


@dataclass
class StepRecord:
    """One teacher-forced step: logits fp32 [V] and, when asked, every stage's captured tensors."""

    logits: torch.Tensor
    capture: dict[str, torch.Tensor] | None


#: the golden keeps float64 copies of its linears' weights (Transformer.cache_dequantized: 8 bytes a
#: value) up to this many bytes; tiny's are 3.4 GiB, the V4.1-width slice's 29.5 GiB, more than the
#: hosts it runs on have. Above it every linear dequantises its weight on each call: the same values
#: (exact), slower.
CACHE_LIMIT_BYTES = 8 * 2**30


def float64_cache_bytes(model: Transformer) -> int:
    """Bytes of the float64 weight copies `Transformer.cache_dequantized` would keep for `model`."""
    return sum(8 * m.in_features * m.out_features for m in model.modules() if isinstance(m, Linear))


class Golden:
    """A loaded model plus its engram hasher.

    checkpoint: folder written by `dsneuron make-checkpoint` (validated on load); max_seq_len:
    context capacity (sizes the caches and RoPE tables); tokenizer: tokenizer.json path (None: the
    packaged DeepSeek V4 tokenizer). The float64 weight copies are kept when they take at most
    CACHE_LIMIT_BYTES (`float64_cache_bytes`). Raises CheckpointError / ConfigError on bad input.
    """

    def __init__(self, cfg: ModelConfig, checkpoint: Path, max_seq_len: int, tokenizer: str | Path | None = None):
        self.cfg, self.max_seq_len = cfg, max_seq_len
        rows = engram_layout(cfg).num_embeddings if cfg.engram_layer_ids else ()
        stored = model_weights(load_checkpoint(Path(checkpoint), cfg, rows), cfg)
        #: the checkpoint dtype of every weight (the model holds a few bf16 ones as fp32)
        self.stored_dtypes = {n: t.dtype for n, t in stored.items()}
        self.model: Transformer = build_model(cfg, stored, rows, max_seq_len)
        del stored
        if float64_cache_bytes(self.model) <= CACHE_LIMIT_BYTES:
            self.model.cache_dequantized()
        self._kernel_weights = False
        self.engram = engram_params(cfg, tokenizer) if cfg.engram_layer_ids else None
        self.hasher = NgramHasher(self.engram.to_dict()) if self.engram else None

    def attach_kernel_weights(self) -> None:
        """Make GEMM order "kernel" (the cpu target's executables) runnable on the golden model:
        attach the cpu kernels' prepared weights (graphs/kernel_weights.py), made from the
        checkpoint-format values. Idempotent; builds the kernels on first use."""
        if self._kernel_weights:
            return
        from dsneuron.kernels_nki.prepare import prepare_tensors

        from .kernel_weights import attach_kernel_weights, kernel_recipes

        params = dict(self.model.named_parameters())
        stored = {n: params[n].detach().to(self.stored_dtypes[n]) for n in params if n in self.stored_dtypes}
        recipes = kernel_recipes(self.model, stored)
        attach_kernel_weights(self.model, {n: t for r in recipes for n, t in prepare_tensors(r, stored).items()})
        self._kernel_weights = True

    def engram_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int64 [B,L] (whole sequences from position 0) -> hash ids int64 [B,L,E,C]."""
        if self.hasher is None:
            return torch.zeros(*tokens.shape, 0, 0, dtype=torch.int64)
        return self.hasher.hash_sequence(tokens)

    @torch.inference_mode()
    def teacher_forced(self, tokens: list[int], n_prompt: int, capture: bool = False,
                       cpu_kernels: bool = False, chunks: int | Sequence[int] | None = None) -> list[StepRecord]:
        """Prefill tokens[:n_prompt], then decode tokens[n_prompt:] one at a time (teacher forcing).

        Returns len(tokens) - n_prompt + 1 records: the prefill's logits (next-token prediction
        after the prompt) and one per decoded token. cpu_kernels: run the cpu target's numerics
        instead of the golden's (GEMM order "kernel" on the prepared weights, the MoE's grouped
        GEMM: what its executables compute). chunks: prefill the prompt as a chunked prefill, as
        the runtime does (runtime_min/core/runner.py Runner.prefill_job): the first of its
        `chunk_lengths` a prefill at position 0, the others chunks continuing the state
        (graphs/steps.py prefill_chunk); the prefill record's capture is the last chunk's. Raises ValueError as
        `check_sequence` and `chunk_lengths`.
        """
        check_sequence(len(tokens), n_prompt, self.max_seq_len)
        if cpu_kernels:
            self.attach_kernel_weights()
        routed = not cpu_kernels
        ids = torch.tensor([tokens], dtype=torch.int64)
        eng = self.engram_ids(ids)
        with gemm_order("kernel") if cpu_kernels else contextlib.nullcontext():
            cap = Capture() if capture else None
            lengths = [n_prompt] if chunks is None else chunk_lengths(n_prompt, chunks)
            first = lengths[0]
            logits, state = prefill(self.model, ids[:, :first], torch.tensor([first]), eng[:, :first], cap,
                                    routed=routed)
            p = first
            for n in lengths[1:]:
                cap = Capture() if capture else None
                logits, state = prefill_chunk(self.model, ids[:, p:p + n], torch.tensor([p]), torch.tensor([n]),
                                              eng[:, p:p + n], state, cap, routed=routed)
                p += n
            out = [StepRecord(logits[0], cap.tensors if cap else None)]
            for p in range(n_prompt, len(tokens)):
                cap = Capture() if capture else None
                logits, state = decode(self.model, ids[:, p:p + 1], torch.tensor([p]), eng[:, p:p + 1], state, cap,
                                       routed=routed)
                out.append(StepRecord(logits[0], cap.tensors if cap else None))
        return out


def chunk_lengths(n_prompt: int, chunks: int | Sequence[int]) -> list[int]:
    """The chunk lengths of an n_prompt-token chunked prefill: an int c splits it into chunks of c
    tokens (the last one shorter); a list is taken as given and must sum to n_prompt. Raises
    ValueError for a chunk length below 1 or a list that does not cover the prompt."""
    if isinstance(chunks, int):
        if chunks < 1:
            raise ValueError(f"chunk length must be >= 1, got {chunks}")
        return [min(chunks, n_prompt - p) for p in range(0, n_prompt, chunks)]
    out = [int(c) for c in chunks]
    if any(c < 1 for c in out) or sum(out) != n_prompt:
        raise ValueError(f"chunk lengths {out} must be >= 1 and sum to the prompt's {n_prompt} tokens")
    return out


def check_sequence(length: int, n_prompt: int, max_seq_len: int) -> None:
    """Raise ValueError unless a teacher-forced sequence of `length` tokens with an n_prompt-token
    prompt fits: 1 <= n_prompt <= length <= max_seq_len."""
    if not 1 <= n_prompt <= length:
        raise ValueError(f"n_prompt must be in 1..{length}, got {n_prompt}")
    if length > max_seq_len:
        raise ValueError(f"{length} tokens exceed the context capacity max_seq_len={max_seq_len}")


@torch.inference_mode()
def health_stats(golden: Golden, n_tokens: int = 172, seed: int = 0) -> dict[str, object]:
    """Numeric health of a (random) checkpoint on one prefill of `n_tokens` random token ids:
    residual RMS after each layer, SwiGLU clamp rate (fraction of up/gate elements the clamp
    changes, routed and shared experts), tokens per expert per layer, logits std and the count of
    non-finite logits. Used by `dsneuron inspect-checkpoint --stats`."""
    cfg = golden.cfg
    ids = torch.randint(0, min(cfg.vocab_size, 128000), (n_tokens,), generator=torch.Generator().manual_seed(seed))
    rec = golden.teacher_forced(ids.tolist(), n_tokens, capture=True)[0]
    cap = rec.capture
    rms, usage, fired, total = [], [], 0, 0
    lim = cfg.swiglu_limit
    for i, layer in enumerate(golden.model.layers):
        rms.append(round(cap[f"layers.{i}.out"].float().square().mean().sqrt().item(), 4))
        idx = cap[f"layers.{i}.ffn.gate.indices"].flatten(0, -2)  # [tokens, topk]
        usage.append(torch.bincount(idx.flatten(), minlength=layer.ffn.n_experts).tolist())
        x = cap[f"layers.{i}.ffn.in"].reshape(-1, cfg.dim)
        pairs = [(layer.ffn.shared_experts, x)] + [(layer.ffn.experts[e], x[(idx == e).any(-1)]) for e in range(layer.ffn.n_experts)]
        for expert, rows in pairs:
            if rows.numel():
                gate, up = expert.w1(rows).float(), expert.w3(rows).float()
                fired += int((up.abs() > lim).sum() + (gate > lim).sum())
                total += 2 * up.numel()
    return {"tokens": n_tokens, "residual_rms_per_layer": rms, "swiglu_clamp_rate": round(fired / max(total, 1), 5),
            "tokens_per_expert": usage, "logits_std": round(rec.logits.std().item(), 4),
            "nonfinite_logits": int((~torch.isfinite(rec.logits)).sum())}
