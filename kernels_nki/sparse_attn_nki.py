"""NKI kernel of `dsneuron::sparse_attn` for trn2: gathered KV rows, 64-key online softmax with a sink.

Current NKI dialect (nki >= 0.3: `import nki`, dst-first `nki.isa` calls, outputs in shared_hbm). The
semantics are those of `sparse_attn_ref.sparse_attn_ref`; the layout follows the flash-attention
kernels of aws-neuron/nki-library (core/attention/attention_cte.py: exp with bias = -max and the fused
row sum written as bf16, P transposed for the PV matmul) with one query token per step, because every
token attends to its own index list. Importing this module needs `nki` (the SDK or the stand-in in
`dsneuron.kernels_nki.sim`); `import dsneuron.kernels_nki` does not import it.
"""

import nki
import nki.isa as nisa
import nki.language as nl

#: Partitions of SBUF/PSUM and the largest contraction of one matmul (nl.tile_size.pmax); a Python
#: int because shapes must be known while the kernel is traced.
P_MAX = 128
#: Keys per online-softmax step, in index order (sparse_attn_ref.BLOCK_KEYS; FlashMLA sm90 decode).
BLOCK = 64
#: Largest head dim: P@V writes [H, D] fp32 into one 2 KiB PSUM bank (512 fp32 per partition).
D_MAX = 512
#: -M_INIT of the reference: the running max starts at -1e30 and is kept negated, as the exp bias.
NEG_M_INIT = 1e30
#: Logit offset of an empty slot (whose zeroed row has dot 0): the lowest finite bf16. For any
#: scale >= SCALE_MIN, EMPTY_LOGIT * scale lies below M_INIT = -1e30, so an empty slot never raises
#: the running max, and exp(EMPTY_LOGIT * scale - m) underflows to exactly 0, as exp(-inf) does.
#: Being finite, it cannot make 0 * inf = NaN in the matmul that adds it to the scores.
EMPTY_LOGIT = -3.3895313892515355e38
SCALE_MIN = 1e-8
#: Gather indices are computed in fp32: exact below 2^24 rows.
ROWS_MAX = 1 << 24


def check_sparse_attn_shapes(q_shape, kv_shape, sink_shape, idx_shape, scale):
    """Raise ValueError naming the limit when the kernel cannot run these shapes (see the kernel docstring)."""
    if len(q_shape) != 4 or len(kv_shape) != 3 or len(idx_shape) != 3:
        raise ValueError(f"sparse_attn_kernel: want q [B,S,H,D], kv [B,N,D], idx [B,S,K], "
                         f"got {q_shape}, {kv_shape}, {idx_shape}")
    bsz, seqlen, n_heads, dim = q_shape
    if tuple(kv_shape[::2]) != (bsz, dim) or tuple(idx_shape[:2]) != (bsz, seqlen) or tuple(sink_shape) != (n_heads,):
        raise ValueError(f"sparse_attn_kernel: inconsistent shapes q {q_shape}, kv {kv_shape}, sink {sink_shape}, "
                         f"idx {idx_shape}")
    if dim % P_MAX or not P_MAX <= dim <= D_MAX:
        raise ValueError(f"sparse_attn_kernel: head dim must be a multiple of {P_MAX} up to {D_MAX}, got {dim}")
    if not 1 <= n_heads <= P_MAX:
        raise ValueError(f"sparse_attn_kernel: heads must be 1..{P_MAX} (one per partition), got {n_heads}")
    if idx_shape[2] < BLOCK or idx_shape[2] % BLOCK:
        raise ValueError(f"sparse_attn_kernel: top-k must be a positive multiple of {BLOCK} (pad with -1), "
                         f"got {idx_shape[2]}")
    if bsz * kv_shape[1] >= ROWS_MAX:
        raise ValueError(f"sparse_attn_kernel: B*N = {bsz * kv_shape[1]} KV rows, need < {ROWS_MAX}")
    if not SCALE_MIN <= scale < float("inf"):
        raise ValueError(f"sparse_attn_kernel: scale must be finite and >= {SCALE_MIN}, got {scale}")


