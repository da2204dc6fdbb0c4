"""NKI kernels of `dsneuron::mqa_logits` (dense) and `dsneuron::mqa_logits_sparse` for trn2, and of
their paged variants (`paged_mqa_logits_kernel`, `paged_mqa_logits_sparse_kernel`, references in
mqa_logits_ref.py; no op calls them yet: the runtime keeps no paged cache).

Current NKI dialect (nki >= 0.3). Semantics are those of `mqa_logits_ref` (score = sum_h relu(q[h] . k)
* w[h] over UE8M0-scaled FP8 / FP4 operands, -inf outside the row's keys). Per query token, heads sit
on partitions: the token's keys are gathered by index (contiguous [ks, ke) for the dense op, candidate
blocks for the sparse one, either of them as context positions mapped through a block table for the
paged ops), decoded on chip and transposed, so all four kernels share one code path.

Operands on the Tensor Engine are bf16, not fp8, for two trn2 facts: DeepSeek's FP8 is OCP e4m3fn
(largest finite 448), while the NeuronCore-v3 Tensor Engine takes the IEEE-style float8_e4m3 whose
largest finite is 240 (OCP float8_e4m3fn and the MX block-scaled nc_matmul_mx are NeuronCore-v4 only:
nc_matmul / nc_matmul_mx docstrings, aws-neuron-sdk:nki/api/nki/isa/__init__.py); and a UE8M0 scale
per 32 elements varies along the contraction, which one matmul cannot apply. So FP4 e2m1 codes are
widened exactly to e4m3fn bytes on load (trn2 has no FP4), every e4m3fn byte is decoded exactly to
fp32 with integer operations and multiplied by its power-of-two scale, and the product, an e4m3 value
times 2^k, is exact in bf16 (4 significant bits) while it is a normal bf16 number.
Importing this module needs `nki` (the SDK or `dsneuron.kernels_nki.sim`).
"""

from typing import NamedTuple

import nki
import nki.isa as nisa
import nki.language as nl

#: Partitions, and keys per gather / transpose sub-tile (nl.tile_size.pmax).
P_MAX = 128
#: Keys per scores matmul: [H, 512] fp32 fills one 2 KiB PSUM bank (the moving free limit on trn2).
KEY_TILE = 512
#: Largest head dim handled (the indexer's is 128): the decoded query row [H, D] stays small.
D_MAX = 512
#: Elements per UE8M0 scale (DeepGEMM gran_k; formats.SCALE_BLOCK).
SCALE_BLOCK = 32
#: bf16 logits rows start every 512 bytes (mqa_logits_ref.ROW_ALIGN_ELEMS).
ROW_ALIGN = 256
#: Candidate-block sizes of the sparse op (mqa_logits_ref.SPARSE_BLOCK_SIZES) and their log2.
BLOCK_SHIFT = {8: 3, 16: 4}
FORMATS = ("fp8", "fp4")
#: Key indices are computed in fp32: exact below 2^24.
KEYS_MAX = 1 << 24
#: Smallest page of the paged kernels (DeepGEMM block_kv is 32 or 64, the seed's 64 or 128): from 32
#: tokens on, a page's bytes are a whole number of code rows (fp8 32 * D/32 scale bytes = one D-byte
#: row, fp4 half of that), so one indirect DMA row is one token's codes or scales.
PAGE_MIN = 32

# e4m3fn decode: the 7 magnitude bits placed at fp32 bits 20..26 plus exponent 120 give
# 2^(e-7) * (1 + m/8) exactly for e >= 1; a subnormal (e = 0) comes out as 2^-7 + m*2^-10 and is
# corrected to 2 * v - 2^-6 = m * 2^-9.
_E4M3_EXP_OFFSET = 120 << 23
_E4M3_SUB_FIX = -(2.0 ** -6)


def check_mqa_shapes(q_shape, q_sf_shape, kv_shape, kv_sf_shape, w_shape, n_cols, fmt):
    """Raise ValueError naming the limit when the kernels cannot run these shapes; returns D."""
    if fmt not in FORMATS:
        raise ValueError(f"mqa_logits kernels: fmt must be one of {FORMATS}, got {fmt!r}")
    if len(q_shape) != 3 or len(kv_shape) != 2:
        raise ValueError(f"mqa_logits kernels: want q [S,H,Dq] and kv [T,Dq], got {q_shape}, {kv_shape}")
    n_rows, n_heads, width = q_shape
    dim = width * (2 if fmt == "fp4" else 1)
    groups = dim // SCALE_BLOCK
    if dim % SCALE_BLOCK or not SCALE_BLOCK <= dim <= D_MAX or kv_shape[1] != width:
        raise ValueError(f"mqa_logits kernels: head dim must be a multiple of {SCALE_BLOCK} up to {D_MAX} "
                         f"and equal for q and kv, got q {q_shape}, kv {kv_shape} ({fmt})")
    if tuple(q_sf_shape) != (n_rows, n_heads, groups) or tuple(kv_sf_shape) != (kv_shape[0], groups):
        raise ValueError(f"mqa_logits kernels: scale shapes {q_sf_shape}, {kv_sf_shape} do not match D={dim}")
    if tuple(w_shape) != (n_rows, n_heads) or not 1 <= n_heads <= P_MAX:
        raise ValueError(f"mqa_logits kernels: weights [S,H] with 1 <= H <= {P_MAX}, got {w_shape}")
    if n_cols < 1 or kv_shape[0] + n_cols >= KEYS_MAX:
        raise ValueError(f"mqa_logits kernels: need 1 <= columns and T + columns < {KEYS_MAX}, got {n_cols}, T={kv_shape[0]}")
    return dim


