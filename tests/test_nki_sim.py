"""The NumPy stand-in of nki (dsneuron.kernels_nki.sim): installation, documented semantics and limits.

Expected values come from NumPy float64/float32 and ml_dtypes, computed here, never from the stand-in.
The limits are the ones of aws-neuron-sdk's NKI docs (see sim.machine): partition <= 128, stationary
free <= 128, moving free <= 512 (trn3: 4096), PSUM 8 banks of 2 KiB, SBUF 192/224/256 KiB per
partition, matmul operands in SBUF and results in PSUM, no DMA from PSUM.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest

from dsneuron.kernels_nki import sim
from dsneuron.kernels_nki.sim import NkiSimError
from dsneuron.kernels_nki.sim import isa as nisa
from dsneuron.kernels_nki.sim import language as nl

BF16 = ml_dtypes.bfloat16


def run(body, *args):
    """Run `body(*hbm_tensors)` as a kernel under the stand-in; returns its NumPy output(s)."""
    return sim.jit(body)(*args)


def sbuf(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)


def hbm_out(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.shared_hbm)


def copy_out(tile):
    """SBUF tile -> new shared_hbm output."""
    out = hbm_out(tile.shape, tile.dtype)
    nisa.dma_copy(dst=out, src=tile)
    return out


# ----------------------------------------------------------------------------------- installation
def test_installed_patches_sys_modules_and_restores_them(tmp_path, monkeypatch):
    pkg = tmp_path / "simprobe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kern.py").write_text("import nki\nimport nki.language as nl\nimport nki.isa as nisa\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = {name: sys.modules.get(name) for name in ("nki", "nki.language", "nki.isa")}
    with sim.installed(("simprobe.kern",)) as (kern,):
        assert sys.modules["nki"] is sim and kern.nki is sim
        assert kern.nl is sim.language and kern.nisa is sim.isa
    assert {name: sys.modules.get(name) for name in before} == before
    assert "simprobe.kern" not in sys.modules and not hasattr(sys.modules["simprobe"], "kern")


def test_calls_outside_a_kernel_are_refused():
    with pytest.raises(NkiSimError, match="inside a kernel"):
        nl.ndarray((4, 4), dtype=nl.float32)


# ------------------------------------------------------------------------------------- semantics
def test_new_buffers_hold_the_sentinels():
    def body():
        return copy_out(sbuf((3, 5))), copy_out(sbuf((3, 5), nl.bfloat16)), copy_out(sbuf((2, 2), nl.int32))

    f32, b16, i32 = run(body)
    assert np.isnan(f32).all() and np.isnan(b16.astype(np.float32)).all() and (i32 == 4).all()


def test_matmul_is_stationary_transposed_times_moving_with_accumulate_modes():
    rng = np.random.default_rng(0)
    # small integers: every product and sum is exact, so the float64 reference is the exact answer
    st = rng.integers(-8, 9, (96, 40)).astype(BF16)
    mv = rng.integers(-8, 9, (96, 300)).astype(BF16)
    mv2 = rng.integers(-8, 9, (96, 300)).astype(BF16)

    def body(st, mv, mv2):
        a, b, c = sbuf((96, 40), nl.bfloat16), sbuf((96, 300), nl.bfloat16), sbuf((96, 300), nl.bfloat16)
        for dst, src in ((a, st), (b, mv), (c, mv2)):
            nisa.dma_copy(dst=dst, src=src)
        ps = nl.ndarray((40, 300), dtype=nl.float32, buffer=nl.psum)
        outs = []
        for accumulate in (None, None, False, True):  # first None overwrites, then adds
            nisa.nc_matmul(dst=ps, stationary=a, moving=b if accumulate is None else c, accumulate=accumulate)
            res = sbuf((40, 300))
            nisa.tensor_copy(dst=res, src=ps)
            outs.append(copy_out(res))
        return tuple(outs)

    first, doubled, overwritten, added = run(body, st, mv, mv2)
    ab = st.astype(np.float64).T @ mv.astype(np.float64)
    ac = st.astype(np.float64).T @ mv2.astype(np.float64)
    assert np.array_equal(first, ab) and np.array_equal(doubled, 2 * ab)
    assert np.array_equal(overwritten, ac) and np.array_equal(added, 2 * ac)


def _matmul_case(k=64, m=32, n=64, st_dtype=nl.bfloat16, mv_dtype=nl.bfloat16, dst_dtype=nl.float32,
                 st_buf=nl.sbuf, dst_buf=nl.psum, dst_cols=None, dst_slice=None, accumulate=None, init="none"):
    def body():
        a = nl.ndarray((k, m), dtype=st_dtype, buffer=st_buf)
        b = sbuf((k, n), mv_dtype)
        ps = nl.ndarray((m, dst_cols or n), dtype=dst_dtype, buffer=dst_buf)
        if init == "memset":
            nisa.memset(dst=ps, value=0.0)
        nisa.nc_matmul(dst=ps if dst_slice is None else ps[:, dst_slice], stationary=a, moving=b, accumulate=accumulate)
        return hbm_out((1, 1))
    return body


@pytest.mark.parametrize("case, match", [
    (dict(m=129), "partition dim 129|stationary free size 129"),
    (dict(n=513), "moving free size 513 > 512"),
    (dict(k=129), "partition dim 129"),
    (dict(st_buf=nl.psum), "must be in SBUF"),
    (dict(dst_buf=nl.sbuf), "dst must be in PSUM"),
    (dict(dst_dtype=nl.bfloat16), "dst must be float32"),
    (dict(st_dtype=nl.float32), "float32 pairs only with float32"),
    (dict(st_dtype=nl.int32, mv_dtype=nl.int32), "operand dtypes"),
    (dict(n=512, dst_cols=1024, dst_slice=slice(256, 768)), "cross a 2048-byte PSUM bank"),
    (dict(accumulate=True, init="memset"), "accumulate=True onto PSUM not written by a matmul"),
])
def test_matmul_limits_are_enforced(case, match):
    with pytest.raises(NkiSimError, match=match):
        run(_matmul_case(**case))


def test_moving_free_limit_follows_the_target(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    run(_matmul_case(n=1024, dst_cols=1024))  # 4 KiB fp32 per partition: two banks on trn3 too
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "gen3")
    with pytest.raises(NkiSimError, match="moving free size 1024 > 512 on trn2"):
        run(_matmul_case(n=1024, dst_cols=1024))


def test_psum_overflow_is_caught():
    def body(banks, cols):
        tiles = [nl.ndarray((128, cols), dtype=nl.float32, buffer=nl.psum) for _ in range(banks)]
        assert len(tiles) == banks
        return hbm_out((1, 1))

    run(body, 8, 512)
    run(body, 4, 1024)  # two banks each
    with pytest.raises(NkiSimError, match=r"PSUM overflow: 8 banks live \+ 1 new > 8"):
        run(body, 9, 512)
    with pytest.raises(NkiSimError, match="PSUM overflow"):
        run(body, 5, 1024)


@pytest.mark.parametrize("target, kib", [("trn1", 192), ("trn2", 224), ("trn3", 256), (None, 224)])
def test_sbuf_bytes_per_partition_follow_the_target(monkeypatch, target, kib):
    if target is None:
        monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    else:
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)

    def body(extra):
        full = sbuf((128, kib * 1024 // 4))
        more = sbuf((128, 1)) if extra else full
        assert more is not None
        return hbm_out((1, 1))

    run(body, False)
    with pytest.raises(NkiSimError, match=f"SBUF overflow on {target or 'trn2'}"):
        run(body, True)


def test_dropped_tiles_free_their_sbuf_bytes():
    def body():
        for _ in range(20):  # 20 x 100 KiB per partition, never more than two alive
            tile = sbuf((128, 25 * 1024))
            nisa.memset(dst=tile, value=0.0)
        return hbm_out((1, 1))

    run(body)


def test_unknown_target_is_refused(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn9")
    with pytest.raises(NkiSimError, match="trn9"):
        run(lambda: hbm_out((1, 1)))


@pytest.mark.parametrize("shape, buffer", [((129, 4), nl.sbuf), ((129, 4), nl.psum), ((0, 4), nl.sbuf), ([4, 4], nl.sbuf)])
def test_partition_limit_and_shape_rules(shape, buffer):
    def body():
        nl.ndarray(shape, dtype=nl.float32, buffer=buffer)
        return hbm_out((1, 1))

    if isinstance(shape, list):  # a list shape is accepted at run time; the static check refuses it
        run(body)
        return
    with pytest.raises(NkiSimError):
        run(body)


def test_dma_cannot_touch_psum():
    def body(src):
        ps = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=hbm_out((4, 4)), src=ps)

    with pytest.raises(NkiSimError, match="cannot read PSUM"):
        run(body, np.zeros((4, 4), np.float32))

    def body2(src):
        nisa.dma_copy(dst=nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum), src=src)

    with pytest.raises(NkiSimError, match="cannot write PSUM"):
        run(body2, np.zeros((4, 4), np.float32))


def test_transposes_are_bit_exact_and_size_limited():
    data = np.random.default_rng(1).standard_normal((100, 64)).astype(BF16)
    data[3, 5], data[7, 1], data[9, 9] = np.nan, np.inf, -np.inf

    def body(x):
        t = sbuf((100, 64), nl.bfloat16)
        nisa.dma_copy(dst=t, src=x)
        ps = nl.ndarray((64, 100), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=ps, data=t)
        back = sbuf((64, 100), nl.bfloat16)
        nisa.tensor_copy(dst=back, src=ps)
        small = sbuf((20, 30), nl.bfloat16)
        nisa.nc_transpose(dst=small, data=back[:30, :20], engine=nisa.engine.vector)
        return copy_out(back), copy_out(small)

    full, small = run(body, data)
    assert np.array_equal(full.view(np.uint16), data.T.view(np.uint16))
    assert np.array_equal(small.view(np.uint16), data[:20, :30].view(np.uint16))

    def too_big(x):
        t = sbuf((40, 40), nl.bfloat16)
        nisa.nc_transpose(dst=sbuf((40, 40), nl.bfloat16), data=t, engine=nisa.engine.vector)

    with pytest.raises(NkiSimError, match=r"up to \[32, 32\]"):
        run(too_big, data)


def test_activation_computes_op_of_scale_times_data_plus_bias_with_reduce_registers():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    bias = rng.standard_normal((6, 1)).astype(np.float32)

    def body(x, bias):
        xs, bs = sbuf((6, 40)), sbuf((6, 1))
        nisa.dma_copy(dst=xs, src=x)
        nisa.dma_copy(dst=bs, src=bias)
        y32, y16, regs1, regs2 = sbuf((6, 40)), sbuf((6, 40), nl.bfloat16), sbuf((6, 1)), sbuf((6, 1))
        nisa.activation(dst=y32, op=nl.exp, data=xs, bias=bs, scale=0.5, reduce_op=nl.add, reduce_res=regs1,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=y16, op=nl.exp, data=xs, bias=bs, scale=0.5, reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.activation(dst=sbuf((6, 40)), op=nl.relu, data=xs, reduce_res=regs2)  # idle: registers kept
        return copy_out(y32), copy_out(y16), copy_out(regs1), copy_out(regs2)

    y32, y16, regs1, regs2 = run(body, x, bias)
    want = np.exp((x * np.float32(0.5)).astype(np.float32) + bias)  # float32 throughout
    assert np.array_equal(y32, want)
    assert np.array_equal(y16.view(np.uint16), want.astype(BF16).view(np.uint16))
    row = want.sum(axis=1, dtype=np.float32)
    assert np.allclose(regs1[:, 0], row, rtol=1e-6) and np.allclose(regs2[:, 0], 2 * row, rtol=1e-6)


def test_tensor_reduce_max_and_sum_with_negate():
    x = np.random.default_rng(3).standard_normal((5, 3, 16)).astype(np.float32)

    def body(x):
        xs = sbuf((5, 3, 16))
        nisa.dma_copy(dst=xs, src=x)
        mx, sm = sbuf((5, 3)), sbuf((5, 1))
        nisa.tensor_reduce(dst=mx, op=nl.maximum, data=xs, axis=2, negate=True)
        nisa.tensor_reduce(dst=sm, op=nl.add, data=xs, axis=(1, 2))
        return copy_out(mx), copy_out(sm)

    mx, sm = run(body, x)
    assert np.array_equal(mx, -x.max(axis=2))
    assert np.allclose(sm[:, 0], x.reshape(5, -1).astype(np.float64).sum(axis=1), rtol=1e-5)

    def bad(x):
        xs = sbuf((5, 3, 16))
        nisa.tensor_reduce(dst=sbuf((5, 16)), op=nl.add, data=xs, axis=1)

    with pytest.raises(NkiSimError, match="last free axes"):
        run(bad, x)


def test_gather_by_vector_offset_skips_or_raises_out_of_bounds_rows():
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    idx = np.array([[3], [-1], [9], [10], [0]], dtype=np.int32)

    def body(table, idx, mode):
        ix, rows = sbuf((5, 1), nl.int32), sbuf((5, 4))
        nisa.dma_copy(dst=ix, src=idx)
        nisa.memset(dst=rows, value=-7.0)
        nisa.dma_copy(dst=rows, src=table.ap(pattern=[[4, 5], [1, 4]], offset=0, vector_offset=ix, indirect_dim=0),
                      oob_mode=nisa.oob_mode.skip if mode == "skip" else nisa.oob_mode.error)
        return copy_out(rows)

    got = run(body, table, idx, "skip")
    assert np.array_equal(got, np.stack([table[3], np.full(4, -7.0), table[9], np.full(4, -7.0), table[0]]))
    with pytest.raises(NkiSimError, match="index -1 of partition 1"):
        run(body, table, idx, "error")


def test_tensor_scalar_bitvec_and_arithmetic_rules():
    x = np.array([[1, -1, 0x40000001, 255]], dtype=np.int32)

    def body(x):
        xs = sbuf((1, 4), nl.int32)
        nisa.dma_copy(dst=xs, src=x)
        shl, shr, cmp = sbuf((1, 4), nl.int32), sbuf((1, 4), nl.int32), sbuf((1, 4), nl.uint8)
        nisa.tensor_scalar(dst=shl, data=xs, op0=nl.left_shift, operand0=2)
        nisa.tensor_scalar(dst=shr, data=xs, op0=nl.bitwise_and, operand0=-1, op1=nl.right_shift, operand1=28)
        nisa.tensor_scalar(dst=cmp, data=xs, op0=nl.greater, operand0=0.0)
        return copy_out(shl), copy_out(shr), copy_out(cmp)

    shl, shr, cmp = run(body, x)
    assert shl.tolist() == [[4, -4, 4, 1020]]  # wraps at 32 bits
    assert shr.tolist() == [[0, 15, 4, 0]]  # logical shift of the bit pattern
    assert cmp.tolist() == [[1, 0, 1, 1]]

    def mixed(x):
        xs = sbuf((1, 4), nl.int32)
        nisa.tensor_scalar(dst=xs, data=xs, op0=nl.left_shift, operand0=1, op1=nl.add, operand1=1)

    with pytest.raises(NkiSimError, match="both be arithmetic or bitvec"):
        run(mixed, x)


def test_int32_tensor_tensor_is_exact_and_fp32_results_round():
    a = np.array([[2 ** 30 + 1, -(2 ** 28) - 3]], dtype=np.int32)
    b = np.array([[2 ** 30 - 1, 7]], dtype=np.int32)

    def body(a, b):
        x, y, s_int, s_f32 = sbuf((1, 2), nl.int32), sbuf((1, 2), nl.int32), sbuf((1, 2), nl.int32), sbuf((1, 2))
        nisa.dma_copy(dst=x, src=a)
        nisa.dma_copy(dst=y, src=b)
        nisa.tensor_tensor(dst=s_int, data1=x, data2=y, op=nl.subtract)
        nisa.tensor_tensor(dst=s_f32, data1=x, data2=y, op=nl.subtract)
        return copy_out(s_int), copy_out(s_f32)

    s_int, s_f32 = run(body, a, b)
    assert s_int.tolist() == [[2, -(2 ** 28) - 10]]
    assert s_f32.tolist() == [[0.0, float(np.float32(-(2 ** 28) - 3) - np.float32(7))]]  # fp32 rounding


@pytest.mark.parametrize("dtype, value", [(nl.int32, 1.0), (nl.float32, 1), (nl.float32, True)])
def test_memset_value_type_must_match(dtype, value):
    def body():
        nisa.memset(dst=sbuf((2, 2), dtype), value=value)

    with pytest.raises(NkiSimError, match="does not match dtype"):
        run(body)


def test_predicated_copy_iota_reciprocal_and_copies():
    x = np.array([[1.5, -2.0, 4.0, np.nan]], dtype=np.float32)
    pred = np.array([[1, 0, 0, 1]], dtype=np.uint8)

    def body(x, pred):
        xs, ps, io, rc = sbuf((1, 4)), sbuf((1, 4), nl.uint8), sbuf((3, 4), nl.int32), sbuf((1, 4))
        nisa.dma_copy(dst=xs, src=x)
        nisa.dma_copy(dst=ps, src=pred)
        nisa.reciprocal(dst=rc, data=xs)
        nisa.tensor_copy_predicated(dst=xs, src=-np.inf, predicate=ps)
        nisa.iota(dst=io, pattern=[[10, 2], [1, 2]], offset=5, channel_multiplier=100)
        b16 = sbuf((1, 4), nl.bfloat16)
        nisa.tensor_copy(dst=b16, src=rc)
        return copy_out(xs), copy_out(io), copy_out(rc), copy_out(b16)

    sel, io, rc, b16 = run(body, x, pred)
    assert sel[0, :3].tolist() == [-np.inf, -2.0, 4.0] and sel[0, 3] == -np.inf
    assert io.tolist() == [[5, 6, 15, 16], [105, 106, 115, 116], [205, 206, 215, 216]]
    assert np.array_equal(rc[0, :3], np.float32(1) / x[0, :3])
    assert np.array_equal(b16.view(np.uint16), rc.astype(BF16).view(np.uint16))


def test_load_store_and_dma_conversions():
    x = (np.random.default_rng(4).standard_normal((7, 9)) * 3).astype(np.float32)

    def body(x):
        t = nl.load(x, dtype=nl.bfloat16)
        out = hbm_out((7, 9), nl.bfloat16)
        nl.store(out, t)
        raw = sbuf((7, 9), nl.int32)
        nisa.dma_copy(dst=raw, src=x, dge_mode=nisa.dge_mode.hwdge)
        return out

    with pytest.raises(NkiSimError, match="hwdge needs equal dtypes"):
        run(body, x)

    def body2(x):
        t = nl.load(x, dtype=nl.bfloat16)
        out = hbm_out((7, 9), nl.bfloat16)
        nl.store(out, t)
        return out

    got = run(body2, x)
    assert np.array_equal(got.view(np.uint16), x.astype(BF16).view(np.uint16))


def test_kernel_argument_and_output_rules():
    x = np.zeros((2, 2), np.float32)
    with pytest.raises(TypeError, match="tuple"):
        run(lambda a, b: hbm_out((1, 1)), x, [1, 2])
    with pytest.raises(NkiSimError, match="shared_hbm"):
        run(lambda a: sbuf((2, 2)), x)
    with pytest.raises(NkiSimError, match="shared_hbm"):
        run(lambda a: nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.hbm), x)
    with pytest.raises(TypeError, match="no options"):
        sim.jit(lambda: None, platform_target="trn2")
    assert run(lambda a, k: hbm_out((k[0], k[1])), x, (2, 3)).shape == (2, 3)


def test_counters_record_engine_work():
    def body(x):
        a = nl.load(x, dtype=nl.bfloat16)
        ps = nl.ndarray((8, 8), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=a, moving=a)
        y = sbuf((8, 8))
        nisa.activation(dst=y, op=nl.copy, data=ps)
        return copy_out(y)

    kernel = sim.jit(body)
    kernel(np.ones((8, 8), np.float32))
    stats = kernel.last_stats
    assert (stats.pe_instructions, stats.pe_columns, stats.pe_flops) == (1, 8, 2 * 8 * 8 * 8)
    assert (stats.act.instructions, stats.act.elements, stats.dve.instructions) == (1, 8, 0)
    assert (stats.hbm_read, stats.hbm_write, stats.peak_psum_banks) == (8 * 8 * 4, 8 * 8 * 4, 1)
