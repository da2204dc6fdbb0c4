"""The deterministic random checkpoint writer: `make_checkpoint` writes a folder in the layout of
graphs/checkpoint.py, which reads it back.

Random weights. Each tensor is drawn as fp32 from its own torch.Generator seeded with the first 8
bytes of sha256("<seed>:<tensor name>"), then stored as the release stores it: FP8 e4m3 (RNE) with a
32x32 UE8M0 block scale = pow2 ceiling of amax/448 (`quant.quantize_fp8_weight`); FP4 e2m1 1x32,
low nibble first (`quant.quantize_fp4_weight`); engram tables e4m3 rows with 1x32 UE8M0 scales
(`quant.act_quant` along the row); BF16/F32 plain tensors rounded once. Initial magnitudes by
`TensorSpec.role` (z ~ N(0, 1), n = fan_in), chosen from how inference/model.py uses each tensor:

    role                 value                    why
    linear, gate,        z / sqrt(n)              unit-RMS input -> unit-RMS output; gate scores
    compressor_gate,                              N(0, 1) for every expert alike, so all get used;
    engram_wkv, head                              head: logits std ~ 1 after the final RMSNorm
    expert, shared       SWIGLU_STD * z / sqrt(n) w1/w3 outputs ~ N(0, 16): the swiglu_limit 10
                                                  clamp fires on ~0.9% of elements (0.6% gate
                                                  side, 1.2% up side)
    expert_w2, shared_w2 W2_GAIN * z / sqrt(n)    silu(g)*u has RMS ~10.9 at std 4: w2 brings it
                                                  back to ~1
    embed, engram_table  z                        first residual RMS ~ 1; engram rows ~ unit
    norm, engram_qk      1 + NORM_NOISE * z       RMSNorm gains / q*k weights near 1
    gate_bias            GATE_BIAS_STD * z        selection bias small next to score spread
    attn_sink            SINK_STD * z             sink logits around 0
    hc_fn                HC_FN_GAIN * z / sqrt(n) mixes ~ N(0, 0.5^2) after hc_mixes' rsqrt
    hc_scale             1 + HC_NOISE * z         ~1
    hc_base              base + HC_NOISE * z      pre: log(1/(hc-1)) so pre ~ 1/hc (sums to ~1);
                                                  post: 0 so post = 2*sigmoid ~ 1; comb: HC_COMB_DIAG
                                                  on the diagonal, so Sinkhorn gives a comb near
                                                  identity (diag ~0.7)

Measured once with the eager golden model (graphs/golden.py, seed 0, a 172/200-token English
prompt, prefill): tiny: residual RMS 1.63, 2.15, 2.49, ... 4.02, 4.21 over layers 0..9 (attention
output RMS ~0.23, MoE output ~1.23, engram adds ~0.55), SwiGLU clamp on 0.90% of w1/w3 outputs,
every one of the 16 experts chosen 24..79 times of 688, logits std 1.00, all finite; micro:
residual RMS 1.86 -> 3.80 over 6 layers, clamp 0.90%, logits std 1.00. Re-measuring after a change
of these constants is the job of `model_health_stats`, the hook `inspect-checkpoint --stats` calls.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import torch
from rich.console import Console

from dsneuron.disk import check_free, disk_full_is_an_error
from dsneuron.kernels_nki.formats import float_to_ue8m0

from . import safetensors_format as sf
from .checkpoint import (GENERATION_CONFIG_NAME, HF_CONFIG_NAME, INDEX_NAME, INFERENCE_CONFIG_NAME, TORCH_DTYPES,
                         CheckpointError, hf_config, inference_config, scale_name, tensor_nbytes)
from .config import ModelConfig
from .engram import engram_params
from .lazy import tensor_chunks
from .quant import act_quant, quantize_fp4_weight, quantize_fp8_weight
from .spec import TensorSpec, checkpoint_spec
from .tokenizer import tokenizer_files

SHARD_BYTES = 64 * 2**20

# initial magnitudes (see the module docstring)
SWIGLU_STD = 4.0
W2_GAIN = 1.0 / 11.0
HC_FN_GAIN = 0.5
HC_COMB_DIAG = 2.0
HC_NOISE = 0.05
NORM_NOISE = 0.02
GATE_BIAS_STD = 0.02
SINK_STD = 0.1

_GAIN = {"linear": 1.0, "gate": 1.0, "compressor_gate": 1.0, "engram_wkv": 1.0, "head": 1.0,
         "expert": SWIGLU_STD, "shared": SWIGLU_STD, "expert_w2": W2_GAIN, "shared_w2": W2_GAIN,
         "hc_fn": HC_FN_GAIN}


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: first 8 bytes of sha256("<seed>:<name>"), as a 63-bit int."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _hc_base_mean(hc: int) -> torch.Tensor:
    pre = torch.full((hc,), math.log(1.0 / (hc - 1))) if hc > 1 else torch.full((1,), 10.0)
    comb = torch.eye(hc) * HC_COMB_DIAG
    return torch.cat([pre, torch.zeros(hc), comb.flatten()])


#: fp32 bytes of one piece a large tensor is drawn and quantized in (`_draw_pieces`)
DRAW_PIECE_BYTES = 64 * 2**20


def draw_tensor(spec: TensorSpec, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The fp32 value of one weight before storage rounding, logical shape ([out, in] for FP4).

    Deterministic in (seed, spec.name). Raises ValueError for a role without an init rule.
    """
    g = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    return _init(torch.randn(_logical_shape(spec), generator=g, dtype=torch.float32), spec, cfg)


