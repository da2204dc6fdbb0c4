"""From checkpoint tensors to a ready `Transformer`: the one place that adapts the checkpoint layout
to the model's parameters, as the official convert.py does (deepseek-ai/DeepSeek-V4.1-Flash:
inference/convert.py): the grouped output projection `wo_a` is dequantised from FP8 32x32 to bf16,
the DSpark (mtp.*) stages are left out (basic mode does not run them). Everything else is used as
stored; the bf16 -> fp32 promotions the reference makes at load time (head, ratio>1 compressor)
are reported by `load_casts` so a bundle can store the checkpoint bytes and the runtime applies
the casts generically.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .config import ModelConfig
from .lazy import Computed, placeholder
from .model import Transformer
from .quant import dequant_fp8_weight

def model_weights(ckpt: dict[str, torch.Tensor], cfg: ModelConfig,
                  derived: dict[str, Computed] | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (HF names) -> the tensors the step graphs take, before LOAD_CASTS.

    Drops mtp.* and every `attn.wo_a.scale`; `attn.wo_a.weight` becomes bf16 [out, in] (exact:
    e4m3 value times a power of two fits bf16). With `derived` (a dict, filled here), the
    dequantisation is not done: each wo_a weight is a zero `placeholder` of its bf16 shape and
    `derived[name]` a `Computed` source that makes its values when it is written (a compile whose
    models do not hold wo_a, graphs/lazy.py); the other tensors are `ckpt`'s own.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in ckpt.items():
        if name.startswith("mtp.") or name.endswith("attn.wo_a.scale"):
            continue
        if name.endswith("attn.wo_a.weight"):
            scale = ckpt[name[: -len("weight")] + "scale"]
            if derived is None:
                t = _dequant_wo_a(t, scale, cfg.fp8_block_size)
            else:
                derived[name] = Computed(name, tuple(t.shape), torch.bfloat16,
                                         functools.partial(_dequant_wo_a, t, scale, cfg.fp8_block_size))
                t = placeholder(tuple(t.shape), torch.bfloat16)
        out[name] = t
    return out


def _dequant_wo_a(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return dequant_fp8_weight(weight, scale, block).to(torch.bfloat16)


def load_casts(model: Transformer, weights: dict[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """{name: dtype} of the weights the model holds in a wider dtype than stored (bf16 -> fp32:
    the head and the ratio>1 compressor projections, as the reference promotes them at load)."""
    params = dict(model.named_parameters())
    return {n: params[n].dtype for n, t in weights.items()
            if n in params and t.dtype == torch.bfloat16 and params[n].dtype == torch.float32}


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], engram_num_embeddings: tuple[int, ...],
                max_seq_len: int, shard: Callable[[Transformer], Any] | None = None) -> Transformer:
    """A Transformer holding `weights` (output of model_weights, casts applied or not). shard: cuts
    the fresh (unloaded) Transformer to one rank's shapes before `weights`, that rank's slices, are
    loaded into it (compiler/parallel.py shard_model).

    Raises ValueError naming missing/unexpected parameters or a shape/dtype mismatch.
    """
    model = Transformer(cfg, engram_num_embeddings, max_seq_len)
    if shard is not None:
        shard(model)
    params = dict(model.named_parameters())
    casts = load_casts(model, weights)
    weights = {n: (t.to(casts[n]) if n in casts else t) for n, t in weights.items()}
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(f"model weights: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, p in params.items():
        t = weights[name]
        if t.shape != p.shape or t.dtype != p.dtype:
            raise ValueError(f"model weights: {name} is {t.dtype} {tuple(t.shape)}, the model needs {p.dtype} {tuple(p.shape)}")
    model.load_state_dict(weights, strict=False, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
