"""The decode state's caches as bytes (graphs/quant.py StateFormat, quantize_state / dequantize_state,
kernels_nki/cpu_gemm.py state_quant / state_dequant): decoding gives the reference QDQ bit for bit,
in both spellings and through the cpu kernel, and the model's state holds exactly what it computes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsneuron.graphs import quant as Q
from dsneuron.kernels_nki import cpu_gemm
from dsneuron.kernels_nki.formats import e4m3_to_bytes, e4m3_to_float, ue8m0_to_bytes, neuron_spelling

FORMATS = {"window_kv": Q.window_format(32), "compress_kv": Q.COMPRESS_KV_FORMAT, "index_k": Q.INDEX_K_FORMAT}


def _qdq(x: torch.Tensor, fmt: Q.StateFormat) -> torch.Tensor:
    if fmt.elem == "e4m3":
        return Q.act_quant_qdq(x, fmt.block)
    return Q.fp4_act_quant_qdq(x, fmt.block, fmt.scale)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _round_trips(x: torch.Tensor, fmt: Q.StateFormat) -> None:
    K = x.shape[-1]
    want = _qdq(x, fmt).to(torch.bfloat16)
    b = Q.quantize_state(x, fmt)
    assert b.dtype == torch.uint8 and b.shape == (*x.shape[:-1], fmt.row_bytes(K))
    assert torch.equal(_bits(Q.dequantize_state(b, K, fmt).to(torch.bfloat16)), _bits(want))
    with neuron_spelling():
        bx = Q.quantize_state(x, fmt)
        vx = Q.dequantize_state(bx, K, fmt).to(torch.bfloat16)
    assert torch.equal(bx, b) and torch.equal(_bits(vx), _bits(want))
    bc = cpu_gemm.state_quant(x, fmt.block, fmt.elem, fmt.scale)
    assert torch.equal(bc, b)
    assert torch.equal(_bits(cpu_gemm.state_dequant(b, K, fmt.block, fmt.elem, fmt.scale)), _bits(want))


def test_e4m3_and_ue8m0_bytes_round_trip_every_value():
    """Every e4m3fn byte but the NaNs, and every normal power of two, in both spellings."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    b = b[(b & 0x7F) != 0x7F]
    v = e4m3_to_float(b)
    assert torch.equal(e4m3_to_bytes(v), b)
    with neuron_spelling():
        assert torch.equal(e4m3_to_bytes(v), b)
    e = torch.arange(-126, 128)
    s = torch.exp2(e.double()).float()
    assert torch.equal(ue8m0_to_bytes(s), (e + 127).to(torch.uint8))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_code_at_every_scale_decodes_to_the_qdq(name, dtype):
    """Rows that put each block's amax at every binade the format's scale reaches (and the amax
    floors), with every code value and both zeros inside the blocks."""
    fmt = FORMATS[name]
    grid = e4m3_to_float(torch.arange(127, dtype=torch.int32).to(torch.uint8)) if fmt.elem == "e4m3" else \
        torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    top = 448.0 if fmt.elem == "e4m3" else 6.0
    rows = []
    lo = -60 if fmt.scale == "e4m3" else -120  # e4m3 scales stop at 2^-9 * 6; below that the floor holds
    for e in range(lo, 100, 3):
        vals = torch.cat([grid, -grid, torch.tensor([-0.0, top])])
        vals = vals[torch.arange(fmt.block * 4) % vals.numel()] * 2.0 ** e / top
        # a value between grid points, so that rounding (and its ties) happens too
        vals[1::7] *= 1.0 + 2.0 ** -4
        rows.append(vals[: fmt.block * 4])
    x = torch.stack(rows).to(dtype)
    _round_trips(x, fmt)
    # all-zero and tiny blocks (the amax floors)
    _round_trips(torch.zeros(3, fmt.block * 2, dtype=dtype), fmt)
    _round_trips(torch.full((2, fmt.block * 2), 1e-30).to(dtype), fmt)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), decades=st.integers(-30, 30), name=st.sampled_from(sorted(FORMATS)))
def test_random_rows_decode_to_the_qdq(seed, decades, name):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 128, generator=g) * torch.exp2(torch.randint(-8, 8, (5, 1), generator=g).float() + decades)
    _round_trips(x.to(torch.bfloat16), FORMATS[name])


