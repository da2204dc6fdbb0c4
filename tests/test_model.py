"""The V4.1 model on the micro config: step consistency, padding, batching, rounding points.

The model amplifies 1-ulp noise (every linear re-quantises its input to FP8), so the checks are
bitwise wherever the order of operations is the same, and they compare every captured stage, not
only the logits. The tiny config runs in the slow suite.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsneuron.graphs import mhc, rope
from dsneuron.graphs.context import Capture
from dsneuron.graphs.model import Linear, select_candidate_blocks
from dsneuron.graphs.numerics import gemm_order, stable_topk_indices
from dsneuron.graphs.steps import decode, init_state, prefill, prefill_chunk


@pytest.fixture(scope="module")
def golden(micro_golden):
    return micro_golden


def _tokens(n: int, seed: int, vocab: int = 128000) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _assert_stages_equal(cap_a: dict, cap_b: dict, pos_a: int, pos_b: int):
    """Every per-token stage captured in both runs agrees at one token position: bitwise for bf16
    tensors and selections; within 8 fp32 ulps for fp32 coefficients (the mHC mixes and the
    router run fp32 GEMMs whose summation order depends on the number of rows)."""
    compared = 0
    for name, a in cap_a.items():
        # compressor/indexer tensors are per compressed group, not per token: covered by the state check
        if name not in cap_b or ".compressor." in name or ".compress_kv." in name or ".indexer." in name or name.endswith(".idx"):
            continue
        b = cap_b[name]
        if name.startswith("final."):
            ta, tb = a, b
        else:
            ta, tb = a[:, pos_a], b[:, pos_b]
        if ta.dtype == torch.float32 and not name.startswith("final."):
            torch.testing.assert_close(ta, tb, rtol=8 * 2.0 ** -23, atol=0, msg=f"stage {name}")
        else:
            assert torch.equal(ta, tb), f"stage {name} differs"
        compared += 1
    assert compared > 20


# ------------------------------------------------------------------ step consistency
# micro: window 16, ratios 2 and 1, candidate filter keeps 4 blocks x 4 positions, index_topk 8
@pytest.mark.parametrize("L", [1, 2, 15, 16, 17, 33] + [pytest.param(n, marks=pytest.mark.slow) for n in (3, 8, 18, 31, 32, 47)])
def test_prefill_then_decode_equals_longer_prefill(golden, L):
    m = golden.model
    ids = _tokens(L + 1, seed=L)
    eng = golden.engram_ids(ids)
    cap_d, cap_p = Capture(), Capture()
    _, state = prefill(m, ids[:, :L], torch.tensor([L]), eng[:, :L], routed=True)
    logits_d, state_d = decode(m, ids[:, L:], torch.tensor([L]), eng[:, L:], state, cap_d, routed=True)
    logits_p, state_p = prefill(m, ids, torch.tensor([L + 1]), eng, cap_p, routed=True)
    assert torch.equal(logits_d, logits_p)
    _assert_stages_equal(cap_d.tensors, cap_p.tensors, 0, L)
    # the whole state, the compressor's pending group included (prefill leaves it as decode does)
    for name in state_p:
        assert torch.equal(state_d[name], state_p[name]), name


def test_long_decode_chain_matches_prefill(golden):
    """20 decode steps across two window wraps and several compressor groups."""
    m = golden.model
    ids = _tokens(40, seed=99)
    eng = golden.engram_ids(ids)
    _, state = prefill(m, ids[:, :20], torch.tensor([20]), eng[:, :20], routed=True)
    for p in range(20, 40):
        logits, state = decode(m, ids[:, p:p + 1], torch.tensor([p]), eng[:, p:p + 1], state, routed=True)
    ref, _ = prefill(m, ids, torch.tensor([40]), eng, routed=True)
    assert torch.equal(logits, ref)


# ------------------------------------------------------------------ prefix invariance
# micro's window + index_topk fit in one 64-key block of sparse_attn's online softmax, so where the
# compressed part of an index list starts never shows there; this variant's do not (64 + 16)
WIDE_L = 100  # past the window, 50 ratio-2 groups (top-k choosing)


@pytest.fixture(scope="module")
def wide(micro_cfg, micro_checkpoint):
    """(golden, prompt ids [1, WIDE_L], engram ids, its prefill's (logits, state, capture)) on
    micro with window 64 and index_topk 16 (the same weights: neither changes a tensor's shape),
    capacity 128."""
    import dataclasses

    from dsneuron.graphs.golden import Golden

    g = Golden(dataclasses.replace(micro_cfg, window_size=64, index_topk=16), micro_checkpoint, 128)
    ids = _tokens(WIDE_L, seed=46)
    eng = g.engram_ids(ids)
    cap = Capture()
    with torch.inference_mode():
        logits, state = prefill(g.model, ids, torch.tensor([WIDE_L]), eng, cap, routed=True)
    return g, ids, eng, (logits, state, cap.tensors)


def _same_state(a: dict, b: dict) -> list[str]:
    return [n for n in b if not torch.equal(a[n], b[n])]


@pytest.mark.parametrize("n", [1, 17, 40, 63, 64, 65, 90])
def test_a_prefix_prefill_then_decode_steps_equal_the_longer_prefill(wide, n):
    """prefill(P[:n]) then 2 decode steps gives prefill(P[:n+2])'s logits and whole state, bit for
    bit, below and above the window (a snapshot after n tokens continued by decode steps)."""
    g, ids, eng, _ = wide
    m = g.model
    with torch.inference_mode():
        _, state = prefill(m, ids[:, :n], torch.tensor([n]), eng[:, :n], routed=True)
        for p in (n, n + 1):
            logits, state = decode(m, ids[:, p:p + 1], torch.tensor([p]), eng[:, p:p + 1], state, routed=True)
        ref, ref_state = prefill(m, ids[:, :n + 2], torch.tensor([n + 2]), eng[:, :n + 2], routed=True)
    assert torch.equal(logits, ref)
    assert not _same_state(state, ref_state)


@pytest.mark.parametrize("n", [5, 40, 64, 70])
def test_prefill_rows_do_not_depend_on_the_prompt_length(wide, n):
    """Every per-token stage of prefill(P[:n]) equals rows 0..n-1 of prefill(P), bit for bit (fp32
    ones too). The index lists and the indexer's per-call tensors are left out: they number keys
    by this call's rows (the attention they feed is compared)."""
    g, ids, eng, (_, _, full) = wide
    cap = Capture()
    with torch.inference_mode():
        prefill(g.model, ids[:, :n], torch.tensor([n]), eng[:, :n], cap, routed=True)
    compared = 0
    for name, a in cap.tensors.items():
        if name.startswith("final.") or ".indexer." in name or name.endswith(".idx") or a.shape[1] != n:
            continue
        assert torch.equal(a, full[name][:, :n]), name
        compared += 1
    assert compared > 50


@pytest.mark.parametrize("n", [1, 40, 64, 65, 90])
def test_a_chunk_from_a_prefix_snapshot_equals_the_one_shot_prefill(wide, n):
    """prefill(P[:n]) then prefill_chunk(P[n:]) gives prefill(P)'s logits and whole state, bit for
    bit: a prefix cache's hit is the request without it."""
    g, ids, eng, (ref, ref_state, _) = wide
    m = g.model
    with torch.inference_mode():
        _, state = prefill(m, ids[:, :n], torch.tensor([n]), eng[:, :n], routed=True)
        logits, state = prefill_chunk(m, ids[:, n:], torch.tensor([n]), torch.tensor([WIDE_L - n]), eng[:, n:], state,
                                      routed=True)
    assert torch.equal(logits, ref)
    assert not _same_state(state, ref_state)


# ------------------------------------------------------------------ padding and batching
@pytest.mark.parametrize("L,S", [(1, 16), (7, 16), (17, 32), (33, 64)] + [pytest.param(*p, marks=pytest.mark.slow) for p in ((16, 16), (29, 32))])
def test_right_padding_never_leaks(golden, L, S):
    m = golden.model
    ids = _tokens(L, seed=1000 + L)
    eng = golden.engram_ids(ids)
    ref, st_ref = prefill(m, ids, torch.tensor([L]), eng, routed=True)
    junk = _tokens(S - L, seed=7)
    pad_ids = torch.cat([ids, junk], 1)
    pad_eng = torch.cat([eng, torch.randint(0, 50, (1, S - L, *eng.shape[2:]))], 1)
    got, st = prefill(m, pad_ids, torch.tensor([L]), pad_eng)
    assert torch.equal(got, ref)
    for name in st_ref:
        assert torch.equal(st[name].nan_to_num(), st_ref[name].nan_to_num()), name


def test_batch_of_mixed_lengths_equals_separate_runs(golden):
    m = golden.model
    lens = [5, 17, 32]
    S = 32
    seqs = [_tokens(n + 3, seed=n) for n in lens]
    engs = [golden.engram_ids(s) for s in seqs]
    toks = torch.zeros(3, S, dtype=torch.int64)
    eng = torch.zeros(3, S, *engs[0].shape[2:], dtype=torch.int64)
    for b, n in enumerate(lens):
        toks[b, :n], eng[b, :n] = seqs[b][0, :n], engs[b][0, :n]
    logits, state = prefill(m, toks, torch.tensor(lens), eng)
    step_logits = [logits]
    for k in range(3):  # three decode steps at different positions per row
        t = torch.stack([s[0, n + k] for s, n in zip(seqs, lens)]).view(3, 1)
        e = torch.stack([g[0, n + k] for g, n in zip(engs, lens)]).unsqueeze(1)
        lg, state = decode(m, t, torch.tensor([n + k for n in lens]), e, state)
        step_logits.append(lg)
    for b, n in enumerate(lens):
        ref, st = prefill(m, seqs[b][:, :n], torch.tensor([n]), engs[b][:, :n], routed=True)
        assert torch.equal(step_logits[0][b], ref[0])
        for k in range(3):
            ref, st = decode(m, seqs[b][:, n + k:n + k + 1], torch.tensor([n + k]), engs[b][:, n + k:n + k + 1], st, routed=True)
            assert torch.equal(step_logits[k + 1][b], ref[0]), (b, k)


def test_same_inputs_bitwise_same_outputs(golden):
    ids = _tokens(23, seed=5)
    eng = golden.engram_ids(ids)
    a, sa = prefill(golden.model, ids, torch.tensor([23]), eng)
    b, sb = prefill(golden.model, ids, torch.tensor([23]), eng)
    assert torch.equal(a, b) and all(torch.equal(sa[k].nan_to_num(), sb[k].nan_to_num()) for k in sa)


def test_golden_without_its_float64_copies_gives_the_same_logits(golden, micro_checkpoint, monkeypatch):
    """Above CACHE_LIMIT_BYTES (here 0) the golden keeps no float64 weight copies and dequantises on
    each call: the same logits, bit for bit (prefill and 2 decode steps)."""
    from dsneuron.graphs import golden as G

    monkeypatch.setattr(G, "CACHE_LIMIT_BYTES", 0)
    plain = G.Golden(golden.cfg, micro_checkpoint, golden.max_seq_len)
    lins = [m for m in plain.model.modules() if isinstance(m, Linear)]
    assert lins and all(m.cached is None for m in lins) and G.float64_cache_bytes(plain.model) > 0
    seq = _tokens(8, seed=7)[0].tolist()
    want, got = golden.teacher_forced(seq, 6), plain.teacher_forced(seq, 6)
    assert len(got) == 3 and all(torch.equal(a.logits, b.logits) for a, b in zip(want, got))


def test_routed_moe_equals_dense_moe(golden):
    """Adding exact zeros for unrouted experts leaves the fp32 combine bit-identical."""
    moe = golden.model.layers[1].ffn
    x = torch.randn(1, 37, golden.cfg.dim, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(moe(x, routed=True), moe(x, routed=False))


def test_golden_logits_are_finite_with_a_healthy_spread(golden):
    recs = golden.teacher_forced(_tokens(30, seed=11)[0].tolist(), 24)
    for r in recs:
        assert torch.isfinite(r.logits).all()
        assert 0.3 < r.logits.std().item() < 5.0


# ------------------------------------------------------------------ rounding points
def test_rope_matches_complex_rotation():
    """Real-arithmetic RoPE equals the reference's complex multiply (view_as_complex * polar)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 64, generator=g).bfloat16()
    ang = torch.rand(2, 5, 32, generator=g) * 100
    cos, sin = torch.cos(ang), torch.sin(ang)
    got = rope.apply_rope(x, cos, sin)
    xc = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    ref = torch.view_as_real(xc * torch.polar(torch.ones_like(ang.double()), ang.double()).unsqueeze(2)).flatten(-2)
    # the fp32 rotation is within an fp32 ulp of the float64 one, so the bf16 results agree
    # except where that ulp straddles a bf16 rounding boundary
    assert (got.double() - ref).abs().max() <= 2 * 2.0 ** -8 * ref.abs().max()
    back = rope.apply_rope(got, cos, sin, inverse=True)
    assert (back.float() - x.float()).abs().max() < 0.05


def test_rope_tables_yarn_ramp():
    """Compressed layers use YaRN: low frequencies divided by rope_factor, high ones untouched."""
    from dsneuron.compiler.config import load_config

    cfg = load_config("tiny")[0]
    cos0, sin0 = rope.rope_tables(cfg, 2, compressed=False)
    cos1, sin1 = rope.rope_tables(cfg, 2, compressed=True)
    # position 1: angle = freq
    f0 = torch.atan2(sin0[1].double(), cos0[1].double())
    f1 = torch.atan2(sin1[1].double(), cos1[1].double())
    base0 = 1 / 10000 ** (torch.arange(0, 64, 2).double() / 64)
    torch.testing.assert_close(f0, base0, rtol=1e-5, atol=1e-7)
    base1 = 1 / 160000 ** (torch.arange(0, 64, 2).double() / 64)
    assert math.isclose(f1[0].item(), base1[0].item(), rel_tol=1e-5)  # fastest pair: no change
    assert math.isclose(f1[-1].item(), base1[-1].item() / 16, rel_tol=1e-3)  # slowest: / factor


@pytest.mark.parametrize("compressed", [False, True])
def test_rope_tables_are_the_reference_freqs_cis(compressed):
    """cos/sin are the real and imaginary parts of the reference's freqs_cis, bit for bit: the
    official precompute_freqs_cis builds torch.polar(1, pos * freq), whose cos/sin differ from
    torch.cos/torch.sin of the same angles in the last bit on ~5% of the entries."""
    from dsneuron.compiler.config import load_config

    cfg = load_config("tiny")[0]
    cos, sin = rope.rope_tables(cfg, 1024, compressed)
    rd = cfg.rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    if compressed:  # YaRN ramp of precompute_freqs_cis (original_seq_len > 0)
        def corrected(rot: float) -> float:
            return rd * math.log(cfg.original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(math.floor(corrected(cfg.beta_fast)), 0), min(math.ceil(corrected(cfg.beta_slow)), rd - 1)
        smooth = 1 - ((torch.arange(rd // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    f = torch.outer(torch.arange(1024), freqs)
    freqs_cis = torch.polar(torch.ones_like(f), f)
    assert torch.equal(cos, freqs_cis.real) and torch.equal(sin, freqs_cis.imag)


def test_hc_pre_and_post_follow_fp32_then_one_bf16_rounding():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 64, generator=g).bfloat16()
    pre = torch.rand(2, 3, 4, generator=g)
    y = mhc.hc_pre(x, pre)
    ref = (pre.double().unsqueeze(-1) * x.double()).sum(2)
    assert torch.equal(y, ref.float().bfloat16()) or (y.double() - ref).abs().max() <= 2.0 ** -8 * ref.abs().max()
    post, comb = torch.rand(2, 3, 4, generator=g), torch.rand(2, 3, 4, 4, generator=g)
    f = torch.randn(2, 3, 64, generator=g).bfloat16()
    out = mhc.hc_post(f, x, post, comb)
    ref = post.double().unsqueeze(-1) * f.double().unsqueeze(-2) + torch.einsum("bsij,bsid->bsjd", comb.double(), x.double())
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() <= 2.0 ** -8 * ref.abs().max()


def test_sinkhorn_comb_is_doubly_stochastic():
    g = torch.Generator().manual_seed(2)
    mixes = torch.randn(5, 24, generator=g)
    pre, post, comb = mhc.hc_split_sinkhorn(mixes, torch.ones(3), torch.zeros(24), 4, 20, 1e-6)
    assert torch.all(pre > 0) and torch.all(pre < 1 + 1e-5) and torch.all((post > 0) & (post < 2))
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(5, 4), atol=1e-3, rtol=0)


def test_sinkhorn_follows_the_kernel_expression_bitwise():
    """The first normalisation is exp(c - max) / sum, as the kernel writes it (official
    kernel.py hc_split_sinkhorn_kernel), not torch.softmax, which rounds ~60% of the entries
    differently; the rounds after it divide by the sums plus eps, rows then columns."""
    g = torch.Generator().manual_seed(3)
    hc, eps = 4, 1e-6
    mixes = torch.randn(64, 24, generator=g) * 3
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g)
    _, _, comb = mhc.hc_split_sinkhorn(mixes, scale, base, hc, 20, eps)
    c = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    c = torch.exp(c - c.amax(dim=-1, keepdim=True))
    c = c / c.sum(dim=-1, keepdim=True) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(19):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    assert torch.equal(comb, c)


def test_stable_topk_tie_rule_prefers_lower_position():
    s = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -math.inf]])
    assert stable_topk_indices(s, 2).tolist() == [[1, 2]]
    assert stable_topk_indices(s, 4).tolist() == [[1, 2, 4, 3]]
    s = torch.full((1, 6), -math.inf)
    assert stable_topk_indices(s, 3).tolist() == [[0, 1, 2]]


def test_candidate_blocks_keep_best_blocks_and_pin_the_newest():
    inf = math.inf
    # 10 positions, blocks of 4: [0..3] [4..7] [8,9]; compress_len 10 -> newest block 2 pinned
    s = torch.tensor([[5.0, 0, 0, 0, 1, 9, 0, 0, -1, -2]])
    keep = select_candidate_blocks(s, torch.tensor([[10]]), topk_blocks=2, block_size=4)
    assert keep.tolist() == [[False] * 4 + [True] * 4 + [True] * 2]
    # a query that reaches only block 0 keeps nothing else, even with room for more blocks
    s2 = torch.tensor([[5.0, 1, -inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf]])
    keep = select_candidate_blocks(s2, torch.tensor([[2]]), topk_blocks=3, block_size=4)
    assert keep.tolist() == [[True] * 4 + [False] * 6]
    # nothing reachable (compress_len 0): nothing kept
    keep = select_candidate_blocks(torch.full((1, 10), -inf), torch.tensor([[0]]), topk_blocks=3, block_size=4)
    assert not keep.any()


def test_compressor_pools_with_a_per_feature_softmax(golden):
    comp = golden.model.layers[golden.cfg.kv_source_layers[0]].attn.compressor
    assert comp.ratio == 2
    x = torch.randn(1, 5, golden.cfg.dim, generator=torch.Generator().manual_seed(4)).bfloat16()
    fresh = init_state(golden.cfg, 1, 64)
    L = golden.cfg.kv_source_layers[0]
    latent, kvs, scs = comp.prefill(x, torch.tensor([5]), fresh[f"layers.{L}.kv_state"], fresh[f"layers.{L}.score_state"])
    kv = x.double() @ comp.wkv.weight.double().T
    sc = x.double() @ comp.wgate.weight.double().T
    pooled = (kv[0, :4].view(2, 2, -1) * sc[0, :4].view(2, 2, -1).softmax(1)).sum(1)
    ref = comp.norm(pooled.float().bfloat16().unsqueeze(0))
    diff = (latent.double() - ref.double()).abs().max()
    assert latent.shape == (1, 2, golden.cfg.head_dim) and diff <= 2 * 2.0 ** -8 * ref.double().abs().max()
    # the odd last token waits in slot 0; slot 1 keeps position 3, as 5 decode steps leave it
    for slot, t in ((0, 4), (1, 3)):
        torch.testing.assert_close(kvs[0, slot].double(), kv[0, t], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(scs[0, slot].double(), sc[0, t], rtol=1e-5, atol=1e-5)
    kvs, scs = comp.prefill(x[:, :1], torch.tensor([1]), fresh[f"layers.{L}.kv_state"], fresh[f"layers.{L}.score_state"])[1:]
    assert torch.isinf(scs[0, 1]).all() and (kvs[0, 1] == 0).all()  # no position reached slot 1: empty


def _window_positions(i: int, window: int) -> list[int]:
    """The window part of the index list of a query at position i, as positions: W slots, slot j
    holding position i-W+1+j, -1 before position 0 (the layout of every step kind)."""
    return [t if t >= 0 else -1 for t in range(i - window + 1, i + 1)]


def test_decode_window_index_list_is_the_ring_oldest_first(golden):
    """Decode at position p lists the positions p-W+1 .. p by their ring slots (position % W);
    positions before 0 (the ring still filling) are -1, at the front."""
    att = golden.model.layers[0].attn
    W = golden.cfg.window_size
    for p in (0, 5, W - 1, W, W + 3, 3 * W + 7):
        state = init_state(golden.cfg, 1, 64)
        ctx = golden.model.inputs(1, torch.tensor([[p]]), None, torch.tensor([p]))
        kv = torch.zeros(1, 1, golden.cfg.head_dim, dtype=torch.bfloat16)
        _, idx = att._window(kv, kv, ctx, state, {})
        assert idx[0, 0].tolist() == [t % W if t >= 0 else -1 for t in _window_positions(p, W)], p


@pytest.mark.parametrize("L,S", [(9, 9), (9, 32), (21, 21), (21, 32)])
def test_prefill_index_list_has_the_decode_layout(golden, L, S):
    """Every compressed layer's prefill index list for query i is decode's at position i: the
    window part W wide (this call's rows i-W+1 .. i, -1 before row 0), then the compressed entries
    of the layer's index source at offset W, whatever the prompt length and the bucket (S > L
    pads the prompt). Not the reference's prefill layout (model docstring)."""
    cfg, m = golden.cfg, golden.model
    ids = torch.cat([_tokens(L, seed=50 + L), _tokens(S - L, seed=7)], 1)
    eng = torch.cat([golden.engram_ids(ids[:, :L]), torch.zeros(1, S - L, *golden.engram_ids(ids[:, :1]).shape[2:],
                                                                  dtype=torch.int64)], 1)
    cap = Capture()
    prefill(m, ids, torch.tensor([L]), eng, cap)
    checked = 0
    for layer in range(cfg.n_layers):
        if not cfg.compress_ratios[layer]:
            continue
        source = max(s for s in cfg.index_source_layers if s <= layer)
        topk = cap.tensors[f"layers.{source}.indexer.topk"][0]  # [S, K] (offset S, -1 unreachable)
        idx = cap.tensors[f"layers.{layer}.attn.idx"][0]
        assert idx.shape == (S, cfg.window_size + cfg.index_topk)
        for i in range(L):
            assert idx[i].tolist() == _window_positions(i, cfg.window_size) + topk[i].tolist(), (layer, i)
        checked += 1
    assert checked >= 3


@pytest.mark.slow
def test_tiny_logits_finite_with_a_healthy_spread(tmp_path_factory):
    """tiny at the 11-, 172- and 715-token prompt lengths (candidate filter active at 715)."""
    from dsneuron.compiler.config import load_config
    from dsneuron.graphs.checkpoint_make import make_checkpoint
    from dsneuron.graphs.golden import Golden

    cfg, ccfg, _ = load_config("tiny")
    ckpt = make_checkpoint(cfg, tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)
    golden = Golden(cfg, ckpt, ccfg.max_seq_len)
    for n in (11, 172, 715):
        rec = golden.teacher_forced(_tokens(n + 1, seed=n)[0].tolist(), n)
        for r in rec:
            assert torch.isfinite(r.logits).all()
            assert 0.3 < r.logits.std().item() < 5.0


def test_random_checkpoint_is_numerically_healthy(golden):
    """The random checkpoint exercises every path: residual RMS grows smoothly, every expert is
    used, the SwiGLU clamp fires on roughly 1% of elements, logits have std near 1."""
    from dsneuron.graphs.golden import health_stats

    h = health_stats(golden, n_tokens=64)
    rms = h["residual_rms_per_layer"]
    assert all(0.5 < b / a < 2.0 for a, b in zip(rms, rms[1:])), rms
    assert all(min(u) > 0 for u in h["tokens_per_expert"]), h["tokens_per_expert"]
    assert 0.001 < h["swiglu_clamp_rate"] < 0.05, h["swiglu_clamp_rate"]
    assert 0.5 < h["logits_std"] < 2.0 and h["nonfinite_logits"] == 0


@pytest.mark.parametrize("kind", ["decode", pytest.param("prefill", marks=pytest.mark.slow)])
def test_steps_export_at_fixed_shapes_with_single_custom_op_nodes(golden, kind):
    """torch.export traces each step without data-dependent control flow; the hot spots stay one
    custom-op node each and the exported program computes what the eager step computes."""
    from dsneuron.graphs.steps import DecodeStep, PrefillStep

    mod = DecodeStep(golden.model, 1) if kind == "decode" else PrefillStep(golden.model, 1, 16)
    inputs = mod.example_inputs()
    ep = torch.export.export(mod, inputs, strict=False)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    n_attn = sum(t.startswith("dsneuron.sparse_attn") for t in targets)
    n_index = sum(t.startswith("dsneuron.mqa_logits_bf16") for t in targets)
    cfg = golden.cfg
    assert n_attn == cfg.n_layers and n_index == len(cfg.index_source_layers)
    for a, b in zip(ep.module()(*inputs), mod(*inputs)):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("order", ["ascending", "fused"])
def test_decode_moe_gathers_only_the_routed_experts(golden, order):
    """With fewer (token, expert) pairs than experts (a decode step) the exported MoE dequantises
    only the routed experts' packed bytes and adds them in ascending expert id: bit-identical to
    the routed loop, from the stored bytes as from the golden's cached fp32 copies."""
    moe = golden.model.layers[1].ffn
    max_tokens = (moe.n_experts - 1) // moe.gate.topk
    assert max_tokens >= 2
    linears = [lin for ex in moe.experts for lin in (ex.w1, ex.w2, ex.w3)]
    cached = [lin.cached for lin in linears]
    for n in (1, max_tokens):
        x = torch.randn(1, n, golden.cfg.dim, generator=torch.Generator().manual_seed(n)).bfloat16()
        with gemm_order(order):
            want = moe(x, routed=True)
            assert torch.equal(moe(x, routed=False), want)
            try:
                for lin in linears:
                    lin.cached = None
                assert torch.equal(moe(x, routed=False), want)
            finally:
                for lin, c in zip(linears, cached):
                    lin.cached = c


def test_sinkhorn_is_a_loop_op_when_exported_and_the_same_bits_eagerly():
    """Exported (the cpu target's graphs) the Sinkhorn rounds stay one while_loop node; eagerly they
    run as plain ATen ops (no torch.compile region: graphs/mhc.py), with the exported program's bits."""
    g = torch.Generator().manual_seed(4)
    hc, eps = 4, 1e-6
    mixes = torch.randn(3, 50, 24, generator=g) * 2
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g)

    class Split(torch.nn.Module):
        def forward(self, m):
            return mhc.hc_split_sinkhorn(m, scale, base, hc, 20, eps)

    program = torch.export.export(Split(), (mixes,), strict=False)
    assert "while_loop" in str(program.graph)
    eager = Split()(mixes)
    assert all(torch.equal(a, b) for a, b in zip(program.module()(mixes), eager))
