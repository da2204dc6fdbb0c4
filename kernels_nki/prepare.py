"""Load-time weight recipes: checkpoint tensors -> the cpu GEMM kernels' panels, and their shapes.

A bundle stores the checkpoint-format tensors (FP8/FP4 codes, UE8M0 scales, bf16/fp32 values) and
a list of `Prepare` recipes (the manifest's `prepare`, docs/bundle-format.md). The runtime applies
each recipe once at load (`prepare_tensors`, through kernels_nki.cpu_gemm.prepare_weight); the
compiler traces the executables on placeholders of the recipes' output shapes (`prepared_specs`,
nothing read or run); the golden model attaches the same tensors as buffers
(graphs/kernel_weights.py). Kept here, beside the kernels whose layout they produce, so the model
graphs, the compiler and the runtime all take them from below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

#: the cpu kernel formats a recipe names (kernels_nki.cpu_gemm.FORMATS)
PREPARE_FORMATS = ("fp8", "fp4", "bf16", "fp32")


@dataclass(frozen=True)
class Prepare:
    """One load-time recipe (bundle schema version 2): the weight tensors `weights` (stacked along a
    new first dimension when several, or a single weight [groups * r, K] viewed as [groups, r, K]
    when groups > 0) and their UE8M0 `scales`, in cpu kernel format `fmt` (one of PREPARE_FORMATS),
    become the two tensors named `outputs` = (panels, panel scales) of
    kernels_nki.cpu_gemm.prepare_weight. The manifest parses it (runtime_min/bundle/schema.py)."""

    fmt: str
    weights: tuple[str, ...]
    scales: tuple[str, ...]
    groups: int
    outputs: tuple[str, str]

    def to_dict(self) -> dict[str, Any]:
        """The manifest record: {"fmt", "weights", "scales", "groups", "outputs"}."""
        return {"fmt": self.fmt, "weights": list(self.weights), "scales": list(self.scales), "groups": self.groups,
                "outputs": list(self.outputs)}


def prepare_tensors(p: Prepare, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{p.outputs[0]: panels, p.outputs[1]: panel scales}, made from `tensors` (which must hold every
    name of p.weights and p.scales) in the cpu kernels' layout (kernels_nki.cpu_gemm.prepare_weight;
    importing it builds the kernels on first use). Raises ValueError "prepare of NAME: ..." when the
    recipe does not fit its tensors."""
    from . import cpu_gemm

    ws = [tensors[n] for n in p.weights]
    ss = [tensors[n] for n in p.scales]
    w = torch.stack(ws) if len(ws) > 1 else ws[0]
    scale = (torch.stack(ss) if len(ss) > 1 else ss[0]) if ss else None
    if p.groups:
        w = w.view(p.groups, -1, w.shape[-1])
    try:
        out = cpu_gemm.prepare_weight(p.fmt, w, scale)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"prepare of {p.weights[0]}: {e}") from None
    return {p.outputs[0]: out["w"], p.outputs[1]: out["w_scale"]}


def prepared_specs(p: Prepare, tensors: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{output name: (shape, dtype)} of what `prepare_tensors(p, tensors)` makes, from the .shape
    and .dtype of the values of `tensors` alone (kernels_nki.cpu_gemm.prepared_specs): nothing is
    read or run. Raises ValueError "prepare of NAME: ..." where prepare_tensors would fail."""
    from . import cpu_gemm

    def stacked(names: tuple[str, ...]) -> _Spec:
        specs = {(tuple(tensors[n].shape), tensors[n].dtype) for n in names}
        if len(specs) > 1:
            raise ValueError(f"prepare of {p.weights[0]}: {list(names)} differ in shape or dtype")
        shape, dtype = specs.pop()
        return _Spec((len(names), *shape) if len(names) > 1 else shape, dtype)

    w = stacked(p.weights)
    scale = stacked(p.scales) if p.scales else None
    if p.groups:
        rows = math.prod(w.shape[:-1])
        if rows % p.groups:
            raise ValueError(f"prepare of {p.weights[0]}: {rows} rows do not split into {p.groups} groups")
        w = _Spec((p.groups, rows // p.groups, w.shape[-1]), w.dtype)
    try:
        out = cpu_gemm.prepared_specs(p.fmt, w, scale)
    except ValueError as e:
        raise ValueError(f"prepare of {p.weights[0]}: {e}") from None
    return {p.outputs[0]: out["w"], p.outputs[1]: out["w_scale"]}


@dataclass(frozen=True)
class _Spec:
    """A tensor's shape and dtype, for `prepared_specs`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
