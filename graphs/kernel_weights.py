"""The model's GEMM weights in the layout of the cpu kernels (GEMM order "kernel").

kernels_nki/cpu_gemm.py computes every GEMM of the compiled cpu steps from weights repacked into
panels of 16 output rows (`prepare_weight`): same bytes as the checkpoint, scales decoded to fp32.
The bundle stores the checkpoint tensors and a list of recipes (kernels_nki/prepare.py `Prepare`);
the runtime applies them once at load, and the executables take the prepared tensors. This module
lists the recipes of a model and attaches the prepared tensors to it as buffers, where the
model's "kernel" GEMM paths read them (graphs/model.py, through graphs/dispatch.py):

| module | buffers | recipe |
|---|---|---|
| Linear (fp8, fp4, bf16, fp32) | kernel_w, kernel_w_scale | its weight (and scale) |
| Gate | kernel_w, kernel_w_scale | its bf16 weight |
| Block | hc_attn_kernel_w/_scale, hc_ffn_kernel_w/_scale | the fp32 mHC projections |
| Attention | wo_a_kernel_w/_scale | wo_a [G*r, in] as G stacked [r, in] (grouped GEMM) |
| MoE | experts_{w1,w2,w3}_kernel_w/_scale | every routed expert's projection, stacked [E, ...] |

A weight the model holds as fp32 although the checkpoint stores bf16 (the head, ratio>1
compressor projections) is prepared from the stored bf16 values: the kernel reads bf16 panels,
which hold the same values in half the bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from dsneuron.kernels_nki.prepare import Prepare

from .model import Attention, Block, Gate, Linear, MoE, Transformer

_FMT = {torch.float8_e4m3fn: "fp8", torch.int8: "fp4", torch.bfloat16: "bf16", torch.float32: "fp32"}


def kernel_recipes(model: Transformer, stored: dict[str, torch.Tensor]) -> list[Prepare]:
    """The recipes that turn the stored (checkpoint-format) tensors `stored` into every prepared
    weight `model` reads in GEMM order "kernel", in module order. Raises ValueError for a weight
    whose stored dtype has no kernel format."""
    out: list[Prepare] = []

    def fmt_of(name: str) -> str:
        dtype = stored[name].dtype
        if dtype not in _FMT:
            raise ValueError(f"kernel_recipes: {name} is stored as {dtype}, which no cpu kernel format takes")
        return _FMT[dtype]

    def add(prefix: str, weights: list[str], scales: list[str], groups: int = 0) -> None:
        out.append(Prepare(fmt_of(weights[0]), tuple(weights), tuple(scales), groups,
                           (f"{prefix}kernel_w", f"{prefix}kernel_w_scale")))

    for path, mod in model.named_modules():
        p = f"{path}." if path else ""
        if isinstance(mod, Linear) and not _grouped_or_stacked(model, path):
            add(p, [f"{p}weight"], [f"{p}scale"] if mod.kind in ("fp8", "fp4") else [])
        elif isinstance(mod, Gate):
            add(p, [f"{p}weight"], [])
        elif isinstance(mod, Block):
            for s in ("attn", "ffn"):
                add(f"{p}hc_{s}_", [f"{p}hc_{s}_fn"], [])
        elif isinstance(mod, Attention):
            add(f"{p}wo_a_", [f"{p}wo_a.weight"], [], groups=mod.cfg.o_groups)
        elif isinstance(mod, MoE):
            for w in ("w1", "w2", "w3"):
                add(f"{p}experts_{w}_", [f"{p}experts.{e}.{w}.weight" for e in mod.owned],
                    [f"{p}experts.{e}.{w}.scale" for e in mod.owned])
    return out


def _grouped_or_stacked(model: nn.Module, path: str) -> bool:
    """A Linear whose GEMM runs grouped (wo_a) or stacked (routed experts) with its siblings."""
    parts = path.split(".")
    return parts[-1] == "wo_a" or (len(parts) >= 3 and parts[-3] == "experts")


def attach_kernel_weights(model: Transformer, prepared: dict[str, torch.Tensor], recipes: list[Prepare] | None = None,
                          drop: bool = False) -> None:
    """Register the prepared tensors (name -> tensor, the recipes' outputs) as non-persistent
    buffers of `model`'s modules, under the names the recipes give. With `drop`, the parameters the
    recipes were made from are removed from the model (a model that then runs only in GEMM order
    "kernel", whose graphs must not take the checkpoint-format copies as inputs).
    Raises KeyError for a name whose module does not exist."""
    modules = dict(model.named_modules())
    for name, t in prepared.items():
        path, _, attr = name.rpartition(".")
        modules[path].register_buffer(attr, t, persistent=False)
    if drop:
        for r in recipes or []:
            for name in (*r.weights, *r.scales):
                path, _, attr = name.rpartition(".")
                del modules[path]._parameters[attr]
                setattr(modules[path], attr, None)
