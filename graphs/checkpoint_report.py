"""`dsneuron inspect-checkpoint`: a checkpoint folder's tensor families, dequantised weight
statistics and model health figures (graphs/checkpoint.py validates and reads the folder;
graphs/golden.py runs the one prefill the health figures come from).

Apart from graphs/checkpoint.py because the health figures need the golden model, which itself
loads checkpoints: reading below, the golden above it, this report on top.
"""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path
from typing import Any

import safetensors
import torch
from rich.console import Console
from rich.table import Table

from dsneuron.kernels_nki.formats import ue8m0_to_float

from .checkpoint import CheckpointError, read_checkpoint_config, scale_name, tensor_nbytes, validate_checkpoint
from .engram import engram_layout
from .golden import Golden, health_stats
from .quant import dequant_fp4_weight, dequant_fp8_weight
from .spec import TensorSpec, checkpoint_spec


def tensor_family(name: str) -> str:
    """Name with every layer / expert / stage number replaced by `*` (layers.3.ffn.experts.7.w1.weight
    -> layers.*.ffn.experts.*.w1.weight)."""
    return re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", name)


def _dequantized(spec: dict[str, TensorSpec], name: str, t: torch.Tensor, scale: torch.Tensor | None,
                 block: int) -> torch.Tensor:
    kind = spec[name].kind
    if kind == "fp8":
        return dequant_fp8_weight(t, scale, block)
    if kind == "fp4":
        return dequant_fp4_weight(t, scale)
    if kind == "fp8row":
        return (t.float().unflatten(-1, (-1, block)) * ue8m0_to_float(scale)[..., None]).flatten(-2)
    return t.float()


def checkpoint_weight_stats(path: Path) -> dict[str, dict[str, float]]:
    """Per tensor family: {"count", "mean", "std", "amax"} of the dequantised weights.

    Scale tensors are folded into their weights, not reported. Reads one tensor at a time.
    Raises CheckpointError as `read_checkpoint_config` / `validate_checkpoint`.
    """
    path = Path(path)
    cfg = read_checkpoint_config(path)
    rows = engram_layout(cfg).num_embeddings
    spec = checkpoint_spec(cfg, rows)
    where = validate_checkpoint(path, cfg, rows)
    acc: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        handles = {sh: stack.enter_context(safetensors.safe_open(str(path / sh), "pt")) for sh in set(where.values())}
        for name, s in spec.items():
            if s.kind == "scale":
                continue
            t = handles[where[name]].get_tensor(name)
            scale = None
            if s.kind != "plain":
                sname = scale_name(name)
                scale = handles[where[sname]].get_tensor(sname)
            w = _dequantized(spec, name, t, scale, cfg.fp8_block_size)
            a = acc.setdefault(tensor_family(name), [0.0, 0.0, 0.0, 0.0])
            # per-tensor sums in fp32 (torch's cascade summation), families summed in Python floats
            a[0] += w.numel()
            a[1] += float(w.sum())
            a[2] += float(w.square().sum())
            a[3] = max(a[3], float(w.abs().max()) if w.numel() else 0.0)
    stats = {}
    for fam, (n, s1, s2, amax) in acc.items():
        mean = s1 / n
        stats[fam] = {"count": n, "mean": mean, "std": math.sqrt(max(s2 / n - mean * mean, 0.0)), "amax": amax}
    return stats


def model_health_stats(path: Path) -> dict[str, Any]:
    """Model-based health figures of a checkpoint, shown by `inspect-checkpoint --stats`: residual
    RMS per layer, SwiGLU clamp rate, tokens per expert, logits std, non-finite logits (one
    172-token prefill of the eager golden model; see `dsneuron.graphs.golden.health_stats`)."""
    cfg = read_checkpoint_config(path)
    return health_stats(Golden(cfg, path, max_seq_len=256))


def inspect_checkpoint(path: Path, stats: bool = False, console: Console | None = None) -> None:
    """Validate a checkpoint folder and print its tensor families (dtype, shapes, count, bytes, totals).

    stats: also print `checkpoint_weight_stats` and `model_health_stats`.
    Raises CheckpointError (every problem at once) when the folder does not match its own config.
    """
    path = Path(path)
    console = console or Console()
    cfg = read_checkpoint_config(path)
    rows = engram_layout(cfg).num_embeddings
    spec = checkpoint_spec(cfg, rows)
    where = validate_checkpoint(path, cfg, rows)
    fams: dict[tuple[str, str], list[Any]] = {}
    for name, s in spec.items():
        f = fams.setdefault((tensor_family(name), s.dtype), [[], 0, 0])
        if s.shape not in f[0]:
            f[0].append(s.shape)
        f[1] += 1
        f[2] += tensor_nbytes(s)
    table = Table(title=f"{path}  ({len(set(where.values()))} shards)")
    for col, justify in (("family", "left"), ("dtype", "left"), ("shape", "left"), ("count", "right"), ("MiB", "right")):
        table.add_column(col, justify=justify)
    for (fam, dtype), (shapes, count, nbytes) in fams.items():
        shape_txt = ", ".join(str(list(sh)) for sh in shapes[:3]) + (", ..." if len(shapes) > 3 else "")
        table.add_row(fam, dtype, shape_txt, str(count), f"{nbytes / 2**20:.2f}")
    total = sum(f[2] for f in fams.values())
    table.add_section()
    table.add_row("total", "", "", str(len(spec)), f"{total / 2**20:.2f}")
    console.print(table)
    console.print(f"total {total:,} bytes in {len(spec)} tensors; config: dim {cfg.dim}, {cfg.n_layers} layers "
                  f"+ {cfg.n_mtp_layers} DSpark stages, vocab {cfg.vocab_size}, engram rows {list(rows)}")
    if not stats:
        return
    st = Table(title="dequantised weights per family")
    for col in ("family", "count", "mean", "std", "amax"):
        st.add_column(col, justify="left" if col == "family" else "right")
    for fam, v in checkpoint_weight_stats(path).items():
        st.add_row(fam, f"{int(v['count']):,}", f"{v['mean']:+.4f}", f"{v['std']:.4f}", f"{v['amax']:.4f}")
    console.print(st)
    console.print("model statistics (eager golden, one prefill):")
    health = model_health_stats(path)
    for key, value in health.items():
        console.print(f"  {key}: {value}", highlight=False, soft_wrap=True)
    if health["nonfinite_logits"]:
        raise CheckpointError(f"{path}: the model gives {health['nonfinite_logits']} non-finite logits "
                              "(NaN/inf in the weights); the limit is 0")