def _every_byte_rows(fmt: Q.StateFormat, K: int, rows: int, seed: int) -> torch.Tensor:
    """uint8 [rows, row bytes] of random bytes: every code byte and every scale byte (0, 255 and
    the NaN codes included) occurs in them."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows, fmt.row_bytes(K)), generator=g, dtype=torch.int32).to(torch.uint8)
    b.view(-1)[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # codes of row 0
    b[:256, -1] = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # a scale byte per row
    return b


@pytest.mark.parametrize("name", FORMATS)
def test_any_bytes_decode_as_the_reference_and_the_portable_build(name, portable_ops):
    """state_dequant of arbitrary bytes (not only rows state_quant wrote): the host's build, whose
    AVX2 path decodes 8 lanes at a time, equals dequantize_state's values and the portable build's
    scalar loop, NaNs at the same places (and bit for bit against the portable build)."""
    fmt = FORMATS[name]
    K = 256
    b = _every_byte_rows(fmt, K, 300, seed=3)
    fmt_code = cpu_gemm.STATE_FMTS.index((fmt.elem, fmt.scale))
    got = cpu_gemm.state_dequant(b, K, fmt.block, fmt.elem, fmt.scale)
    want = Q.dequantize_state(b, K, fmt).to(torch.bfloat16)
    nan = want.isnan()
    assert nan.any() and torch.equal(got.isnan(), nan)
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])
    assert torch.equal(_bits(portable_ops.state_dequant(b, K, fmt.block, fmt_code)), _bits(got))
    # a row of odd shape: leading dims and a non-contiguous view
    view = b.view(3, 100, -1)[:, ::2]
    assert torch.equal(_bits(cpu_gemm.state_dequant(view, K, fmt.block, fmt.elem, fmt.scale)),
                       _bits(got.view(3, 100, K)[:, ::2]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_e4m3_rows_quantise_as_the_portable_build(dtype, portable_ops):
    """state_quant of the e4m3 window format, whose AVX2 path quantises 8 lanes at a time: the same
    bytes as the portable build's scalar loop, for rows holding NaNs of both signs, infinities,
    both zeros, the largest finite values, subnormals and random values across 2^-140 .. 2^120 (a
    NaN or an infinity sets its block's scale), and as quantize_state where it is finite."""
    fmt = FORMATS["window_kv"]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-140, 120, (64, 1), generator=g).float())
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
                            3.0e38, -3.0e38, 1e-40, -1e-45, 448.0, -464.0, 0.0155, 2.0 ** -7])
    for r in range(0, 64, 4):  # every fourth row gets the specials, at varying columns
        x[r, torch.randperm(256, generator=g)[:special.numel()]] = special
    x = x.to(dtype)
    fmt_code = cpu_gemm.STATE_FMTS.index((fmt.elem, fmt.scale))
    got = cpu_gemm.state_quant(x, fmt.block, fmt.elem, fmt.scale)
    assert torch.equal(got, portable_ops.state_quant(x, fmt.block, fmt_code))
    finite = x.isfinite().all(dim=1)
    assert finite.sum() >= 40
    assert torch.equal(got[finite], Q.quantize_state(x[finite], fmt))


def test_a_fresh_row_decodes_to_positive_zeros():
    for fmt in FORMATS.values():
        z = torch.zeros(2, fmt.row_bytes(64), dtype=torch.uint8)
        for v in (Q.dequantize_state(z, 64, fmt), cpu_gemm.state_dequant(z, 64, fmt.block, fmt.elem, fmt.scale).float()):
            assert torch.equal(v, torch.zeros(2, 64)) and not torch.signbit(v).any()


def test_bad_rows_and_formats_are_refused():
    fmt = Q.COMPRESS_KV_FORMAT
    with pytest.raises(ValueError, match="72 bytes for K = 128"):
        Q.dequantize_state(torch.zeros(2, 71, dtype=torch.uint8), 128, fmt)
    with pytest.raises(ValueError, match="uint8"):
        Q.dequantize_state(torch.zeros(2, 72, dtype=torch.int8), 128, fmt)
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        Q.quantize_state(torch.zeros(2, 24), fmt)
    with pytest.raises(ValueError, match="must be one of"):
        cpu_gemm.state_quant(torch.zeros(2, 32), 16, "e4m3", "e4m3")
    with pytest.raises(ValueError, match="last dimension must be 72 bytes"):
        cpu_gemm.state_dequant(torch.zeros(2, 70, dtype=torch.uint8), 128, 16, "e2m1", "e4m3")
    with pytest.raises(ValueError, match="multiple of block"):
        cpu_gemm.state_quant(torch.zeros(2, 24), 16, "e2m1", "e4m3")
    # the fake kernels check what the C++ checks, so a bad graph fails when it is traced
    with torch._subclasses.FakeTensorMode():
        with pytest.raises(ValueError, match="72 bytes"):
            torch.ops.dsneuron.state_dequant(torch.empty(2, 70, dtype=torch.uint8), 128, 16, 2)
        assert torch.ops.dsneuron.state_quant(torch.empty(3, 128), 16, 2).shape == (3, 72)


