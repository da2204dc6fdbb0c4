"""The `dsneuron::` custom ops the model calls: CPU reference implementations plus fake (meta) ones.

Importing this module (done by `import dsneuron.kernels_nki`) registers:

    torch.ops.dsneuron.sparse_attn(q, kv, sink, idx, scale)                         -> bf16 [B,S,H,D]
    torch.ops.dsneuron.mqa_logits_bf16(q, k, w)                                     -> bf16 [B,S,T]
    torch.ops.dsneuron.mqa_logits(q, q_sf, kv, kv_sf, weights, ks, ke, max_seqlen_k) -> bf16 [S,max_seqlen_k]
    torch.ops.dsneuron.mqa_logits_sparse(q, q_sf, kv, kv_sf, weights, ks, ke, block_idx, block_size)
                                                                                    -> bf16 [S,NB*B]

Each is one opaque node for torch.export; the cpu target runs the torch reference registered here,
the neuron target swaps in an NKI kernel with the same contract. The exact semantics of each op are
the docstrings of its reference function (`sparse_attn_ref`, `mqa_logits_ref`), which the NKI
kernels and the float64 oracles in tests/ are checked against. The fake implementations run the
same shape and dtype checks, so a bad call fails at export time with the same ValueError.
"""

from __future__ import annotations

import torch

from dsneuron.kernels_nki import mqa_logits_ref as _mqa
from dsneuron.kernels_nki import sparse_attn_ref as _sa

_NS = "dsneuron"


@torch.library.custom_op(f"{_NS}::sparse_attn", mutates_args=(), device_types="cpu")
def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Sparse attention over gathered KV rows with a 64-key online softmax and a per-head sink.

    q [B,S,H,D] bf16, kv [B,N,D] bf16, sink [H] fp32, idx [B,S,K] int32 (-1 or out of [0, N) =
    empty), scale > 0 -> bf16 [B,S,H,D]. Semantics: `sparse_attn_ref.sparse_attn_ref`.
    """
    return _sa.sparse_attn_ref(q, kv, sink, idx, scale)


@sparse_attn.register_fake
def _sparse_attn_fake(q, kv, sink, idx, scale):
    _sa.check_sparse_attn_args(q, kv, sink, idx, scale)
    return q.new_empty(q.shape)


@torch.library.custom_op(f"{_NS}::mqa_logits_bf16", mutates_args=(), device_types="cpu")
def mqa_logits_bf16(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """V4.1 indexer scores on FP4-QDQ'd bf16 operands, bitwise as the model's eager expression.

    q [B,S,H,D] bf16, k [B,T,D] bf16, w [B,S,H] bf16 -> bf16 [B,S,T], unmasked.
    Semantics: `mqa_logits_ref.mqa_logits_bf16_ref`.
    """
    return _mqa.mqa_logits_bf16_ref(q, k, w)


@mqa_logits_bf16.register_fake
def _mqa_logits_bf16_fake(q, k, w):
    _mqa.check_mqa_logits_bf16_args(q, k, w)
    return q.new_empty((q.shape[0], q.shape[1], k.shape[1]))


@torch.library.custom_op(f"{_NS}::mqa_logits", mutates_args=(), device_types="cpu")
def mqa_logits(q: torch.Tensor, q_sf: torch.Tensor, kv: torch.Tensor, kv_sf: torch.Tensor, weights: torch.Tensor,
               ks: torch.Tensor, ke: torch.Tensor, max_seqlen_k: int) -> torch.Tensor:
    """Dense FP8/FP4 MQA logits over per-row key ranges [ks, ke), ks-relative columns.

    q [S,H,D] e4m3 or [S,H,D/2] packed e2m1, q_sf [S,H,D/32] UE8M0, kv [T,D] or [T,D/2], kv_sf
    [T,D/32], weights [S,H] fp32/bf16, ks/ke [S] int32 -> bf16 [S,max_seqlen_k] with 512-byte
    rows, -inf outside the range. Semantics: `mqa_logits_ref.mqa_logits_ref`.
    """
    return _mqa.mqa_logits_ref(q, q_sf, kv, kv_sf, weights, ks, ke, max_seqlen_k)


@mqa_logits.register_fake
def _mqa_logits_fake(q, q_sf, kv, kv_sf, weights, ks, ke, max_seqlen_k):
    _mqa.check_mqa_operands("mqa_logits", q, q_sf, kv, kv_sf, weights, ks, ke)
    if max_seqlen_k < 0:
        raise ValueError(f"mqa_logits: max_seqlen_k must be >= 0, got {max_seqlen_k}")
    shape, stride = _mqa.logits_layout(q.shape[0], max_seqlen_k)
    return q.new_empty_strided(shape, stride, dtype=torch.bfloat16)


@torch.library.custom_op(f"{_NS}::mqa_logits_sparse", mutates_args=(), device_types="cpu")
def mqa_logits_sparse(q: torch.Tensor, q_sf: torch.Tensor, kv: torch.Tensor, kv_sf: torch.Tensor,
                      weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, block_idx: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """FP8/FP4 MQA logits over selected key blocks of size 8 or 16 (candidate-block path).

    Operands as `mqa_logits`, block_idx [S,NB] int32 (-1 = empty) -> bf16 [S,NB*block_size] with
    512-byte rows; column b*B+o is key block_idx[s,b]*B + ks[s]%B + o, -inf when the block is empty
    or the key lies outside [ks, ke). Semantics: `mqa_logits_ref.mqa_logits_sparse_ref`.
    """
    return _mqa.mqa_logits_sparse_ref(q, q_sf, kv, kv_sf, weights, ks, ke, block_idx, block_size)


@mqa_logits_sparse.register_fake
def _mqa_logits_sparse_fake(q, q_sf, kv, kv_sf, weights, ks, ke, block_idx, block_size):
    _mqa.check_mqa_operands("mqa_logits_sparse", q, q_sf, kv, kv_sf, weights, ks, ke)
    _mqa.check_mqa_logits_sparse_extra(block_idx, block_size, q.shape[0])
    shape, stride = _mqa.logits_layout(q.shape[0], block_idx.shape[1] * block_size)
    return q.new_empty_strided(shape, stride, dtype=torch.bfloat16)
