"""How the neuron lowering calls each NKI kernel from its custom op's arguments (torch side, no `nki` here).

The custom ops (kernels_nki/ops.py) and their NKI kernels (sparse_attn_nki.py, mqa_logits_nki.py) take
the same data in different forms. Each adapter bridges the difference around one kernel call, with
torch ops that trace on the XLA device like the rest of the step:
- `sparse_attn`: the kernel walks the index list in whole 64-slot blocks, so idx is padded with -1
  to a multiple of 64. An all-empty block leaves the online softmax bitwise unchanged (its rescale
  factor is exp(0) = 1 and it adds 0 to the sum and the output; sparse_attn_ref docstring).
- `mqa_logits` / `mqa_logits_sparse`: the kernels decode FP8/FP4 codes and UE8M0 scales on chip
  from raw bytes, so every such operand is passed as a uint8 view of the same bytes (float8_e4m3fn,
  float8_e8m0fnu, int8 and float4_e2m1fn_x2 are all one byte wide), with the format as the
  compile-time string "fp8" (q is float8_e4m3fn) or "fp4" (q holds packed e2m1 bytes, the only
  other dtype the op admits). The kernels write rows of ceil(L/256)*256 columns; the op's result is
  the [:, :L] view of that buffer, which has exactly the 512-byte row stride the op's fake declares.
  With no rows or no columns there is nothing to compute, and the kernels need at least one
  column: the adapter returns the empty result itself.

`BINDINGS` is the neuron lowering's table (compiler/backend_neuron.py NKI_KERNELS). A kernel is named
by "module:function" and imported only where the `nki` package is (its module imports `nki`).
In the exported neuron graph the kernel call is a custom op of its own, `dsneuron::nki_<kernel>`,
taking exactly the kernel's arguments (the adapter's work around it is ordinary graph ops): its
torch reference in that calling convention is the decomposition of the StableHLO composite that
compiler/stablehlo.py makes of it, and its name and constant arguments are the composite's
attributes, from which a trn host binds the NKI kernel (compiler/backend_neuron.py).
NOT RUN ON HARDWARE: tested on CPU against the NumPy stand-in of `nki` (tests/test_neuron_target.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from dsneuron.kernels_nki import mqa_logits_ref as _mqa
from dsneuron.kernels_nki.sparse_attn_ref import BLOCK_KEYS, sparse_attn_ref

#: Slot value of an empty index (the op's contract: anything outside [0, N) is empty).
EMPTY_SLOT = -1


@dataclass(frozen=True)
class NkiBinding:
    """One custom op's NKI kernel and the adapter that calls it.

    kernel: "module:function" of the `@nki.jit` kernel.
    call: call(kernel, *op_args) -> the op's result; `kernel` is the imported (and, with LNC > 1,
        grid-launched) kernel, or the kernel's custom op `op`, `op_args` the op's arguments in
        schema order.
    op: "dsneuron::nki_<kernel>", the custom op that stands for one call of the kernel in an
        exported graph (its arguments are the kernel's).
    """

    kernel: str
    call: Callable[..., torch.Tensor]
    op: str = ""


def call_sparse_attn(kernel: Any, q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """`dsneuron::sparse_attn` through `sparse_attn_kernel`.

    q [B,S,H,D] bf16, kv [B,N,D] bf16, sink [H] fp32, idx [B,S,K] int32, scale float ->
    bf16 [B,S,H,D]. idx is padded with -1 to K' = the next multiple of 64 (at least 64: a K of 0
    becomes one empty block, which gives the op's all-zero rows). The kernel's own shape check
    raises ValueError for shapes it cannot tile (H > 128, D not a multiple of 128 up to 512).
    """
    slots = idx.shape[2]
    # the kernel's 64-slot block is the contract's (sparse_attn_nki.BLOCK = sparse_attn_ref.BLOCK_KEYS)
    padded = max(BLOCK_KEYS, -(-slots // BLOCK_KEYS) * BLOCK_KEYS)
    if padded != slots:
        idx = torch.nn.functional.pad(idx, (0, padded - slots), value=EMPTY_SLOT)
    return kernel(q, kv, sink, idx, float(scale))


def call_mqa_logits(kernel: Any, q: torch.Tensor, q_sf: torch.Tensor, kv: torch.Tensor, kv_sf: torch.Tensor,
                    weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, max_seqlen_k: int) -> torch.Tensor:
    """`dsneuron::mqa_logits` through `mqa_logits_kernel`: operands and result as the op
    (q [S,H,D] e4m3fn or [S,H,D/2] packed e2m1, scales UE8M0, weights fp32/bf16, ks/ke int32 [S])
    -> bf16 [S, max_seqlen_k] with 512-byte rows. ValueError from the kernel for shapes it cannot take."""
    if q.shape[0] == 0 or max_seqlen_k == 0:
        return _empty_logits(q, max_seqlen_k)
    out = kernel(*_as_bytes(q, q_sf, kv, kv_sf), weights, ks, ke, int(max_seqlen_k), _format(q))
    return out[:, :max_seqlen_k]


def call_mqa_logits_sparse(kernel: Any, q: torch.Tensor, q_sf: torch.Tensor, kv: torch.Tensor, kv_sf: torch.Tensor,
                           weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, block_idx: torch.Tensor,
                           block_size: int) -> torch.Tensor:
    """`dsneuron::mqa_logits_sparse` through `mqa_logits_sparse_kernel`: operands as
    `call_mqa_logits`, block_idx int32 [S,NB], block_size 8|16 -> bf16 [S, NB*block_size] with
    512-byte rows. ValueError from the kernel for shapes or a block size it cannot take."""
    cols = block_idx.shape[1] * block_size
    if q.shape[0] == 0 or cols == 0:
        return _empty_logits(q, cols)
    out = kernel(*_as_bytes(q, q_sf, kv, kv_sf), weights, ks, ke, block_idx, int(block_size), _format(q))
    return out[:, :cols]


def _as_bytes(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.dtype == torch.uint8 else t.view(torch.uint8) for t in tensors]


def _format(q: torch.Tensor) -> str:
    return "fp8" if q.dtype == torch.float8_e4m3fn else "fp4"


def _empty_logits(q: torch.Tensor, cols: int) -> torch.Tensor:
    shape, stride = _mqa.logits_layout(q.shape[0], cols)
    return q.new_empty_strided(shape, stride, dtype=torch.bfloat16)


# ------------------------------------------------------------------ the kernel calls as custom ops
@torch.library.custom_op("dsneuron::nki_sparse_attn", mutates_args=(), device_types="cpu")
def nki_sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """One call of `sparse_attn_nki.sparse_attn_kernel`: q [B,S,H,D] bf16, kv [B,N,D] bf16, sink [H]
    fp32, idx [B,S,K'] int32 with K' a positive multiple of 64 (-1 = empty), scale -> bf16
    [B,S,H,D]. Reference: `sparse_attn_ref` (the padding slots add nothing)."""
    return sparse_attn_ref(q, kv, sink, idx, scale)


@nki_sparse_attn.register_fake
def _nki_sparse_attn_fake(q, kv, sink, idx, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("dsneuron::nki_mqa_logits", mutates_args=(), device_types="cpu")
def nki_mqa_logits(q: torch.Tensor, q_sf: torch.Tensor, kv: torch.Tensor, kv_sf: torch.Tensor, weights: torch.Tensor,
                   ks: torch.Tensor, ke: torch.Tensor, max_seqlen_k: int, fmt: str) -> torch.Tensor:
    """One call of `mqa_logits_nki.mqa_logits_kernel`: operands as bytes (uint8), fmt "fp8" | "fp4" ->
    bf16 [S, stride], stride = max_seqlen_k rounded up to 256. Reference: `mqa_logits_kernel_ref`."""
    return _mqa.mqa_logits_kernel_ref(q, q_sf, kv, kv_sf, weights, ks, ke, max_seqlen_k, fmt)


@nki_mqa_logits.register_fake
def _nki_mqa_logits_fake(q, q_sf, kv, kv_sf, weights, ks, ke, max_seqlen_k, fmt):
    (rows, _), (stride, _) = _mqa.logits_layout(q.shape[0], max_seqlen_k)
    return q.new_empty((rows, stride), dtype=torch.bfloat16)


@torch.library.custom_op("dsneuron::nki_mqa_logits_sparse", mutates_args=(), device_types="cpu")
def nki_mqa_logits_sparse(q: torch.Tensor, q_sf: torch.Tensor, kv: torch.Tensor, kv_sf: torch.Tensor,
                          weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, block_idx: torch.Tensor,
                          block_size: int, fmt: str) -> torch.Tensor:
    """One call of `mqa_logits_nki.mqa_logits_sparse_kernel`: as `nki_mqa_logits` with block_idx
    int32 [S, NB] -> bf16 [S, stride] for NB * block_size columns. Reference:
    `mqa_logits_sparse_kernel_ref`."""
    return _mqa.mqa_logits_sparse_kernel_ref(q, q_sf, kv, kv_sf, weights, ks, ke, block_idx, block_size, fmt)


@nki_mqa_logits_sparse.register_fake
def _nki_mqa_logits_sparse_fake(q, q_sf, kv, kv_sf, weights, ks, ke, block_idx, block_size, fmt):
    (rows, _), (stride, _) = _mqa.logits_layout(q.shape[0], block_idx.shape[1] * block_size)
    return q.new_empty((rows, stride), dtype=torch.bfloat16)


BINDINGS: dict[str, NkiBinding] = {
    "dsneuron::sparse_attn": NkiBinding("dsneuron.kernels_nki.sparse_attn_nki:sparse_attn_kernel", call_sparse_attn,
                                        "dsneuron::nki_sparse_attn"),
    "dsneuron::mqa_logits": NkiBinding("dsneuron.kernels_nki.mqa_logits_nki:mqa_logits_kernel", call_mqa_logits,
                                       "dsneuron::nki_mqa_logits"),
    "dsneuron::mqa_logits_sparse": NkiBinding("dsneuron.kernels_nki.mqa_logits_nki:mqa_logits_sparse_kernel",
                                              call_mqa_logits_sparse, "dsneuron::nki_mqa_logits_sparse"),
}