def test_state_layout_bytes_per_token(micro_cfg):
    """The caches shrink to their formats' widths: per token of context, window rows are
    hd + hd/32 bytes (bf16: 2 hd), compressed rows hd/2 + hd/16 and index rows ihd/2 + ihd/32."""
    from dsneuron.graphs.steps import init_state, state_layout

    cfg = micro_cfg
    layout = state_layout(cfg, 2, 64)
    hd, ihd = cfg.head_dim, cfg.index_head_dim
    for name, (shape, dtype) in layout.items():
        width = {"window_kv": hd + hd // cfg.fp8_block_size, "compress_kv": hd // 2 + hd // 16,
                 "index_k": ihd // 2 + ihd // 32}.get(name.rsplit(".", 1)[1])
        if width is not None:
            assert dtype == torch.uint8 and shape[0] == 2 and shape[-1] == width, name
    state = init_state(cfg, 2, 64)
    assert all(not t.any() for n, t in state.items() if t.dtype == torch.uint8)


def test_the_models_state_holds_exactly_the_values_it_attends_over(micro_cfg, micro_golden):
    """Prefill a prompt and decode two tokens: the window ring and the compressed caches decode to
    the QDQ'd values the model captured for them (attn.window_kv, compress_kv.entry)."""
    from dsneuron.graphs import steps
    from dsneuron.graphs.context import Capture

    cfg = micro_cfg
    W, hd = cfg.window_size, cfg.head_dim
    model = micro_golden.model
    S = W + 5
    tokens = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(1))
    cap = Capture()
    E, C = steps.n_engram_cols(cfg)
    with torch.no_grad():
        _, state = steps.prefill(model, tokens, torch.tensor([S]), torch.zeros(1, S, E, C, dtype=torch.int64), cap)
    checked = 0
    for L in range(cfg.n_layers):
        kv = cap.tensors[f"layers.{L}.attn.window_kv"][0]  # [S, hd], QDQ'd
        ring = Q.dequantize_state(state[f"layers.{L}.window_kv"][0], hd, Q.window_format(cfg.fp8_block_size))
        for slot in range(W):
            p = max(p for p in range(S) if p % W == slot)
            assert torch.equal(_bits(ring[slot].bfloat16()), _bits(kv[p])), (L, slot)
        if f"layers.{L}.compress_kv" in state:
            entry = cap.tensors[f"layers.{L}.compress_kv.entry"][0]  # [S // r, hd]
            rows = Q.dequantize_state(state[f"layers.{L}.compress_kv"][0, : entry.shape[0]], hd, Q.COMPRESS_KV_FORMAT)
            assert torch.equal(_bits(rows.bfloat16()), _bits(entry)), L
            checked += 1
    assert checked == len(cfg.kv_source_layers)
    assert not math.isnan(float(ring.float().sum()))


def test_the_stablehlo_check_compares_byte_states_by_their_values(micro_cfg):
    """compiler/stablehlo_check.py `state_agreement`: two window_kv rows one FP8 code apart differ by
    one quantisation step of the value (a bound a check can hold), not by an unbounded integer;
    equal bytes stay bit-identical; a non-state output is compared as it is."""
    from dsneuron.compiler.stablehlo_check import state_agreement
    from dsneuron.graphs.steps import state_format

    fmt, K = state_format(micro_cfg, "layers.1.window_kv")
    x = torch.randn(1, 4, K, generator=torch.Generator().manual_seed(0))
    b = Q.quantize_state(x, fmt)
    assert state_agreement(micro_cfg, "layers.1.window_kv", b, b.clone()).bit_identical
    nudged = b.clone()
    nudged[0, 0, 0] += 1  # the next e4m3 code of the first value, same scale byte
    a = state_agreement(micro_cfg, "layers.1.window_kv", nudged, b)
    v = Q.dequantize_state(b, K, fmt)
    assert a.dtype == "float32" and not a.bit_identical and 0 < a.max_rel < 0.25
    assert a.max_abs == pytest.approx(abs(float(Q.dequantize_state(nudged, K, fmt)[0, 0, 0] - v[0, 0, 0])))
    assert state_format(micro_cfg, "layers.1.kv_state") is None
    with pytest.raises(ValueError, match="expected uint8 rows"):
        state_agreement(micro_cfg, "layers.1.window_kv", b[..., :-1], b)