@nki.jit
def sparse_attn_kernel(q, kv, sink, idx, scale):
    """Sparse attention over gathered KV rows with a per-head sink (K = V = the 512-wide row).

    Dimensions:
        B batch, S query tokens, H heads (1..128), D head dim (128, 256, 384 or 512; V4: 512),
        N KV rows per batch (B*N < 2^24), K indices per token (a multiple of 64).

    Args:
        q: [B, S, H, D] bf16 in HBM.
        kv: [B, N, D] bf16 in HBM; row n is both key and value.
        sink: [H] fp32 in HBM, the sink logit per head (natural log units, not scaled).
        idx: [B, S, K] int32 in HBM; a value outside [0, N) (-1, INT_MIN, N, ...) is an empty slot.
        scale: softmax scale, a compile-time float in [1e-8, inf).

    Returns:
        [B, S, H, D] bf16 in shared_hbm.

    Notes:
        Rounding points are the reference's (sparse_attn_ref): fp32 logits, 64-key blocks in index
        order, running max from -1e30, P = exp(s - m) written as bf16 by the activation while the
        unrounded fp32 row sum goes into l, P@V accumulated in fp32 PSUM, the sink in the denominator
        only, 0 for a row without a valid slot. The final division is a reciprocal and a multiply
        (the ALU has no divide), so an output can differ from the reference's O / l by one fp32 ulp
        before the bf16 rounding; dot products sum in the Tensor Engine's order.

    Pseudocode (per token b, s):
        qT = transpose(q[b, s]); negm = 1e30; l = 0; O = 0
        for each block of 64 slots:
            rows = gather(kv[b], idx) with empty slots zeroed
            S = qT.T @ rows.T + ones.T @ empty_offset        # [H, 64] fp32 PSUM
            negm' = min(negm, rowmax(S) * -scale); alpha = exp(negm' - negm)
            P = bf16(exp(S * scale + negm')), rowsum = sum(fp32 P)
            l = l * alpha + rowsum; O = O * alpha + P @ rows; negm = negm'
        out = bf16(O * 1 / (l + exp(sink + negm)))   (l == 0: out = 0)
    """
    check_sparse_attn_shapes(q.shape, kv.shape, sink.shape, idx.shape, scale)
    bsz, seqlen, n_heads, dim = q.shape
    n_kv = kv.shape[1]
    out = nl.ndarray((bsz, seqlen, n_heads, dim), dtype=q.dtype, buffer=nl.shared_hbm)
    kv_rows = kv.reshape((bsz * n_kv, dim))

    ones = nl.ndarray((1, n_heads), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    sink_sb = nl.ndarray((n_heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sink_sb, src=sink.reshape((n_heads, 1)))
    # one PSUM tile per role (4 of the 8 banks): transposes, scores, P^T, P@V; each is rewritten
    # in full before it is read again
    psum = (nl.ndarray((P_MAX, P_MAX), dtype=nl.bfloat16, buffer=nl.psum),
            nl.ndarray((n_heads, BLOCK), dtype=nl.float32, buffer=nl.psum),
            nl.ndarray((BLOCK, n_heads), dtype=nl.bfloat16, buffer=nl.psum),
            nl.ndarray((n_heads, dim), dtype=nl.float32, buffer=nl.psum))
    for b in range(bsz):
        for s in range(seqlen):
            q_t = _transposed_query(q, b, s, psum)
            gidx, empty_offset = _slot_tables(idx, b, s, n_kv, bsz * n_kv)
            o_acc, row_sum, neg_max = _online_softmax(q_t, kv_rows, gidx, empty_offset, ones, scale, psum)
            _finish(out, b, s, o_acc, row_sum, neg_max, sink_sb)
    return out


def _transposed_query(q, b, s, psum):
    """q[b, s] [H, D] -> SBUF [128, D/128, H] bf16: d on partitions, the contraction layout of QK^T."""
    n_heads, dim = q.shape[2], q.shape[3]
    ps_transpose = psum[0]
    q_sb = nl.load(q[b, s])
    q_t = nl.ndarray((P_MAX, dim // P_MAX, n_heads), dtype=nl.bfloat16, buffer=nl.sbuf)
    for c in range(dim // P_MAX):
        nisa.nc_transpose(dst=ps_transpose[:, :n_heads], data=q_sb[:, c * P_MAX:(c + 1) * P_MAX])
        nisa.tensor_copy(dst=q_t[:, c, :], src=ps_transpose[:, :n_heads], engine=nisa.engine.scalar)
    return q_t


def _slot_tables(idx, b, s, n_kv, n_rows):
    """Per token: gather rows [64, K/64] int32 (slot j*64+p at [p, j]; b*N + idx, or n_rows, past
    the end of kv, for an empty slot) and the empty-slot logit offset [1, K] bf16 (0 or EMPTY_LOGIT).

    Validity is decided by fp32 compares, exact for any int32 against N < 2^24; an empty slot's
    (inexact) fp32 index is multiplied by 0 before n_rows is added, so it lands exactly on n_rows.
    """
    topk = idx.shape[2]
    base = (b * idx.shape[1] + s) * topk
    cols = nl.ndarray((BLOCK, topk // BLOCK), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=cols, src=idx.ap(pattern=[[1, BLOCK], [BLOCK, topk // BLOCK]], offset=base))
    valid = nl.ndarray((BLOCK, topk // BLOCK), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=valid, data=cols, op0=nl.greater_equal, operand0=0.0)
    nisa.scalar_tensor_tensor(dst=valid, data=cols, op0=nl.less, operand0=float(n_kv), op1=nl.multiply, operand1=valid)
    shifted = nl.ndarray((BLOCK, topk // BLOCK), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=shifted, data=cols, op0=nl.add, operand0=float(b * n_kv - n_rows),
                              op1=nl.multiply, operand1=valid)
    gidx = nl.ndarray((BLOCK, topk // BLOCK), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=gidx, data=shifted, op0=nl.add, operand0=float(n_rows))

    row = nl.ndarray((1, topk), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=idx.ap(pattern=[[topk, 1], [1, topk]], offset=base))
    above = nl.ndarray((1, topk), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=above, data=row, op0=nl.greater_equal, operand0=float(n_kv), op1=nl.multiply,
                       operand1=EMPTY_LOGIT)
    below = nl.ndarray((1, topk), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=below, data=row, op0=nl.less, operand0=0.0, op1=nl.multiply, operand1=EMPTY_LOGIT)
    empty_offset = nl.ndarray((1, topk), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=empty_offset, data1=above, data2=below, op=nl.add)
    return gidx, empty_offset


def _online_softmax(q_t, kv_rows, gidx, empty_offset, ones, scale, psum):
    """The 64-key blocks of one token; returns O [H, D] fp32, l [H, 1] fp32 and -m [H, 1] fp32."""
    n_heads, dim = q_t.shape[2], kv_rows.shape[1]
    chunks = dim // P_MAX
    ps_transpose, scores, ps_p_t, ps_pv = psum
    neg_max = nl.ndarray((n_heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=neg_max, value=NEG_M_INIT)
    row_sum = nl.ndarray((n_heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=row_sum, value=0.0)
    o_acc = nl.ndarray((n_heads, dim), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=o_acc, value=0.0)
    for j in range(gidx.shape[1]):
        # empty slots are skipped by the gather and keep the zeros: P = 0 times 0, never 0 * NaN
        rows = nl.ndarray((BLOCK, dim), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=rows, value=0.0, engine=nisa.engine.gpsimd)
        nisa.dma_copy(dst=rows, src=kv_rows.ap(pattern=[[dim, BLOCK], [1, dim]], offset=0,
                                               vector_offset=gidx[:, j:j + 1], indirect_dim=0),
                      oob_mode=nisa.oob_mode.skip)
        rows_t = nl.ndarray((P_MAX, chunks, BLOCK), dtype=nl.bfloat16, buffer=nl.sbuf)
        for c in range(chunks):
            nisa.nc_transpose(dst=ps_transpose[:, :BLOCK], data=rows[:, c * P_MAX:(c + 1) * P_MAX])
            nisa.tensor_copy(dst=rows_t[:, c, :], src=ps_transpose[:, :BLOCK], engine=nisa.engine.scalar)

        for c in range(chunks):
            nisa.nc_matmul(dst=scores, stationary=q_t[:, c, :], moving=rows_t[:, c, :], accumulate=(c > 0))
        # broadcast the [1, 64] empty-slot offsets to every head: a one-partition matmul with ones
        nisa.nc_matmul(dst=scores, stationary=ones, moving=empty_offset[:, j * BLOCK:(j + 1) * BLOCK], accumulate=True)

        block_max = nl.ndarray((n_heads, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=block_max, op=nl.maximum, data=scores, axis=1)
        # max over scale * dot equals scale * max(dot): fl(x * scale) is monotone in x
        new_neg_max = nl.ndarray((n_heads, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=new_neg_max, data=block_max, op0=nl.multiply, operand0=-scale, op1=nl.minimum,
                           operand1=neg_max)
        alpha = nl.ndarray((n_heads, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=alpha, op=nl.exp, data=neg_max, bias=new_neg_max, scale=-1.0)
        p_bf16 = nl.ndarray((n_heads, BLOCK), dtype=nl.bfloat16, buffer=nl.sbuf)
        block_sum = nl.ndarray((n_heads, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=p_bf16, op=nl.exp, data=scores, bias=new_neg_max, scale=scale, reduce_op=nl.add,
                        reduce_res=block_sum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.tensor_scalar(dst=row_sum, data=row_sum, op0=nl.multiply, operand0=alpha, op1=nl.add,
                           operand1=block_sum)

        nisa.nc_transpose(dst=ps_p_t, data=p_bf16)
        p_t = nl.ndarray((BLOCK, n_heads), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=p_t, src=ps_p_t)
        nisa.nc_matmul(dst=ps_pv, stationary=p_t, moving=rows, accumulate=False)
        nisa.scalar_tensor_tensor(dst=o_acc, data=o_acc, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                  operand1=ps_pv)
        neg_max = new_neg_max
    return o_acc, row_sum, neg_max


def _finish(out, b, s, o_acc, row_sum, neg_max, sink_sb):
    """out[b, s] = bf16(O / (l + exp(sink - m))), or 0 where l == 0 (no valid slot)."""
    n_heads, dim = o_acc.shape
    total = nl.ndarray((n_heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=total, op=nl.exp, data=sink_sb, bias=neg_max, scale=1.0)
    nisa.tensor_tensor(dst=total, data1=row_sum, data2=total, op=nl.add)
    # an empty row has O = 0; dividing by 1 keeps it 0 where l + exp(sink - m) is 0 or inf
    empty = nl.ndarray((n_heads, 1), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=empty, data=row_sum, op0=nl.equal, operand0=0.0)
    nisa.tensor_copy_predicated(dst=total, src=1.0, predicate=empty)
    inv = nl.ndarray((n_heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv, data=total)
    o_bf16 = nl.ndarray((n_heads, dim), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=o_bf16, data=o_acc, op0=nl.multiply, operand0=inv)
    nl.store(out[b, s], o_bf16)
