"""The indexer scores of the cpu target read straight from the index-key cache: fake, wrapper, reference.

The C++ op lives in kernels_nki/cpu/index_scores.cpp, built into the one extension of `cpu_gemm`
(importing this module imports that one, which builds and loads it):

    torch.ops.dsneuron.index_scores(q, index_k, w) -> bf16 [B,S,T]

q bf16 [B,S,H,D] (the FP4-QDQ'd index queries, D a multiple of 32), index_k uint8 [B,T,D/2 + D/32]
(the cache rows of graphs/quant.py INDEX_K_FORMAT: packed e2m1 codes, then one UE8M0 byte per 32),
w bf16 [B,S,H] (the head weights). Contract, bit for bit: `index_scores_ref`, the golden's
expression (`mqa_logits_ref.mqa_logits_bf16_ref` on the dequantised keys), whenever the golden's
float64 dot products are exact. For FP4-QDQ'd operands they are while the 32-element blocks of a
q row and a key span at most about 40 binades of scale between them (index_scores.cpp says why;
real activations span far fewer); past that the golden's float64 GEMM rounds in its BLAS's order
and the op's chain, the more accurate of the two, can differ from it (measured at 2^100). The
dots are float64 chains in ascending d, so the op's result depends neither on the ISA, the thread
count, the batch nor the key's place in the cache; the head sum is ATen's. Bad arguments raise
ValueError naming the argument, from the C++ op and the fake alike.

Why an op: the golden dequantises every key of the cache to bf16 and widens both operands to
float64 for one GEMM, each decode step (the two took ~260 us per indexer layer of tiny at 1,024
keys, docs/cpu-target.md); the op decodes each key into a 16-key tile and never writes it back.
"""

from __future__ import annotations

import torch

from dsneuron.kernels_nki import cpu_gemm  # noqa: F401  builds and loads the extension that registers the op
from dsneuron.kernels_nki.formats import dequantize_e2m1
from dsneuron.kernels_nki.mqa_logits_ref import mqa_logits_bf16_ref

#: elements per UE8M0 scale byte of an index key
BLOCK = 32


def check_args(q: torch.Tensor, index_k: torch.Tensor, w: torch.Tensor) -> None:
    """The C++ op's argument checks, on fake tensors too: ValueError naming the argument."""
    fn = "index_scores"
    if q.dtype != torch.bfloat16 or q.dim() != 4:
        raise ValueError(f"{fn}: q must be bf16 [B,S,H,D], got {q.dtype} {tuple(q.shape)}")
    B, S, H, D = q.shape
    if D <= 0 or D % BLOCK:
        raise ValueError(f"{fn}: q's head dim must be a positive multiple of {BLOCK}, got {D}")
    row = D // 2 + D // BLOCK
    if index_k.dtype != torch.uint8 or index_k.dim() != 3 or index_k.shape[0] != B or index_k.shape[2] != row:
        raise ValueError(f"{fn}: index_k must be uint8 [B={B},T,{row}] (D/2 e2m1 bytes and D/32 UE8M0 bytes a key), "
                         f"got {index_k.dtype} {tuple(index_k.shape)}")
    if w.dtype != torch.bfloat16 or tuple(w.shape) != (B, S, H):
        raise ValueError(f"{fn}: w must be bf16 [B={B},S={S},H={H}], got {w.dtype} {tuple(w.shape)}")


@torch.library.register_fake("dsneuron::index_scores")
def _index_scores_fake(q, index_k, w):
    check_args(q, index_k, w)
    return q.new_empty((q.shape[0], q.shape[1], index_k.shape[1]))


def index_scores(q: torch.Tensor, index_k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 [B,S,T]: `torch.ops.dsneuron.index_scores` (module docstring). Raises ValueError on a bad argument."""
    return torch.ops.dsneuron.index_scores(q, index_k, w)


def index_scores_ref(q: torch.Tensor, index_k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The golden's expression of the same scores: the keys dequantised (as graphs/quant.py
    dequantize_state does, exact in bf16), then `mqa_logits_bf16_ref`. Same arguments and result."""
    check_args(q, index_k, w)
    n = q.shape[-1] // 2
    k = dequantize_e2m1(index_k[..., :n], index_k[..., n:], BLOCK).to(torch.bfloat16)
    return mqa_logits_bf16_ref(q, k, w)