@nki.jit
def mqa_logits_kernel(q, q_sf, kv, kv_sf, weights, ks, ke, max_seqlen_k, fmt):
    """Dense indexer logits over each row's contiguous keys, ks-relative columns.

    Dimensions:
        S query rows, H heads (1..128), D head dim (a multiple of 32 up to 512), T keys,
        L = max_seqlen_k output columns (>= 1).

    Args:
        q: [S, H, D] uint8 e4m3fn bytes (fmt "fp8") or [S, H, D/2] uint8 packed e2m1 (fmt "fp4",
            even element in the low nibble), in HBM.
        q_sf: [S, H, D/32] uint8 UE8M0 exponent bytes (2^(byte-127); 255 = NaN).
        kv: [T, D] or [T, D/2] uint8, same format as q. kv_sf: [T, D/32] uint8.
        weights: [S, H] fp32 or bf16. ks, ke: [S] int32, 0 <= ks <= ke <= T (not checked here).
        max_seqlen_k: L, compile-time int. fmt: "fp8" or "fp4", compile-time.

    Returns:
        [S, ceil(L/256)*256] bf16 in shared_hbm; columns [0, L) hold the logits, the rest is not
        written (the op returns the [:, :L] view). Column j of row s is key ks[s] + j:
        bf16(sum_h relu(q[s,h] . kv[t]) * w[s,h]), -inf where ks[s] + j >= ke[s].

    Notes:
        Dequantized operands are exact (see the module docstring; e4m3fn NaN bytes 0x7F/0xFF decode
        as +-480 and magnitudes below 2^-126 lose bits in bf16); dot products accumulate in fp32
        PSUM in the Tensor Engine's order, relu on the Scalar Engine, and the weighted head sum is
        an fp32 x fp32 matmul, so results can differ from the fp32 reference by one bf16 step.

    Pseudocode (per row s, per tile of 512 columns):
        keys = ks[s] + j; valid = keys < ke[s]; rows = gather(kv, keys if valid else T)
        scores[H, 512] = dequant(q[s]) @ dequant(rows).T; out = w[s] . relu(scores); out[~valid] = -inf
    """
    check_mqa_shapes(q.shape, q_sf.shape, kv.shape, kv_sf.shape, weights.shape, max_seqlen_k, fmt)
    out = nl.ndarray((q.shape[0], -(-max_seqlen_k // ROW_ALIGN) * ROW_ALIGN), dtype=nl.bfloat16,
                     buffer=nl.shared_hbm)
    _all_rows(out, q, q_sf, weights, max_seqlen_k, fmt, _Contiguous(kv, kv_sf, ks, ke), None, 0)
    return out


@nki.jit
def mqa_logits_sparse_kernel(q, q_sf, kv, kv_sf, weights, ks, ke, block_idx, block_size, fmt):
    """Indexer logits over each row's candidate key blocks.

    Args: as `mqa_logits_kernel`, plus
        block_idx: [S, NB] int32 in HBM; a negative entry is an empty block.
        block_size: B, 8 or 16, compile-time.

    Returns:
        [S, ceil(NB*B/256)*256] bf16 in shared_hbm; column b*B + o (< NB*B) is key
        t = block_idx[s, b]*B + ks[s] % B + o with the dense op's score, -inf where the block is
        empty, or t lies outside [ks[s], ke[s]) (or the block lies past T, which also excludes
        indices whose t would overflow int32).

    Pseudocode: as the dense kernel with keys = block_idx[s, j // B] * B + ks[s] % B + j % B and
    valid = block >= 0 and block <= T / B and ks[s] <= keys < ke[s].
    """
    if block_size not in BLOCK_SHIFT:
        raise ValueError(f"mqa_logits_sparse_kernel: block_size must be one of {tuple(BLOCK_SHIFT)}, got {block_size}")
    n_cols = block_idx.shape[1] * block_size
    check_mqa_shapes(q.shape, q_sf.shape, kv.shape, kv_sf.shape, weights.shape, n_cols, fmt)
    out = nl.ndarray((q.shape[0], -(-n_cols // ROW_ALIGN) * ROW_ALIGN), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    _all_rows(out, q, q_sf, weights, n_cols, fmt, _Contiguous(kv, kv_sf, ks, ke), block_idx, block_size)
    return out


def check_paged_shapes(q_shape, q_sf_shape, kv_cache_shape, w_shape, lens_shape, table_shape, n_cols, fmt):
    """Raise ValueError naming the limit when the paged kernels cannot run these shapes."""
    if len(q_shape) != 4 or len(q_sf_shape) != 4 or len(kv_cache_shape) != 4:
        raise ValueError(f"paged mqa_logits kernels: want q [B,N,H,Dq], q_sf [B,N,H,D/32] and kv_cache "
                         f"[pages,page,1,Dq+D/32], got {q_shape}, {q_sf_shape}, {kv_cache_shape}")
    n_seq, next_n, n_heads, width = q_shape
    n_pages, page_kv, _, token_bytes = kv_cache_shape
    groups = q_sf_shape[3]
    if len(table_shape) != 2 or table_shape[0] != n_seq or table_shape[1] < 1:
        raise ValueError(f"paged mqa_logits kernels: block_table must be [B={n_seq}, >= 1 slots], got {table_shape}")
    if tuple(q_sf_shape[:2]) != (n_seq, next_n):
        raise ValueError(f"paged mqa_logits kernels: q_sf must be [B={n_seq},N={next_n},H,D/32], got {q_sf_shape}")
    rows, capacity = n_seq * next_n, table_shape[1] * page_kv
    # the contiguous kernels' limits, with the table's capacity as the key count
    check_mqa_shapes((rows, n_heads, width), (rows, *q_sf_shape[2:]), (capacity, width), (capacity, groups),
                     w_shape, n_cols, fmt)
    if tuple(kv_cache_shape[2:]) != (1, width + groups) or page_kv < PAGE_MIN or page_kv & (page_kv - 1):
        raise ValueError(f"paged mqa_logits kernels: kv_cache must be [pages, page, 1, {width}+{groups}] with the page "
                         f"a power of two >= {PAGE_MIN}, got {kv_cache_shape}")
    if tuple(lens_shape) not in ((n_seq,), (n_seq, next_n)):
        raise ValueError(f"paged mqa_logits kernels: context_lens must be [B={n_seq}] or [B,N={next_n}], "
                         f"got {lens_shape}")
    if n_seq * table_shape[1] >= KEYS_MAX or n_pages * page_kv * token_bytes // groups >= KEYS_MAX:
        raise ValueError(f"paged mqa_logits kernels: need B * max_blocks and the cache's scale rows below {KEYS_MAX}, "
                         f"got table {table_shape}, kv_cache {kv_cache_shape}")


@nki.jit
def paged_mqa_logits_kernel(q, q_sf, kv_cache, weights, context_lens, block_table, max_context_len, fmt):
    """Dense indexer logits over a paged KV cache: each sequence's context positions through its block table.

    Dimensions:
        B sequences, N query tokens per sequence (next_n), R = B*N rows, H heads (1..128), D head dim
        (a multiple of 32 up to 512), page size (a power of two >= 32), MB table slots per sequence,
        L = max_context_len output columns (>= 1).

    Args:
        q: [B, N, H, Dq] uint8 e4m3fn bytes (fmt "fp8", Dq = D) or packed e2m1 (fmt "fp4", Dq = D/2), in HBM.
        q_sf: [B, N, H, D/32] uint8 UE8M0 exponent bytes.
        kv_cache: [pages, page, 1, Dq + D/32] uint8; page p is page * Dq code bytes (token-major), then
            page * D/32 scale bytes (`paged_mqa_logits_ref`).
        weights: [R, H] fp32 or bf16. context_lens: [B] int32 (row n of sequence b ends at
            context_lens[b] - N + n + 1) or [B, N] int32 (row ends). block_table: [B, MB] int32.
        max_context_len: L, compile-time int. fmt: "fp8" or "fp4", compile-time.

    Returns:
        [R, ceil(L/256)*256] bf16 in shared_hbm; columns [0, L) hold the logits (the rest is not
        written): column j of row b*N + n is context position j of sequence b, the contiguous
        kernel's score of the key in slot j % page of page block_table[b, j // page]; -inf from the
        row's end on, and where the reference raises instead (a position past MB * page, a page id
        in the context outside [0, pages)).

    Notes:
        As `mqa_logits_kernel`. The table itself is read by a masked gather: a key past the row's end
        reads no table slot and no page, so slots past a context may hold anything (DeepGEMM's contract).

    Pseudocode (per row r = b*N + n, per tile of 512 columns):
        j = column; valid = j < end[r]; page = gather(block_table[b], j // page_size if valid else skip)
        valid &= 0 <= page < pages; codes, scales = gather(kv_cache, page, j % page_size if valid else skip)
        then as the contiguous kernel.
    """
    check_paged_shapes(q.shape, q_sf.shape, kv_cache.shape, weights.shape, context_lens.shape, block_table.shape,
                       max_context_len, fmt)
    out = nl.ndarray((q.shape[0] * q.shape[1], -(-max_context_len // ROW_ALIGN) * ROW_ALIGN), dtype=nl.bfloat16,
                     buffer=nl.shared_hbm)
    _paged_all_rows(out, q, q_sf, kv_cache, weights, context_lens, block_table, max_context_len, fmt, None, 0)
    return out


@nki.jit
def paged_mqa_logits_sparse_kernel(q, q_sf, kv_cache, weights, context_lens, block_table, block_idx, block_size,
                                   fmt):
    """Indexer logits over each row's selected context blocks of a paged KV cache.

    Args: as `paged_mqa_logits_kernel`, plus
        block_idx: [R, NB] int32 in HBM, blocks of context positions; a negative entry is an empty block.
        block_size: B_s, 8 or 16, compile-time.

    Returns:
        [R, ceil(NB*B_s/256)*256] bf16 in shared_hbm; column b*B_s + o (< NB*B_s) of row r is context
        position block_idx[r, b]*B_s + o of the row's sequence with the dense paged score; -inf where the
        block is empty, lies past the table's MB * page positions, or the position is at or past the
        row's end (and where the dense paged kernel gives -inf).

    Pseudocode: as the dense paged kernel with j = block_idx[r, c // B_s] * B_s + c % B_s for column c and
    valid = block >= 0 and block <= MB * page / B_s and j < end[r].
    """
    if block_size not in BLOCK_SHIFT:
        raise ValueError(f"paged_mqa_logits_sparse_kernel: block_size must be one of {tuple(BLOCK_SHIFT)}, "
                         f"got {block_size}")
    n_cols = block_idx.shape[1] * block_size
    check_paged_shapes(q.shape, q_sf.shape, kv_cache.shape, weights.shape, context_lens.shape, block_table.shape,
                       n_cols, fmt)
    out = nl.ndarray((q.shape[0] * q.shape[1], -(-n_cols // ROW_ALIGN) * ROW_ALIGN), dtype=nl.bfloat16,
                     buffer=nl.shared_hbm)
    _paged_all_rows(out, q, q_sf, kv_cache, weights, context_lens, block_table, n_cols, fmt, block_idx, block_size)
    return out


def _paged_all_rows(out, q, q_sf, kv_cache, weights, context_lens, block_table, n_cols, fmt, block_idx, block_size):
    """The paged kernels' body: q and q_sf flattened to rows, the cache viewed as code and scale rows."""
    n_seq, next_n, n_heads, width = q.shape
    n_pages, page_kv, _, token_bytes = kv_cache.shape
    groups = q_sf.shape[3]
    cache_bytes = n_pages * page_kv * token_bytes
    # a page of page_kv tokens is page_kv * token_bytes / width code rows (a whole number: PAGE_MIN) or
    # page_kv * token_bytes / groups scale rows; the page's scales start page_kv * width / groups rows in
    source = _Paged(kv_cache.reshape((cache_bytes // width, width)), kv_cache.reshape((cache_bytes // groups, groups)),
                    context_lens, block_table, next_n, page_kv, n_pages)
    rows = n_seq * next_n
    _all_rows(out, q.reshape((rows, n_heads, width)), q_sf.reshape((rows, n_heads, groups)), weights, n_cols, fmt,
              source, block_idx, block_size)


class _Contiguous(NamedTuple):
    """Keys of the contiguous ops: codes kv [T, Dq] and scales kv_sf [T, D/32], one row per key, and
    each query row's range [ks, ke) (int32 [S] in HBM)."""

    kv: object
    kv_sf: object
    ks: object
    ke: object


class _Paged(NamedTuple):
    """Keys of the paged ops: the cache viewed as code rows kv [pages * R, Dq] and scale rows
    kv_sf [pages * R', D/32] (R, R' rows per page; see `_paged_all_rows`), the context lengths and block
    table (int32 in HBM), next_n query rows per sequence, the page size and the page count."""

    kv: object
    kv_sf: object
    context_lens: object
    block_table: object
    next_n: int
    page_kv: int
    n_pages: int


def _all_rows(out, q, q_sf, weights, n_cols, fmt, source, block_idx, block_size):
    """Shared body: per query row, the dequantized query and then the key tiles of `source`
    (a _Contiguous or a _Paged)."""
    n_rows, n_heads = q.shape[0], q.shape[1]
    dim = q_sf.shape[2] * SCALE_BLOCK
    chunks = -(-dim // P_MAX)
    # PSUM roles (4 of the 8 banks): bf16 transposes, fp32 transposes of the validity column,
    # scores [H, 512], weighted head sums [1, 512]
    psum = (nl.ndarray((P_MAX, P_MAX), dtype=nl.bfloat16, buffer=nl.psum),
            nl.ndarray((1, KEY_TILE), dtype=nl.float32, buffer=nl.psum),
            nl.ndarray((n_heads, KEY_TILE), dtype=nl.float32, buffer=nl.psum),
            nl.ndarray((1, KEY_TILE), dtype=nl.float32, buffer=nl.psum))
    for s in range(n_rows):
        q_codes = nl.load(q[s])
        q_scales = nl.load(q_sf[s])
        q_deq = nl.ndarray((n_heads, dim), dtype=nl.bfloat16, buffer=nl.sbuf)
        _dequantize(q_deq, q_codes, q_scales, fmt)
        q_t = nl.ndarray((P_MAX, chunks, n_heads), dtype=nl.bfloat16, buffer=nl.sbuf)
        for c in range(chunks):
            width = min(P_MAX, dim - c * P_MAX)
            nisa.nc_transpose(dst=psum[0][:width, :n_heads], data=q_deq[:, c * P_MAX:c * P_MAX + width])
            nisa.tensor_copy(dst=q_t[:width, c, :], src=psum[0][:width, :n_heads], engine=nisa.engine.scalar)
        w_col = _weights_column(weights, s)
        if isinstance(source, _Contiguous):
            bounds = _row_bounds(source.ks, source.ke, s, block_size)
        else:
            bounds = _paged_bounds(source, s, block_size)
        for t0 in range(0, n_cols, KEY_TILE):
            _key_tile(out, s, t0, min(KEY_TILE, n_cols - t0), q_t, w_col, bounds, source, fmt, block_idx,
                      block_size, psum)


def _weights_column(weights, s):
    """weights[s] -> SBUF [H, 1] fp32 (the stationary operand of the head-sum matmul)."""
    n_heads = weights.shape[1]
    w_in = nl.load(weights[s].reshape((n_heads, 1)))
    if w_in.dtype == nl.float32:
        return w_in
    w_col = nl.ndarray((n_heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=w_col, src=w_in)
    return w_col


def _row_bounds(ks, ke, s, block_size):
    """ks[s] and ke[s] broadcast to [128, 1] fp32 (exact below 2^24), and ks[s] % B for the sparse op."""
    ks_raw = _broadcast(ks, s)
    phase = None
    if block_size != 0:
        phase = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=phase, data=ks_raw, op0=nl.bitwise_and, operand0=block_size - 1)
        phase = _to_f32(phase)
    return _to_f32(ks_raw), _to_f32(_broadcast(ke, s)), phase


def _paged_bounds(source, s, block_size):
    """(0, end of row s's context, and 0 for the sparse op) broadcast to [128, 1] fp32: the end is
    context_lens[b, n] for per-row lens, context_lens[b] - N + n + 1 for per-sequence lens (s = b*N + n)."""
    zero = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zero, value=0.0)
    if len(source.context_lens.shape) == 2:
        end = _to_f32(_broadcast(source.context_lens, s))
    else:
        end = _to_f32(_broadcast(source.context_lens, s // source.next_n))
        nisa.tensor_scalar(dst=end, data=end, op0=nl.add, operand0=float(s % source.next_n + 1 - source.next_n))
    return zero, end, (zero if block_size else None)


def _broadcast(bound, s):
    """bound[s] (int32 in HBM) on every partition: a DMA whose partition stride is 0."""
    tile = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=bound.ap(pattern=[[0, P_MAX], [1, 1]], offset=s))
    return tile


def _to_f32(tile):
    as_f32 = nl.ndarray(tile.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=as_f32, src=tile)
    return as_f32


def _key_tile(out, s, t0, n, q_t, w_col, bounds, source, fmt, block_idx, block_size, psum):
    """Columns [t0, t0 + n) of row s (n <= 512): gather, decode, score, mask, store."""
    kv, kv_sf = source.kv, source.kv_sf
    n_heads = q_t.shape[2]
    dim = kv_sf.shape[1] * SCALE_BLOCK
    chunks = q_t.shape[1]
    ps_transpose, ps_valid, ps_scores, ps_sum = psum
    keys_t = nl.ndarray((P_MAX, chunks, KEY_TILE), dtype=nl.bfloat16, buffer=nl.sbuf)
    valid_row = nl.ndarray((1, KEY_TILE), dtype=nl.float32, buffer=nl.sbuf)
    for u0 in range(0, n, P_MAX):
        nu = min(P_MAX, n - u0)
        if isinstance(source, _Contiguous):
            gidx, valid = _key_column(s, t0 + u0, nu, bounds, kv.shape[0], block_idx, block_size)
            rows = (gidx, gidx)
        else:
            valid, rows = _paged_rows(s, t0 + u0, nu, bounds, source, block_idx, block_size)
        codes = nl.ndarray((nu, kv.shape[1]), dtype=nl.uint8, buffer=nl.sbuf)
        scales = nl.ndarray((nu, kv_sf.shape[1]), dtype=nl.uint8, buffer=nl.sbuf)
        # skipped (invalid) keys keep zero codes: finite scores that the -inf mask replaces
        for tile, src, row in ((codes, kv, rows[0]), (scales, kv_sf, rows[1])):
            nisa.memset(dst=tile, value=0, engine=nisa.engine.gpsimd)
            nisa.dma_copy(dst=tile, src=src.ap(pattern=[[src.shape[1], nu], [1, src.shape[1]]], offset=0,
                                               vector_offset=row, indirect_dim=0), oob_mode=nisa.oob_mode.skip)
        keys = nl.ndarray((nu, dim), dtype=nl.bfloat16, buffer=nl.sbuf)
        _dequantize(keys, codes, scales, fmt)
        for c in range(chunks):
            width = min(P_MAX, dim - c * P_MAX)
            nisa.nc_transpose(dst=ps_transpose[:width, :nu], data=keys[:, c * P_MAX:c * P_MAX + width])
            nisa.tensor_copy(dst=keys_t[:width, c, u0:u0 + nu], src=ps_transpose[:width, :nu],
                             engine=nisa.engine.scalar)
        nisa.nc_transpose(dst=ps_valid[:, :nu], data=valid)
        nisa.tensor_copy(dst=valid_row[:, u0:u0 + nu], src=ps_valid[:, :nu])

    for c in range(chunks):
        width = min(P_MAX, dim - c * P_MAX)
        nisa.nc_matmul(dst=ps_scores[:, :n], stationary=q_t[:width, c, :], moving=keys_t[:width, c, :n],
                       accumulate=(c > 0))
    relu = nl.ndarray((n_heads, KEY_TILE), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=relu[:, :n], op=nl.relu, data=ps_scores[:, :n])
    # the weighted sum over heads is a sum over partitions: an fp32 matmul with w as stationary
    nisa.nc_matmul(dst=ps_sum[:, :n], stationary=w_col, moving=relu[:, :n], accumulate=False)
    logits = nl.ndarray((1, KEY_TILE), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=logits[:, :n], src=ps_sum[:, :n])
    empty = nl.ndarray((1, KEY_TILE), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=empty[:, :n], data=valid_row[:, :n], op0=nl.equal, operand0=0.0)
    # a select, not an added -inf: a NaN score (NaN scale byte) outside the range must still read -inf
    nisa.tensor_copy_predicated(dst=logits[:, :n], src=float("-inf"), predicate=empty[:, :n])
    nl.store(out[s, t0:t0 + n], logits[:, :n])


def _key_column(s, j0, nu, bounds, n_kv, block_idx, block_size):
    """Keys of columns j0 .. j0+nu-1 of row s, one per partition: (gather rows int32 [nu, 1], with
    n_kv for an invalid key; validity fp32 [nu, 1] of 0/1)."""
    ks_f, ke_f, phase_f = bounds
    col = nl.ndarray((nu, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.iota(dst=col, pattern=[[0, 1]], offset=j0, channel_multiplier=1)
    key = nl.ndarray((nu, 1), dtype=nl.float32, buffer=nl.sbuf)
    valid = nl.ndarray((nu, 1), dtype=nl.float32, buffer=nl.sbuf)
    if block_size == 0:
        nisa.tensor_scalar(dst=key, data=col, op0=nl.add, operand0=ks_f[:nu])
    else:
        n_blocks = block_idx.shape[1]
        blocks = nl.ndarray((nu, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=blocks, src=block_idx.ap(pattern=[[1, nu // block_size], [0, block_size], [1, 1]],
                                                   offset=s * n_blocks + j0 // block_size))
        # block * B + (j % B) in integer ops (a negative block wraps harmlessly: it is invalid)
        start = nl.ndarray((nu, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=start, data=blocks, op0=nl.left_shift, operand0=BLOCK_SHIFT[block_size])
        within = nl.ndarray((nu, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=within, data=col, op0=nl.bitwise_and, operand0=block_size - 1)
        nisa.tensor_tensor(dst=start, data1=start, data2=within, op=nl.add)
        nisa.tensor_scalar(dst=key, data=start, op0=nl.add, operand0=phase_f[:nu])
        nisa.tensor_scalar(dst=valid, data=blocks, op0=nl.greater_equal, operand0=0.0)
        nisa.scalar_tensor_tensor(dst=valid, data=blocks, op0=nl.less_equal,
                                  operand0=float(n_kv >> BLOCK_SHIFT[block_size]), op1=nl.multiply, operand1=valid)
        nisa.scalar_tensor_tensor(dst=valid, data=key, op0=nl.greater_equal, operand0=ks_f[:nu], op1=nl.multiply,
                                  operand1=valid)
    if block_size == 0:
        nisa.tensor_scalar(dst=valid, data=key, op0=nl.less, operand0=ke_f[:nu])
    else:
        nisa.scalar_tensor_tensor(dst=valid, data=key, op0=nl.less, operand0=ke_f[:nu], op1=nl.multiply,
                                  operand1=valid)
    return _masked_index(key, valid, 0, n_kv), valid


def _masked_index(value, valid, offset, end):
    """int32 [nu, 1]: value + offset where valid, else exactly `end` (past the end: a gather skips it);
    (value + offset - end) * 0 is 0 for any finite value, so a garbage value cannot leak through."""
    shifted = nl.ndarray(valid.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=shifted, data=value, op0=nl.add, operand0=float(offset - end), op1=nl.multiply,
                              operand1=valid)
    index = nl.ndarray(valid.shape, dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=index, data=shifted, op0=nl.add, operand0=float(end))
    return index


def _paged_rows(s, j0, nu, bounds, source, block_idx, block_size):
    """Keys of columns j0 .. j0+nu-1 of row s through the block table: (validity fp32 [nu, 1] of 0/1,
    (code row of source.kv, scale row of source.kv_sf) int32 [nu, 1], one past the rows for an invalid key)."""
    n_seq, n_slots = source.block_table.shape
    page_kv, n_pages = source.page_kv, source.n_pages
    capacity = n_slots * page_kv
    # context positions, exactly as contiguous keys with ks = 0 and ke = the row's end
    pos, valid = _key_column(s, j0, nu, bounds, capacity, block_idx, block_size)
    # a context longer than the table (the reference raises) must not run into the next sequence's slots
    nisa.scalar_tensor_tensor(dst=valid, data=pos, op0=nl.less, operand0=float(capacity), op1=nl.multiply,
                              operand1=valid)
    slot = nl.ndarray((nu, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=slot, data=pos, op0=nl.right_shift, operand0=page_kv.bit_length() - 1)
    within = nl.ndarray((nu, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=within, data=pos, op0=nl.bitwise_and, operand0=page_kv - 1)
    # the table read itself is masked: an invalid key reads no slot, so slots past a context are never touched
    entry = _masked_index(slot, valid, (s // source.next_n) * n_slots, n_seq * n_slots)
    page = nl.ndarray((nu, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=page, value=0, engine=nisa.engine.gpsimd)
    table = source.block_table.reshape((n_seq * n_slots, 1))
    nisa.dma_copy(dst=page, src=table.ap(pattern=[[1, nu], [1, 1]], offset=0, vector_offset=entry, indirect_dim=0),
                  oob_mode=nisa.oob_mode.skip)
    # a page id outside the cache (the reference raises) makes the key invalid rather than a wild read
    nisa.scalar_tensor_tensor(dst=valid, data=page, op0=nl.greater_equal, operand0=0.0, op1=nl.multiply,
                              operand1=valid)
    nisa.scalar_tensor_tensor(dst=valid, data=page, op0=nl.less, operand0=float(n_pages), op1=nl.multiply,
                              operand1=valid)
    # codes of token t of page p: row p * (rows per page) + t; its scales follow the page's codes
    rows = []
    for src, first in ((source.kv, 0), (source.kv_sf, page_kv * source.kv.shape[1] // source.kv_sf.shape[1])):
        row = nl.ndarray((nu, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=row, data=page, op0=nl.multiply, operand0=float(src.shape[0] // n_pages),
                                  op1=nl.add, operand1=within)
        rows.append(_masked_index(row, valid, first, src.shape[0]))
    return valid, tuple(rows)


def _dequantize(dst, codes, scales, fmt):
    """codes uint8 [P, D] (fp8) or [P, D/2] (fp4) and UE8M0 bytes [P, D/32] -> dst [P, D] bf16, exactly."""
    parts, dim = dst.shape
    groups = dim // SCALE_BLOCK
    e4m3 = nl.ndarray((parts, dim), dtype=nl.int32, buffer=nl.sbuf)
    if fmt == "fp4":
        _widen_fp4(e4m3, codes)
    else:
        nisa.tensor_copy(dst=e4m3, src=codes)
    values = _decode_e4m3fn(e4m3)
    scale = _decode_ue8m0(scales)
    # one scale per 32 consecutive elements: a stride-0 view repeats it along the group
    grouped = [[dim, parts], [SCALE_BLOCK, groups], [1, SCALE_BLOCK]]
    nisa.tensor_tensor(dst=dst.ap(pattern=grouped), data1=values.ap(pattern=grouped),
                       data2=scale.ap(pattern=[[groups, parts], [1, groups], [0, SCALE_BLOCK]]), op=nl.multiply)


def _widen_fp4(dst, packed):
    """Packed e2m1 bytes [P, D/2] -> e4m3fn byte values int32 [P, D] (even element from the low nibble).

    For magnitude code c (0..7) the e4m3fn byte is 4c + 48 for c >= 2 (exponent c//2 + 6, mantissa
    bit c%2 at bit 2), 0x30 (0.5) for c = 1 and 0 for c = 0, i.e. 4c + 48 - [c < 2] * (48 - 44c);
    the sign bit 3 moves to bit 7. Every e2m1 value is an e4m3fn value, so this is exact.
    """
    parts, half = packed.shape
    wide = nl.ndarray((parts, half), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=wide, src=packed)
    for parity in range(2):
        nibble = nl.ndarray((parts, half), dtype=nl.int32, buffer=nl.sbuf)
        if parity == 0:
            nisa.tensor_scalar(dst=nibble, data=wide, op0=nl.bitwise_and, operand0=15)
        else:
            nisa.tensor_scalar(dst=nibble, data=wide, op0=nl.right_shift, operand0=4)
        code = nl.ndarray((parts, half), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=code, data=nibble, op0=nl.bitwise_and, operand0=7)
        small = nl.ndarray((parts, half), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=small, data=code, op0=nl.less, operand0=2.0)
        fix = nl.ndarray((parts, half), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=fix, data=code, op0=nl.multiply, operand0=-44.0, op1=nl.add, operand1=48.0)
        nisa.tensor_tensor(dst=fix, data1=fix, data2=small, op=nl.multiply)
        magnitude = nl.ndarray((parts, half), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=magnitude, data=code, op0=nl.multiply, operand0=4.0, op1=nl.add, operand1=48.0)
        nisa.tensor_tensor(dst=magnitude, data1=magnitude, data2=fix, op=nl.subtract)
        sign = nl.ndarray((parts, half), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=sign, data=nibble, op0=nl.bitwise_and, operand0=8, op1=nl.left_shift, operand1=4)
        nisa.tensor_tensor(dst=dst.ap(pattern=[[2 * half, parts], [2, half]], offset=parity), data1=magnitude,
                           data2=sign, op=nl.bitwise_or)


def _decode_e4m3fn(byte):
    """e4m3fn byte values int32 [P, F] -> fp32 [P, F] values (exact; see _E4M3_EXP_OFFSET)."""
    parts, free = byte.shape
    bits = nl.ndarray((parts, free), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=bits, data=byte, op0=nl.bitwise_and, operand0=0x7F, op1=nl.left_shift, operand1=20)
    # an add of two multiples of 2^20 below 2^31 is exact in the engine's fp32 arithmetic
    nisa.tensor_scalar(dst=bits, data=bits, op0=nl.add, operand0=float(_E4M3_EXP_OFFSET))
    exponent = nl.ndarray((parts, free), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=exponent, data=byte, op0=nl.bitwise_and, operand0=0x78)
    subnormal = nl.ndarray((parts, free), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=subnormal, data=exponent, op0=nl.equal, operand0=0.0)
    normal_value = bits.view(nl.float32)
    fix = nl.ndarray((parts, free), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=fix, data=normal_value, op0=nl.add, operand0=_E4M3_SUB_FIX, op1=nl.multiply,
                              operand1=subnormal)
    magnitude = nl.ndarray((parts, free), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=magnitude, data1=normal_value, data2=fix, op=nl.add)
    sign = nl.ndarray((parts, free), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=sign, data=byte, op0=nl.bitwise_and, operand0=0x80, op1=nl.left_shift, operand1=24)
    signed = nl.ndarray((parts, free), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=signed, data1=magnitude.view(nl.int32), data2=sign, op=nl.bitwise_or)
    return signed.view(nl.float32)


def _decode_ue8m0(scales):
    """UE8M0 bytes uint8 [P, G] -> fp32 2^(byte-127) [P, G]: the byte is the fp32 exponent field;
    byte 0 becomes 2^-127 (mantissa bit 22) and byte 255 NaN (inf plus mantissa bit 22)."""
    parts, groups = scales.shape
    byte = nl.ndarray((parts, groups), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=byte, src=scales)
    bits = nl.ndarray((parts, groups), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=bits, data=byte, op0=nl.left_shift, operand0=23)
    special = nl.ndarray((parts, groups), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=special, data=byte, op0=nl.equal, operand0=0.0)
    edge = nl.ndarray((parts, groups), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=edge, data=byte, op0=nl.equal, operand0=255.0)
    nisa.tensor_tensor(dst=special, data1=special, data2=edge, op=nl.bitwise_or)
    nisa.tensor_scalar(dst=special, data=special, op0=nl.left_shift, operand0=22)
    nisa.tensor_tensor(dst=bits, data1=bits, data2=special, op=nl.bitwise_or)
    return bits.view(nl.float32)