def _logical_shape(spec: TensorSpec) -> tuple[int, ...]:
    return (spec.shape[0], spec.fan_in) if spec.kind == "fp4" else spec.shape


def _init(z: torch.Tensor, spec: TensorSpec, cfg: ModelConfig) -> torch.Tensor:
    """z ~ N(0, 1) (the whole tensor or a piece of its rows) scaled in place by spec.role's rule."""
    role = spec.role
    # in place: an fp32 embedding of the tiny config is 0.5 GB
    if role in _GAIN:
        return z.mul_(_GAIN[role] / math.sqrt(spec.fan_in))
    if role in ("embed", "engram_table"):
        return z
    if role in ("norm", "engram_qk"):
        return z.mul_(NORM_NOISE).add_(1.0)
    if role == "gate_bias":
        return z.mul_(GATE_BIAS_STD)
    if role == "attn_sink":
        return z.mul_(SINK_STD)
    if role == "hc_scale":
        return z.mul_(HC_NOISE).add_(1.0)
    if role == "hc_base":
        return z.mul_(HC_NOISE).add_(_hc_base_mean(cfg.hc_mult))
    raise ValueError(f"{spec.name}: no initialisation rule for role {role!r}")


def _draw_pieces(spec: TensorSpec, cfg: ModelConfig, seed: int, piece_bytes: int = DRAW_PIECE_BYTES) -> Iterator[torch.Tensor]:
    """`draw_tensor`'s value as consecutive row pieces of about piece_bytes fp32 (one piece for a
    1-D or small tensor), so that a large tensor is never whole in fp32. The pieces are the whole
    draw's rows bit for bit: torch's CPU normal fill consumes the generator element by element and
    transforms it in groups of 16, and a piece of 32k rows holds a multiple of 16 elements (32: an
    FP8 tile's rows, so the pieces quantize as the whole does)."""
    shape = _logical_shape(spec)
    g = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    row_bytes = 4 * math.prod(shape[1:])
    rows = max(32, piece_bytes // max(1, row_bytes) // 32 * 32)
    if len(shape) == 1 or rows >= shape[0]:
        yield _init(torch.randn(shape, generator=g, dtype=torch.float32), spec, cfg)
        return
    for r0 in range(0, shape[0], rows):
        yield _init(torch.randn((min(rows, shape[0] - r0), *shape[1:]), generator=g, dtype=torch.float32), spec, cfg)


def _quantized(spec: TensorSpec, cfg: ModelConfig, w: torch.Tensor) -> list[torch.Tensor]:
    """The stored tensors of fp32 rows `w` of spec's weight: [weight] or [weight, its scale]."""
    if spec.kind == "fp8":
        return list(quantize_fp8_weight(w, cfg.fp8_block_size))
    if spec.kind == "fp4":
        return list(quantize_fp4_weight(w))
    if spec.kind == "fp8row":
        q, s32 = act_quant(w, cfg.fp8_block_size)
        return [q, float_to_ue8m0(s32)]
    if spec.kind == "plain":
        return [w.to(TORCH_DTYPES[spec.dtype])]
    raise ValueError(f"{spec.name}: cannot draw a tensor of kind {spec.kind!r}")


def _stored(spec: TensorSpec, cfg: ModelConfig, seed: int,
            piece_bytes: int = DRAW_PIECE_BYTES) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] as stored: the weight, plus its scale for quantized kinds. A tensor of more
    than piece_bytes in fp32 is drawn and quantized piece by piece (`_draw_pieces`) into its stored
    tensors, so it holds them and one piece's temporaries, never the whole fp32 draw."""
    names = [spec.name] if spec.kind == "plain" else [spec.name, scale_name(spec.name)]
    out: list[torch.Tensor] | None = None
    at = []
    for w in _draw_pieces(spec, cfg, seed, piece_bytes):
        parts = _quantized(spec, cfg, w)
        del w
        if out is None:
            if parts[0].shape[0] == _logical_shape(spec)[0]:  # one piece: the whole tensor
                return list(zip(names, parts))
            rows = spec.shape[0]
            # an FP8 scale has a row per 32-row tile; the other scales one per row
            scale_rows = -(-rows // cfg.fp8_block_size) if spec.kind == "fp8" else rows
            out = [torch.empty((r, *p.shape[1:]), dtype=p.dtype) for r, p in zip((rows, scale_rows), parts)]
            at = [0] * len(parts)
        for i, p in enumerate(parts):
            out[i][at[i]: at[i] + p.shape[0]] = p
            at[i] += p.shape[0]
    return list(zip(names, out))


def _shard_plan(spec: dict[str, TensorSpec], shard_bytes: int) -> list[list[str]]:
    """Weight names per shard, in spec order. A weight and its scale share a shard; a weight
    larger than shard_bytes gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, s in spec.items():
        if s.kind == "scale":
            continue
        nbytes = tensor_nbytes(s) + (tensor_nbytes(spec[scale_name(name)]) if s.kind != "plain" else 0)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def make_checkpoint(cfg: ModelConfig, out: Path, seed: int = 0, force: bool = False,
                    console: Console | None = None, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write a deterministic random checkpoint for `cfg` into the folder `out`; returns `out`.

    Same (cfg, seed) -> byte-identical files. Written into a temporary sibling folder and renamed
    into place, one shard in memory at a time; an interrupted write leaves nothing at `out`.
    Raises CheckpointError if `out` exists and not `force`, or exists and is not a checkpoint
    folder (force replaces checkpoints only); nothing is touched then. Raises DiskFullError
    (dsneuron.disk) before writing when the disk has not the checkpoint's size free, and when it
    fills while writing (the partial folder is removed).
    """
    out = Path(out)
    # an unrelated file or folder is refused first, so the message never suggests --force for it
    if (out.exists() or out.is_symlink()) and not (out.is_dir() and not out.is_symlink() and (out / INDEX_NAME).is_file()):
        raise CheckpointError(f"{out}: exists and is not a checkpoint folder (no {INDEX_NAME}); refusing to replace it "
                              "(--force replaces checkpoints only); choose another --out")
    if out.exists() and not force:
        raise CheckpointError(f"{out}: already holds a checkpoint; pass --force to replace it")
    t0 = time.perf_counter()
    params = engram_params(cfg)
    spec = checkpoint_spec(cfg, tuple(params.num_embeddings))
    derived = {"engram_num_embeddings": params.num_embeddings,
               "engram_compressed_vocab_size": params.compressed_vocab_size}
    plan = _shard_plan(spec, shard_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    need = sum(tensor_nbytes(s) for s in spec.values())
    check_free(out.parent, need, "the checkpoint")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    threads = torch.get_num_threads()
    # The work is many ~1M-element elementwise ops. On a shared machine, OpenMP threads spin
    # against other processes and run these 7-10x slower than one thread does (measured on the
    # 2-core dev box). So torch runs single-threaded and the tensors are drawn in parallel instead,
    # one per Python thread (torch releases the GIL in its ops); each tensor has its own generator,
    # so the files do not depend on the thread count.
    torch.set_num_threads(1)
    pool = concurrent.futures.ThreadPoolExecutor(max(1, min(threads, os.cpu_count() or 1)))
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for i, names in enumerate(plan):
            shard = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
            drawn = pool.map(lambda name: _stored(spec[name], cfg, seed), names)
            tensors = dict(pair for pairs in drawn for pair in pairs)
            for name, t in tensors.items():
                _check_drawn(spec[name], t)
                weight_map[name] = shard
                total += t.numel() * t.element_size()
            with disk_full_is_an_error(tmp / shard, need, f"checkpoint shard {shard}"):
                _save_shard(tensors, tmp / shard)
            del tensors
        _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        _write_json(tmp / HF_CONFIG_NAME, hf_config(cfg, derived))
        _write_json(tmp / INFERENCE_CONFIG_NAME, inference_config(cfg, derived))
        _write_json(tmp / GENERATION_CONFIG_NAME, {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id})
        for f in tokenizer_files():
            shutil.copyfile(f, tmp / f.name)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        pool.shutdown(cancel_futures=True)
        torch.set_num_threads(threads)
    if console is not None:
        console.print(f"wrote {out}: {len(weight_map)} tensors in {len(plan)} shards, "
                      f"{total / 2**20:.1f} MiB, seed {seed}, {time.perf_counter() - t0:.1f} s")
    return out


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write `tensors` (contiguous, CPU) to `path` with the bytes of `safetensors.torch.save_file(
    tensors, path, metadata={"format": "pt"})`, streamed from the tensors (the library copies every
    tensor into a bytes object first: twice a shard's size in memory); mode 0644, as the JSON files."""
    prefix, order = sf.layout({n: (sf.NAMES[t.dtype], tuple(t.shape)) for n, t in tensors.items()}, {"format": "pt"})
    with open(path, "wb") as f:
        f.write(prefix)
        for name in order:
            for piece in tensor_chunks(tensors[name]):
                f.write(piece)
    os.chmod(path, 0o644)


def _check_drawn(s: TensorSpec, t: torch.Tensor) -> None:
    # spec and quantizers come from different modules: a disagreement must not reach the file
    if tuple(t.shape) != s.shape or t.dtype != TORCH_DTYPES[s.dtype]:
        raise RuntimeError(f"{s.name}: drew {t.dtype} {tuple(t.shape)}, spec says {s.dtype} {list(s.shape)}")


def _replace(tmp: Path, out: Path) -> None:
    """Rename tmp to out; an existing out (force) is moved aside first and deleted after."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()


