"""Speculative decoding (runtime_min/core/speculative.py) with DSpark (graphs/dspark.py) on the micro golden.

Greedy speculation must give plain greedy decoding's tokens, the logits each token was chosen from
and the decode state, bit for bit: a verify is a chunk (bit-identical to its decode steps) read at
every position, and the state after a rejection is the replay of the kept tokens. The oracle
drafter here is TEST-ONLY: it proposes the model's own greedy tokens (known from plain decoding),
optionally wrong at one draft position, so every acceptance count is exercised; the real DSpark
drafter (random weights) accepts almost nothing. Sampling: speculative rejection sampling leaves
the target's distribution (a chi-square test, bounded: fixed seed, fixed trials).

micro: window 16, DSpark block 3 (k = 3), target layers 3, 4, 5 (layer 2 has engram: layer 3's
stream is layer 2's output), one DSpark stage. A golden step costs ~2 s on 2 shared cores, so the
sequences are short; the 1,000-step forced rejection is `-m slow`.
"""

from __future__ import annotations

import pytest
import torch

from dsneuron.graphs.steps import decode, prefill
from dsneuron.runtime_min.core import speculative as sp

PROMPT = [5, 17, 23, 99, 1234, 40000]
N = 5  # new tokens
K = 3  # micro's dspark_block_size


class OracleDrafter:
    """TEST-ONLY drafter: proposes the continuation of `seq` (prompt + plain greedy tokens) after
    the fed token, with the draft at position `wrong_at` replaced by a wrong token in every step
    (None: never wrong). Each row has its own wrong_at."""

    block = K

    def __init__(self, seq: list[int], wrong_at: list[int | None], vocab: int):
        self.seq, self.wrong_at, self.vocab = seq, wrong_at, vocab

    def start(self, batch):
        return None

    def seed(self, cache, main_hidden, start, count):
        return None

    def propose(self, cache, token, pos, k, temperature, generator):
        out = torch.zeros(len(self.wrong_at), k, dtype=torch.int64)
        for b, w in enumerate(self.wrong_at):
            for j in range(k):
                t = self.seq[min(int(pos[b]) + 2 + j, len(self.seq) - 1)]
                out[b, j] = (t + 1) % self.vocab if j == w else t
        return out, None


@pytest.fixture(scope="module")
def plain(micro_golden):
    """Plain greedy decoding of PROMPT for N tokens: (tokens, the logits each was chosen from, the
    state after each token fed: states[i] after tokens[:i] (states[0]: the prefill's))."""
    g = micro_golden
    seq = list(PROMPT)
    with torch.inference_mode():
        logits, state = prefill(g.model, torch.tensor([seq]), torch.tensor([len(seq)]), g.engram_ids(torch.tensor([seq])),
                                routed=True)
        tokens, chosen, states = [int(logits.argmax())], [logits[0]], [state]
        for _ in range(N - 1):
            seq.append(tokens[-1])
            eng = g.engram_ids(torch.tensor([seq]))[:, -1:]
            logits, state = decode(g.model, torch.tensor([[seq[-1]]]), torch.tensor([len(seq) - 1]), eng, state,
                                   routed=True)
            tokens.append(int(logits.argmax()))
            chosen.append(logits[0])
            states.append(state)
    return tokens, chosen, states


@pytest.fixture(scope="module")
def drafter(micro_golden, micro_checkpoint):
    from dsneuron.graphs.checkpoint import load_checkpoint
    from dsneuron.graphs.dspark import DSpark, DSparkDrafter
    from dsneuron.graphs.engram import engram_layout

    cfg = micro_golden.cfg
    ckpt = load_checkpoint(micro_checkpoint, cfg, engram_layout(cfg).num_embeddings)
    return DSparkDrafter(DSpark.from_checkpoint(micro_golden.model, {n: t for n, t in ckpt.items() if n.startswith("mtp.")},
                                                micro_golden.max_seq_len))


def _same_as_plain(res: sp.Generation, plain, row: int, n: int = N) -> None:
    """Row `row` of a speculative generation of n tokens is plain decoding's first n, bit for bit."""
    tokens, chosen, states = plain
    state = states[n - 1]
    assert res.tokens[row] == tokens[:n], row
    assert len(res.logits[row]) == n and all(torch.equal(a, b) for a, b in zip(res.logits[row], chosen)), row
    spec_state = res.state[0]
    bad = [n for n in state if not torch.equal(spec_state[n][row].nan_to_num(), state[n][0].nan_to_num())]
    assert not bad, (row, bad)


@pytest.mark.slow
def test_forced_rejection_at_every_position_equals_plain_decoding(micro_golden, plain):
    """Four rows of one batch, the oracle wrong at draft 0, 1, 2 and never: each row keeps that many
    drafts a step (rows advance by different counts in the same calls) and ends with plain
    decoding's tokens, logits and state, bit for bit."""
    from golden_target import GoldenTarget

    wrong = [0, 1, 2, None]
    oracle = OracleDrafter(PROMPT + plain[0], wrong, micro_golden.cfg.vocab_size)
    res = sp.generate(GoldenTarget(micro_golden), oracle, [PROMPT] * len(wrong), N, K)
    for row in range(len(wrong)):
        _same_as_plain(res, plain, row)
    # the steps in call order, the active rows in each: step 1 offers 3 drafts to every row, row j
    # keeps j (row 3: all, 1 + 3 tokens, done); then a row near its budget is offered fewer
    # (row 1: 1 draft, kept; row 2: none); row 0 keeps none in each of its 4 steps
    assert res.stats.accepted == [1, 2, 3, 4, 1, 2, 1, 1, 1]
    assert res.stats.per_position == [4, 2, 1] and res.stats.replays == 3


@pytest.mark.slow
def test_dspark_drafter_greedy_equals_plain_decoding(micro_golden, plain, drafter):
    """The real drafter (random weights: it accepts ~nothing) through the same loop: plain
    decoding's tokens, logits and state bit for bit; the drafts are DSpark's own."""
    from golden_target import GoldenTarget

    res = sp.generate(GoldenTarget(micro_golden), drafter, [PROMPT], 3, K)
    _same_as_plain(res, plain, 0, 3)
    assert sum(res.stats.proposed) > 0 and res.stats.mean_acceptance >= 1.0


def test_verify_chunk_is_the_decode_steps_at_every_position(micro_golden, plain):
    """graphs/steps.py verify_chunk (what the neuron target's verify bucket computes): 4 tokens
    from the prefill's state give plain decoding's logits at every position and its state after
    the 4 tokens, bit for bit, and main_hidden at each position is the one each decode step
    reads (`main_hidden_from_capture`); a row's count stops its state where plain decoding's is."""
    from dsneuron.graphs.context import Capture
    from dsneuron.graphs.dspark import main_hidden_from_capture
    from dsneuron.graphs.steps import verify_chunk

    g = micro_golden
    tokens, chosen, states = plain
    seq = PROMPT + tokens[:4]
    feed = torch.tensor([tokens[:4], tokens[:4]])
    eng = g.engram_ids(torch.tensor([seq]))[:, len(PROMPT):].expand(2, -1, -1, -1).contiguous()
    state0 = {n: t.expand(2, *t.shape[1:]).clone() for n, t in states[0].items()}
    pos = torch.tensor([len(PROMPT)] * 2)
    with torch.inference_mode():
        logits, hidden, state = verify_chunk(g.model, feed, pos, torch.tensor([4, 2]), eng, state0, routed=True)
        want_hidden = []
        for j in range(4):
            cap = Capture()
            decode(g.model, feed[:1, j:j + 1], pos[:1] + j, eng[:1, j:j + 1], states[j], cap, routed=True)
            want_hidden.append(main_hidden_from_capture(g.model, cap, feed[:1, j:j + 1]))
    assert logits.shape == (2, 4, g.cfg.vocab_size) and hidden.dtype == torch.bfloat16
    assert all(torch.equal(logits[0, j], chosen[j + 1]) for j in range(4))
    assert torch.equal(hidden[0], torch.cat(want_hidden, dim=1)[0])
    for row, n in ((0, 4), (1, 2)):
        bad = [k for k, t in states[n].items() if not torch.equal(state[k][row].nan_to_num(), t[0].nan_to_num())]
        assert not bad, (row, bad)


def test_dspark_ring_is_written_in_position_order_and_read_only_where_written(drafter):
    """seed: a 20-position prompt at once equals one position at a time (window 16: slot p % 16,
    the newest wins). draft at position 5 reads ring slots 0..5 only (get_dspark_topk_idxs): junk
    in the other slots changes nothing; a different slot 3 changes the drafts' logits."""
    d = drafter.dspark
    cfg = d.cfg
    hidden = torch.randn(1, 20, cfg.dim * len(cfg.dspark_target_layer_ids), generator=torch.Generator().manual_seed(3))
    hidden = hidden.to(torch.bfloat16)
    whole = d.seed(d.init_cache(1), hidden, torch.tensor([0]), torch.tensor([20]))
    one = d.init_cache(1)
    for p in range(20):
        one = d.seed(one, hidden[:, p:p + 1], torch.tensor([p]), torch.tensor([1]))
    assert all(torch.equal(a, b) for a, b in zip(whole.rings, one.rings))
    assert torch.equal(whole.rings[0][0, 2], one.rings[0][0, 18 % 16])

    early = d.seed(d.init_cache(1), hidden[:, :6], torch.tensor([0]), torch.tensor([6]))
    junk = early.clone()
    for r in junk.rings:
        r[:, 6:] = 7.0
    token = torch.tensor([1234])
    a, b = d.draft(early, token, torch.tensor([5])), d.draft(junk, token, torch.tensor([5]))
    assert torch.equal(a.logits, b.logits) and torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.tokens, a.logits.argmax(-1))  # greedy drafts: the argmax with the Markov bias
    other = early.clone()
    other.rings[0][:, 3] = junk.rings[0][:, 7]
    assert not torch.equal(d.draft(other, token, torch.tensor([5])).logits, a.logits)


def test_prefill_seed_returns_what_the_rings_keep_of_each_prompt(micro_golden, drafter):
    """graphs/steps.py prefill_seed (a speculative compile's single-graph prefill): the logits and
    state of `prefill` bit for bit, and main_hidden at each row's last window_size positions; the
    drafter seeded with those (Verified.seed_span) holds the rings it holds when seeded with every
    prompt position, for prompts shorter than, as long as and longer than the window (16), in one
    batch."""
    from dsneuron.graphs.context import Capture
    from dsneuron.graphs.dspark import main_hidden_from_capture
    from dsneuron.graphs.steps import prefill_seed

    g, d = micro_golden, drafter.dspark
    W = g.cfg.window_size
    lens = torch.tensor([5, W, 23])
    tokens = torch.randint(3, 128000, (3, 24), generator=torch.Generator().manual_seed(4))
    eng = g.engram_ids(tokens)
    cap = Capture()
    with torch.inference_mode():
        logits, state = prefill(g.model, tokens, lens, eng, cap)
        got_logits, tail, got_state = prefill_seed(g.model, tokens, lens, eng, W)
    assert torch.equal(got_logits, logits) and all(torch.equal(got_state[n].nan_to_num(), t.nan_to_num())
                                                  for n, t in state.items())
    assert tail.shape == (3, W, main_hidden_from_capture(g.model, cap, tokens).size(2))
    v = sp.Verified(logits, tail, None, tokens, torch.zeros(3, dtype=torch.int64), lens,
                    hidden_pos=(lens - W).clamp(min=0))
    start, count = v.seed_span()
    assert start.tolist() == [0, 0, 23 - W] and count.tolist() == [5, W, W]
    seeded = d.seed(d.init_cache(3), tail, start, count)
    every = d.seed(d.init_cache(3), main_hidden_from_capture(g.model, cap, tokens), torch.zeros(3, dtype=torch.int64),
                   lens)
    assert all(torch.equal(a, b) for a, b in zip(seeded.rings, every.rings))


def test_accept_greedy_keeps_the_matching_prefix_and_the_verify_token():
    logits = torch.zeros(4, 10)
    logits[torch.arange(4), torch.tensor([3, 5, 7, 9])] = 1.0
    assert sp.accept_greedy(torch.tensor([3, 5, 7]), logits) == (3, 9)
    assert sp.accept_greedy(torch.tensor([3, 4, 7]), logits) == (1, 5)
    assert sp.accept_greedy(torch.tensor([0, 5, 7]), logits) == (0, 3)


# chi-square critical values at p = 1e-4 by degrees of freedom (scipy.stats.chi2.isf(1e-4, df))
CHI2 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513, 5: 25.745, 6: 27.856, 7: 29.878, 8: 31.828, 9: 33.720, 10: 35.564}
CHI2_5 = CHI2[5]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    want = probs * n
    return float(((counts - want) ** 2 / want).sum())


def test_rejection_sampling_gives_the_target_distribution(one_thread):
    """Speculative rejection sampling on fixed p (target) and q (drafter) over 6 tokens, k = 2,
    5,000 seeded trials: the first emitted token follows p_0 and, when draft 0 was kept, the
    second follows p_1 (chi-square below the p = 1e-4 bound). Keeping every draft instead (no
    rejection) gives q_0 and fails the same bound."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[.05, .30, .25, .10, .20, .10], [.40, .05, .05, .20, .10, .20], [1 / 6] * 6], dtype=torch.float64)
    q = torch.tensor([[.30, .05, .25, .20, .10, .10], [.10, .30, .20, .10, .20, .10]], dtype=torch.float64)
    first, second, naive = torch.zeros(6), torch.zeros(6), torch.zeros(6)
    for _ in range(5000):
        drafts = torch.stack([torch.multinomial(q[j], 1, generator=g)[0] for j in range(2)])
        a, nxt = sp.accept_sampled(drafts, p, q, g)
        emitted = [int(x) for x in drafts[:a]] + [nxt]
        first[emitted[0]] += 1
        naive[int(drafts[0])] += 1
        if a >= 1:
            second[emitted[1]] += 1
    assert _chi2(first, p[0]) < CHI2_5
    assert _chi2(second, p[1]) < CHI2_5
    assert _chi2(naive, p[0]) > 10 * CHI2_5


def test_generate_refuses_bad_k():
    toy = ToyTarget()
    with pytest.raises(ValueError, match=r"k must be in 1..3"):
        sp.generate(toy, OracleDrafter([], [None], ToyTarget.V), [[1]], N, 4)
    with pytest.raises(ValueError, match="max_new must be >= 1"):
        sp.generate(toy, OracleDrafter([], [None], ToyTarget.V), [[1]], 0, 2)


# ----------------------------------------------------------------------------------------- the loop on a toy target
class ToyTarget:
    """TEST-ONLY main model for the loop's bookkeeping (cheap): vocabulary V, the logits at a
    position a fixed pseudo-random function of every token up to it; the state is each row's token
    history [B, M] (-1: empty), written at the fed positions as a chunk writes the decode state, so
    a wrong replay or a finished row moved shows in it."""

    V, M = 11, 48

    def __init__(self):
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def logits_at(self, history: list[int]) -> torch.Tensor:
        key = tuple(history)
        if key not in self._memo:
            g = torch.Generator().manual_seed(hash(key) % 2**31)
            self._memo[key] = 3 * torch.randn(self.V, generator=g)
        return self._memo[key]

    def _run(self, tokens, pos, count, state):
        B, S = tokens.shape
        new = state.clone()
        logits = torch.zeros(B, S, self.V)
        for b in range(B):
            for j in range(int(count[b])):
                new[b, int(pos[b]) + j] = tokens[b, j]
                logits[b, j] = self.logits_at(new[b, :int(pos[b]) + j + 1].tolist())
        return logits, new

    def prefill(self, prompts):
        B, S = len(prompts), max(len(p) for p in prompts)
        tokens = torch.zeros(B, S, dtype=torch.int64)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = torch.tensor(p)
        count = torch.tensor([len(p) for p in prompts])
        logits, state = self._run(tokens, torch.zeros(B, dtype=torch.int64), count,
                                  torch.full((B, self.M), -1, dtype=torch.int64))
        return sp.Verified(logits, torch.zeros(B, S, 1), state, tokens, torch.zeros(B, dtype=torch.int64), count)

    def verify(self, tokens, pos, count, state):
        logits, new = self._run(tokens, pos, count, state)
        return sp.Verified(logits, torch.zeros(*tokens.shape, 1), new, tokens, pos, count, state)

    def commit(self, v, keep):
        return self._run(v.tokens, v.pos, keep, v.state_in)[1]

    def plain(self, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
        seq, out, chosen = list(prompt), [], []
        for _ in range(n):
            lg = self.logits_at(seq)
            out.append(int(lg.argmax()))
            chosen.append(lg)
            seq.append(out[-1])
        return out, chosen


def test_the_loop_feeds_no_position_past_the_plain_runs_limit():
    """A prompt and max_new that fill the toy's M positions exactly (prompt + max_new - 1 = M, the
    plain run's limit): with the oracle always right the last verify drafts only what the budget
    leaves, so no verify feeds a position past M (the toy's state would raise IndexError) and the
    tokens are plain decoding's."""
    toy = ToyTarget()
    prompt = [1 + i % 7 for i in range(40)]
    n = ToyTarget.M - len(prompt) + 1
    plain, _ = toy.plain(prompt, n)
    res = sp.generate(toy, OracleDrafter(prompt + plain, [None], ToyTarget.V), [prompt], n, K)
    assert res.tokens[0] == plain


def test_loop_on_a_toy_target_forced_rejection_at_every_position():
    """The loop's bookkeeping, cheap: rows of one batch with different prompts, the oracle wrong at
    draft 0, 1, 2 or never; every row gets plain greedy decoding's tokens and logits, its state is
    its history exactly (finished rows untouched while the others go on), and row j keeps j drafts
    a step."""
    toy = ToyTarget()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 0]]
    n = 9
    plains = [toy.plain(p, n) for p in prompts]
    wrong = [0, 1, 2, None]

    class Rows(OracleDrafter):  # each row its own continuation
        def propose(self, cache, token, pos, k, temperature, generator):
            out = torch.zeros(len(prompts), k, dtype=torch.int64)
            for b, w in enumerate(wrong):
                seq = prompts[b] + plains[b][0]
                for j in range(k):
                    t = seq[min(int(pos[b]) + 2 + j, len(seq) - 1)]
                    out[b, j] = (t + 1) % ToyTarget.V if j == w else t
            return out, None

    res = sp.generate(toy, Rows([], wrong, ToyTarget.V), prompts, n, K)
    for b, p in enumerate(prompts):
        assert res.tokens[b] == plains[b][0], b
        assert all(torch.equal(x, y) for x, y in zip(res.logits[b], plains[b][1])), b
        seq = p + plains[b][0][:-1]  # every token but the last is fed
        assert res.state[b, :len(seq)].tolist() == seq and (res.state[b, len(seq):] == -1).all(), b
    per_row = {b: [] for b in range(4)}
    active = list(range(4))
    it = iter(res.stats.accepted)
    left = [n - 1] * 4
    while active:  # the steps in call order, each active row's count
        for b in list(active):
            per_row[b].append(next(it))
            left[b] -= per_row[b][-1]
            if left[b] == 0:
                active.remove(b)
    for b, w in enumerate(wrong):
        kept = [a - 1 for a in per_row[b]]
        assert all(x <= (K if w is None else w) for x in kept) and kept[0] == (K if w is None else w), (b, kept)


@pytest.fixture
def one_thread():
    """Tiny tensor ops on one thread: ATen's thread pool costs ~ms a call on a busy 2-core host."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_loop_sampling_on_a_toy_target_keeps_the_target_distribution(one_thread):
    """Sampled speculation through the whole loop (temperature 1, a drafter drawing from its own
    fixed q): over 3,000 seeded generations of 4 tokens (the first verify offers 2 drafts), the
    second token's distribution is the target's marginal sum_t p(t) p(x | t), computed exactly
    (chi-square at p = 1e-4)."""
    toy = ToyTarget()
    prompt = [3, 1]
    V = ToyTarget.V
    qg = torch.Generator().manual_seed(7)
    q = torch.softmax(2 * torch.randn(K, V, generator=qg, dtype=torch.float64), dim=-1)

    class Sampler(OracleDrafter):
        def propose(self, cache, token, pos, k, temperature, generator):
            d = torch.stack([torch.multinomial(q[j], 1, generator=generator) for j in range(k)], dim=1)
            return d, q[:k].unsqueeze(0)

    p1 = torch.softmax(toy.logits_at(prompt).double(), -1)
    p2 = sum(p1[t] * torch.softmax(toy.logits_at(prompt + [t]).double(), -1) for t in range(V))
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(3000):
        res = sp.generate(toy, Sampler([], [None], V), [prompt], 4, 2, temperature=1.0, generator=g)
        counts[res.tokens[0][1]] += 1
    # the least likely tokens pooled into one bin so every expected count is >= 5
    order = torch.argsort(p2)
    pooled = int((torch.cumsum(p2[order], 0) * 3000 < 5).sum()) + 1
    bins_c = torch.cat([counts[order[:pooled]].sum().view(1), counts[order[pooled:]]])
    bins_p = torch.cat([p2[order[:pooled]].sum().view(1), p2[order[pooled:]]])
    assert _chi2(bins_c, bins_p) < CHI2[len(bins_c) - 1]


class _HeadStage:
    """A staged executable's head stage alone, row-local as the real one: logits[b] = h[b, last[b],
    0, :] + pre_mix[b, last[b], 0], at the one batch its bucket was compiled for; counts its calls."""

    def __init__(self, batch: int):
        self.batch, self.calls = batch, 0

    def run_stage(self, name: str, v: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        assert name == "head" and v["h"].size(0) == self.batch == v["last"].numel()
        self.calls += 1
        rows = torch.arange(self.batch)
        return [v["h"][rows, v["last"], 0].float() + v["pre_mix"][rows, v["last"], :1]]


@pytest.mark.parametrize("decode_batches", [(1, 4), (1,)])
def test_position_logits_through_the_widest_decode_head_equal_the_calls_own_head(decode_batches):
    """Runner._position_logits: the B * S positions of a verify go through the head of the widest
    decode bucket, G rows a call, the last group padded: every (row, position) gets the logits the
    chunk's own head gives it there, in order; without a decode batch of 2 or more, one call of the
    chunk's head per position."""
    from types import SimpleNamespace

    from dsneuron.runtime_min.core.runner import Runner

    B, S, Sp = 2, 5, 16  # 10 positions: groups of 4, 4 and 2 (padded)
    gen = torch.Generator().manual_seed(0)
    head = {"h": torch.randn(B, Sp, 2, 8, generator=gen).bfloat16(), "pre_mix": torch.randn(B, Sp, 2, generator=gen)}
    own = _HeadStage(B)
    want = torch.stack([own.run_stage("head", {**head, "last": torch.full((B,), j)})[0] for j in range(S)], dim=1)
    runner = object.__new__(Runner)
    runner.decode_batches = list(decode_batches)
    runner._buckets = {("decode", g, 64): SimpleNamespace(stages=("head",)) for g in decode_batches}
    wide = {g: _HeadStage(g) for g in decode_batches}
    runner.executable = lambda kind, g, length: wide[g]
    own.calls = 0
    got = runner._position_logits(own, head, S)
    assert torch.equal(got, want)
    G = max(decode_batches)
    assert (wide[G].calls, own.calls) == ((-(-B * S // G), 0) if G > 1 else (0, S))


class _Loader:
    """A stage package standing in for AOTInductor's: adds its weight to its one input."""

    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def boxed_run(self, args):
        self.log.append(self.name)
        return [args[1] + args[0]]


def test_a_staged_call_skips_the_named_stages_and_refuses_to_skip_what_a_later_stage_reads():
    """StagedExecutable.run_tapped(skip=...): a verify skips the bucket's own head (its taps give
    every position's); the skipped stage does not run, its output comes back None, the others are
    what the full run gives; skipping a stage whose output a later stage reads is a ValueError,
    an unknown stage a KeyError."""
    from types import SimpleNamespace

    from dsneuron.runtime_min.bundle.schema import Stage
    from dsneuron.runtime_min.executors.executor_cpu import StagedExecutable

    stages = (Stage("layers.0", "s/a", ("w0",), ("h",), ("h",)), Stage("head", "s/b", ("w1",), ("h",), ("logits",)))
    spec = lambda name: SimpleNamespace(name=name)  # noqa: E731
    bucket = SimpleNamespace(stages=stages, inputs=(spec("h"),), outputs=(spec("logits"), spec("h")), file="b",
                             check_inputs=lambda inputs: None)
    log: list[str] = []
    exe = object.__new__(StagedExecutable)
    exe.bucket, exe.stage_seconds, exe._written, exe._columns, exe._last = bucket, None, [], False, False
    exe._stages = [(_Loader(log, st.name), [torch.tensor(10.0 ** i)], st.inputs, st.outputs, False)
                   for i, st in enumerate(stages)]
    h = torch.tensor(1.0)
    full, _ = exe.run_tapped([h], ())
    assert [float(t) for t in full] == [12.0, 2.0] and log == ["layers.0", "head"]
    log.clear()
    outs, taps = exe.run_tapped([h], ("head",), skip=("head",))
    assert outs[0] is None and torch.equal(outs[1], full[1]) and log == ["layers.0"]
    assert torch.equal(taps["head"]["h"], full[1])
    with pytest.raises(ValueError, match="stage head takes an output of a skipped stage"):
        exe.run_tapped([h], (), skip=("layers.0",))
    with pytest.raises(KeyError, match="no stage 'nope'"):
        exe.run_tapped([h], (), skip=("nope",))


@pytest.mark.parametrize("tokens, pos, count, layers, msg", [
    (torch.zeros(6, dtype=torch.int64), [0], [1], [1], r"tokens must be \[B, S\]"),
    (torch.zeros(1, 0, dtype=torch.int64), [0], [1], [1], r"tokens must be \[B, S\] with B, S >= 1"),
    (torch.zeros(1, 2, dtype=torch.int64), [0, 0], [1], [1], r"pos and count must be \[B\] = \[1\]"),
    (torch.zeros(1, 2, dtype=torch.int64), [-1], [1], [1], r"pos must be >= 0"),
    (torch.zeros(1, 2, dtype=torch.int64), [3], [0], [1], r"count must lie in 1..S = 1..2, got \[0\]"),
    (torch.zeros(1, 2, dtype=torch.int64), [3], [5], [1], r"count must lie in 1..S = 1..2, got \[5\]"),
    (torch.zeros(1, 2, dtype=torch.int64), [3], [2], [], r"target_layers must name at least one layer"),
])
def test_verify_refuses_arguments_outside_its_contract(tokens, pos, count, layers, msg):
    """Runner.verify checks its arguments before any executable runs (a count of 0 used to reach
    the compiled chunk and fail there with an index error)."""
    from dsneuron.runtime_min.core.runner import Runner

    runner = object.__new__(Runner)
    with pytest.raises(ValueError, match=msg):
        runner.verify(tokens, torch.tensor(pos), torch.tensor(count), None, layers)


# ----------------------------------------------------------------------------------------- the cpu target (slow)
@pytest.fixture(scope="module")
def spec_runner(tmp_path_factory, micro_checkpoint):
    """micro compiled for the cpu target at batch 1, one prefill bucket of 16 tokens and a context
    capacity of 1024 (prefill, decode and chunk buckets; ~6-10 minutes on 2 cores), plus a decode
    bucket of batch 4, whose head stage the verify reads its positions through; with the DSpark
    drafter stored (`--speculative dspark`)."""
    import dataclasses

    from dsneuron.compiler.compile import build_steps_for_config, compile_bundle
    from dsneuron.compiler.config import load_config
    from dsneuron.runtime_min.core.runner import Runner

    model_cfg, compile_cfg, _ = load_config("micro")
    compile_cfg = dataclasses.replace(compile_cfg, max_seq_len=1024, batch_sizes=(1,), prefill_seq_lens=(16,),
                                      decode_context_lens=(1024,), decode_batch_sizes=(4,), checkpoint=str(micro_checkpoint),
                                      speculative="dspark")
    root = tmp_path_factory.mktemp("micro_spec")
    parts = build_steps_for_config(model_cfg, compile_cfg, root / "cache")
    return Runner.load(compile_bundle(model_cfg, compile_cfg, root / "bundle", parts, cache_dir=root / "cache"))


def _runner_plain(runner, prompt: list[int], n: int, keep_logits: bool = True):
    """Plain greedy decoding on the runner: (tokens, logits or [], the state after the last token fed)."""
    step = runner.prefill([prompt])
    tokens, logits = [int(step.logits[0].argmax())], [step.logits[0]] if keep_logits else []
    for i in range(n - 1):
        step = runner.decode(torch.tensor([tokens[-1]]), torch.tensor([len(prompt) + i]), step.state)
        tokens.append(int(step.logits[0].argmax()))
        if keep_logits:
            logits.append(step.logits[0])
    return tokens, logits, step.state


def _same_runner_state(a, b) -> list[str]:
    bad = [n for n in b.tensors if not torch.equal(a.tensors[n].nan_to_num(), b.tensors[n].nan_to_num())]
    return bad + (["history"] if b.history is not None and not torch.equal(a.history, b.history) else [])


@pytest.mark.slow
def test_cpu_target_speculation_equals_plain_decoding(spec_runner, micro_golden, micro_checkpoint):
    """On the compiled cpu target: the verify is the chunk bucket read at every position; with the
    oracle wrong at each draft position (and never), with the real DSpark drafter of the checkpoint
    and with the one the bundle stores (`--speculative dspark`), 20 greedy tokens, their logits, the
    state and the engram history equal plain decoding's bit for bit; both DSparks draft the same."""
    from dsneuron.graphs.checkpoint import load_checkpoint
    from dsneuron.graphs.dspark import DSpark, DSparkDrafter, bundle_drafter
    from dsneuron.graphs.engram import engram_layout

    prompt, n = PROMPT + [7, 8, 9], 20
    tokens, logits, state = _runner_plain(spec_runner, prompt, n)
    target = sp.RunnerTarget(spec_runner)
    cfg = micro_golden.cfg
    ckpt = load_checkpoint(micro_checkpoint, cfg, engram_layout(cfg).num_embeddings)
    dspark = DSparkDrafter(DSpark.from_checkpoint(micro_golden.model, {k: t for k, t in ckpt.items() if k.startswith("mtp.")},
                                                  1024))
    assert spec_runner.bundle.speculative == "dspark"
    stored = spec_runner.bundle.stored_tensors(lambda name: name.startswith("mtp."))
    assert sorted(stored) == sorted(k for k in ckpt if k.startswith("mtp."))
    bundled = bundle_drafter(spec_runner.bundle, cfg, 1024)
    drafters = [OracleDrafter(prompt + tokens, [w], cfg.vocab_size) for w in (0, 1, 2, None)] + [dspark, bundled]
    for i, drafter in enumerate(drafters):
        res = sp.generate(target, drafter, [prompt], n, K)
        assert res.tokens[0] == tokens, i
        assert all(torch.equal(a, b) for a, b in zip(res.logits[0], logits)), i
        assert not _same_runner_state(res.state, state), (i, _same_runner_state(res.state, state))
        if i == 3:
            assert res.stats.mean_acceptance > 3  # the oracle never wrong: 1 + 3 tokens a step
        if i == 4:
            from_checkpoint = res.stats
    assert res.stats.accepted == from_checkpoint.accepted and res.stats.proposed == from_checkpoint.proposed


@pytest.mark.slow
def test_cpu_target_draft_bucket(spec_runner):
    """The cpu target's draft bucket (one AOTInductor graph beside the staged buckets; its head
    through the cpu kernel on the main head's prepared layout): speculating with it gives plain
    decoding's tokens, logits and state bit for bit, and seeded with a prompt's tapped prefill its
    greedy drafts are the eager drafter's (GEMM order fused) from the bundle's tensors."""
    from dsneuron.graphs.config import ModelConfig
    from dsneuron.graphs.dspark import bundle_drafter
    from dsneuron.runtime_min.core.drafter import CompiledDrafter

    assert [(b.batch, b.seq_len, b.stages) for b in spec_runner.manifest.buckets if b.kind == "draft"] == [(1, K, ())]
    prompt, n = PROMPT + [7, 8, 9], 12
    tokens, logits, state = _runner_plain(spec_runner, prompt, n)
    target = sp.RunnerTarget(spec_runner)
    compiled = CompiledDrafter(spec_runner)
    res = sp.generate(target, compiled, [prompt], n, K)
    assert res.tokens[0] == tokens and all(torch.equal(a, b) for a, b in zip(res.logits[0], logits))
    assert not _same_runner_state(res.state, state)
    cfg = ModelConfig.from_dict(spec_runner.manifest.model_config)
    eager = bundle_drafter(spec_runner.bundle, cfg, 1024, order="fused")
    v = target.prefill([prompt])
    token, pos = v.last_logits().argmax(-1), v.count - 1
    drafts = [d.propose(d.seed(d.start(1), v.main_hidden, torch.zeros(1, dtype=torch.int64), v.count), token, pos, K,
                        0.0, None)[0] for d in (eager, compiled)]
    assert torch.equal(drafts[0], drafts[1]), drafts


@pytest.mark.slow
def test_run_speculative_tokens_with_the_bundles_drafter_prints_the_plain_text(spec_runner, monkeypatch, capsys):
    """`dsneuron run B --speculative-tokens 3` on a bundle compiled with `--speculative dspark`
    (no --draft-checkpoint): the plain run's text, and --stats reports the verify steps."""
    from stand_in import run_cli

    args = ("run", str(spec_runner.bundle.root), "--prompt", "Hello there, how are you", "--max-new-tokens", "12")
    assert run_cli(monkeypatch, *args) == 0
    plain = capsys.readouterr().out
    assert run_cli(monkeypatch, *args, "--speculative-tokens", "3", "--stats") == 0
    got = capsys.readouterr()
    assert got.out == plain and "verify steps, mean acceptance length" in got.err


@pytest.mark.slow
def test_cpu_target_speculation_after_a_prompt_past_the_largest_prefill(spec_runner):
    """A 40-token prompt on a bundle whose largest prefill is 16: the speculative prefill runs it as
    chunks (as plain decoding does; `run --speculative-tokens` used to refuse it as too long) and
    gives no main_hidden (the drafter starts without its ring); greedy speculation with the
    TEST-ONLY oracle, right and wrong at draft 1, gives plain decoding's tokens and logits."""
    prompt, n = list(range(100, 140)), 8
    done = spec_runner.prefill_job(prompt).run()
    tokens, logits, state = [int(done.logits[0].argmax())], [done.logits[0]], done.state
    for i in range(n - 1):
        step = spec_runner.decode(torch.tensor([tokens[-1]]), torch.tensor([len(prompt) + i]), state)
        state = step.state
        tokens.append(int(step.logits[0].argmax()))
        logits.append(step.logits[0])
    target = sp.RunnerTarget(spec_runner)
    v = target.prefill([prompt])
    assert v.main_hidden is None and torch.equal(v.last_logits()[0], logits[0])
    for wrong_at in (None, 1):
        res = sp.generate(target, OracleDrafter(prompt + tokens, [wrong_at], spec_runner.vocab_size), [prompt], n, K)
        assert res.tokens[0] == tokens and all(torch.equal(a, b) for a, b in zip(res.logits[0], logits)), wrong_at


@pytest.mark.slow
def test_cpu_target_forced_rejection_for_1000_steps_leaves_plain_decodings_state(spec_runner):
    """1,000 greedy tokens with the oracle wrong at draft j in every step (j = 0, 1, 2): every step
    replays the kept tokens; the tokens, the state and the engram history after them are plain
    decoding's, bit for bit."""
    prompt, n = PROMPT + [7, 8, 9], 1000
    tokens, _, state = _runner_plain(spec_runner, prompt, n, keep_logits=False)
    target = sp.RunnerTarget(spec_runner)
    for w in (0, 1, 2):
        res = sp.generate(target, OracleDrafter(prompt + tokens, [w], spec_runner.vocab_size), [prompt], n, K,
                          keep_logits=False)
        assert res.tokens[0] == tokens, w
        assert not _same_runner_state(res.state, state), (w, _same_runner_state(res.state, state))
        assert res.stats.replays >= len(res.stats.accepted) - 2  # every step rejects but near the budget


def test_run_refuses_bad_speculation_flags_before_loading(monkeypatch, capsys, tmp_path):
    """`run --speculative-tokens`: negative, or with --prompts-file, and --draft-checkpoint without
    it, exit 2 naming the problem (before any bundle is read)."""
    from stand_in import run_cli

    assert run_cli(monkeypatch, "run", str(tmp_path), "--prompt", "hi", "--speculative-tokens", "-1") == 2
    assert "--speculative-tokens must be >= 0" in capsys.readouterr().err
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\n")
    assert run_cli(monkeypatch, "run", str(tmp_path), "--prompts-file", str(prompts), "--speculative-tokens", "2") == 2
    assert "one --prompt" in capsys.readouterr().err
    assert run_cli(monkeypatch, "run", str(tmp_path), "--prompt", "hi", "--draft-checkpoint", str(tmp_path)) == 2
    assert "--draft-checkpoint is used only with --speculative-tokens" in capsys.readouterr().err


def test_run_speculation_on_a_bundle_without_a_drafter_names_the_compile_flag(monkeypatch, capsys, micro_bundle):
    """A bundle compiled without `--speculative dspark` and no --draft-checkpoint: exit 2 naming
    both ways to give the drafter's weights."""
    from stand_in import run_cli

    assert run_cli(monkeypatch, "run", str(micro_bundle.path), "--prompt", "hi", "--speculative-tokens", "2") == 2
    err = capsys.readouterr().err
    assert "carries no drafter" in err and "--speculative dspark" in err and "--draft-checkpoint" in err


# ----------------------------------------------------------------------------------------- compile --speculative
def test_compile_config_speculative_values():
    """compile.speculative: none (left out of the manifest's compile_config) or dspark; anything
    else a ConfigError naming the key and the choices."""
    from dsneuron.compiler.config import CompileConfig
    from dsneuron.graphs.config import ConfigError

    base = {"max_seq_len": 64, "batch_sizes": [1], "prefill_seq_lens": [16], "decode_context_lens": [64]}
    assert "speculative" not in CompileConfig.from_dict(base).to_dict()
    assert CompileConfig.from_dict({**base, "speculative": "dspark"}).to_dict()["speculative"] == "dspark"
    with pytest.raises(ConfigError, match=r"compile.speculative: must be one of none, dspark \(got 'mtp'\)"):
        CompileConfig.from_dict({**base, "speculative": "mtp"})


def test_verify_buckets_of_a_staged_plan_are_its_chunk_buckets_at_the_first_batch(micro_cfg):
    """BucketPlan.with_verify: on a plan whose prefill takes a token range (a staged target) the
    verify buckets have the chunk buckets' shapes and token range, at batch_sizes[0] only; on
    another plan, 1 + block tokens per decode capacity."""
    import dataclasses

    from dsneuron.compiler.buckets import plan_buckets
    from dsneuron.compiler.config import load_config

    cc = dataclasses.replace(load_config("micro")[1], batch_sizes=(1, 2), prefill_seq_lens=(16,),
                             decode_context_lens=(16, 64))
    staged = plan_buckets(cc, micro_cfg).with_dynamic_prefill(4).with_chunks().with_verify(4)
    assert staged.verify == tuple(dataclasses.replace(pb, kind="verify") for pb in staged.chunk if pb.batch == 1)
    assert [(pb.seq_len, pb.capacity, pb.min_seq_len) for pb in staged.verify] == [(16, 16, 4), (16, 64, 4)]
    plain = plan_buckets(cc, micro_cfg).with_chunks().with_verify(4)
    assert [(pb.batch, pb.seq_len, pb.capacity, pb.min_seq_len) for pb in plain.verify] == [(1, 4, 16, 0), (1, 4, 64, 0)]


def test_speculative_plan_refusals(micro_cfg):
    """`--speculative dspark` needs the model's DSpark stages, one process, and on the cpu target the
    chunk bucket (its verify taps it; the neuron target compiles verify buckets of its own): each
    refusal a ConfigError naming what is missing."""
    import dataclasses

    from dsneuron.compiler.config import check_speculative_plan, load_config
    from dsneuron.graphs.config import ConfigError

    cc = dataclasses.replace(load_config("micro")[1], speculative="dspark")
    check_speculative_plan(cc, micro_cfg, "cpu")  # fine
    check_speculative_plan(cc, micro_cfg, "neuron-stablehlo")
    check_speculative_plan(dataclasses.replace(cc, chunked_prefill=False), micro_cfg, "neuron")
    check_speculative_plan(dataclasses.replace(cc, speculative="none"), micro_cfg, "neuron", tp=2)  # nothing asked
    no_mtp = dataclasses.replace(micro_cfg, n_mtp_layers=0)
    for args, msg in [((cc, no_mtp, "cpu"), "the model has no DSpark stages"),
                      ((cc, no_mtp, "neuron"), "the model has no DSpark stages"),
                      ((dataclasses.replace(cc, chunked_prefill=False), micro_cfg, "cpu"), "needs compile.chunked_prefill"),
                      ((cc, micro_cfg, "cpu", 2), "with --tp 2"),
                      ((cc, micro_cfg, "neuron", 2), "with --tp 2")]:
        with pytest.raises(ConfigError, match=msg):
            check_speculative_plan(*args)


def test_compile_refuses_bad_speculative_flags_before_reading(monkeypatch, capsys, tmp_path):
    """`compile --speculative`: an unknown method, or dspark on a model without DSpark stages or
    with --tp, exit 2 before any checkpoint is made; nothing is written."""
    from stand_in import run_cli

    out = tmp_path / "b"
    assert run_cli(monkeypatch, "compile", "--config", "micro", "--speculative", "eagle", "--out", str(out)) == 2
    assert "--speculative: must be one of none, dspark" in capsys.readouterr().err
    assert run_cli(monkeypatch, "compile", "--config", "micro", "--speculative", "dspark", "--tp", "2",
                   "--out", str(out)) == 2
    assert "with --tp 2: the verify runs in one process" in capsys.readouterr().err
    assert not out.exists()


def test_model_parts_store_the_drafter_without_touching_the_executables_keys(micro_checkpoint):
    """build_model_parts with speculative dspark: every mtp.* tensor of the checkpoint is a host
    weight, stored from its checkpoint bytes (a file region source), but wo_a's weight, which the
    draft bucket's drafter holds dequantised to bf16 (and so it is stored; its scale stays), and
    a head widened to fp32 is stored narrowed back to its checkpoint dtype; the parts hold the
    drafter the draft bucket traces, over exactly those tensors; the weights digest the main
    executables' cache keys use is the plain compile's (so a speculative compile reuses them)."""
    import dataclasses

    from dsneuron.compiler.compile import _weights_digest
    from dsneuron.compiler.config import load_config
    from dsneuron.compiler.model_steps import build_model_parts
    from dsneuron.graphs.checkpoint import map_checkpoint
    from dsneuron.graphs.engram import engram_layout

    model_cfg, cc, _ = load_config("micro")
    cc = dataclasses.replace(cc, checkpoint=str(micro_checkpoint))
    plain = build_model_parts(model_cfg, cc)
    spec = build_model_parts(model_cfg, dataclasses.replace(cc, speculative="dspark"))
    mtp = sorted(n for n in map_checkpoint(micro_checkpoint, model_cfg,
                                                   engram_layout(model_cfg).num_embeddings).tensors if n.startswith("mtp."))
    assert mtp and sorted(spec.host_weights) == mtp and not plain.host_weights
    wo_a = [n for n in mtp if n.endswith("attn.wo_a.weight")]
    assert wo_a and all(spec.weights[n].dtype == torch.bfloat16 and n not in spec.sources for n in wo_a)
    assert all(n in spec.sources and n in spec.weights for n in mtp if n not in wo_a)
    assert spec.stored_dtypes["mtp.0.markov_head.head.weight"] == torch.bfloat16
    assert spec.weights["mtp.0.markov_head.head.weight"].dtype == torch.float32
    held = {p.untyped_storage().data_ptr() for p in spec.steps.drafter.parameters()}
    assert all(spec.weights[n].untyped_storage().data_ptr() in held for n in mtp if not n.endswith("wo_a.scale"))
    assert set(spec.weights) - set(plain.weights) == set(mtp)
    host = set(spec.host_weights)
    assert _weights_digest({n: t for n, t in spec.weights.items() if n not in host}) == _weights_digest(plain.weights)


def test_drafter_from_tensors_is_the_checkpoints_drafter(micro_golden, micro_checkpoint, drafter):
    """The drafter built from the mtp.* tensors plus the embedding and head (what a bundle stores)
    drafts exactly what the checkpoint's does; a missing main tensor is a ValueError naming it."""
    from golden_target import GoldenTarget
    from dsneuron.graphs.checkpoint import load_checkpoint
    from dsneuron.graphs.dspark import DRAFTER_MAIN_WEIGHTS, drafter_from_tensors
    from dsneuron.graphs.engram import engram_layout

    cfg = micro_golden.cfg
    ckpt = load_checkpoint(micro_checkpoint, cfg, engram_layout(cfg).num_embeddings)
    tensors = {n: t for n, t in ckpt.items() if n.startswith("mtp.") or n in DRAFTER_MAIN_WEIGHTS}
    mine = drafter_from_tensors(tensors, cfg, micro_golden.max_seq_len)
    v = GoldenTarget(micro_golden).prefill([PROMPT])
    start, count = torch.tensor([0]), v.count
    a = drafter.seed(drafter.start(1), v.main_hidden, start, count)
    b = mine.seed(mine.start(1), v.main_hidden, start, count)
    x, pos = v.logits[:, -1].argmax(-1), count - 1
    da, _ = drafter.propose(a, x, pos, K, 0.0, None)
    db, _ = mine.propose(b, x, pos, K, 0.0, None)
    assert torch.equal(da, db)
    (da, qa), (db, qb) = (d.propose(c, x, pos, K, 1.0, torch.Generator().manual_seed(3)) for d, c in ((drafter, a), (mine, b)))
    assert torch.equal(da, db) and torch.equal(qa, qb)  # the proposal distributions, bit for bit
    with pytest.raises(ValueError, match="no tensor 'head.weight'"):
        drafter_from_tensors({n: t for n, t in tensors.items() if n != "head.weight"}, cfg, 64)
    # what run and serve draft with: GEMM order fused, its proposal within fp32 summation order of the golden's
    fused = drafter_from_tensors(tensors, cfg, micro_golden.max_seq_len, order="fused")
    c = fused.seed(fused.start(1), v.main_hidden, start, count)
    _, qf = fused.propose(c, x, pos, K, 1.0, torch.Generator().manual_seed(3))
    assert (qf[:, 0] - qa[:, 0]).abs().max() < 1e-3 and not torch.equal(qf[:, 0], qa[:, 0])  # later rows follow the draws
    with pytest.raises(ValueError, match="order must be 'ascending' or 'fused'"):
        drafter_from_tensors(tensors, cfg, 64, order="kernel")
    from types import SimpleNamespace

    from dsneuron.graphs.dspark import bundle_drafter

    assert bundle_drafter(SimpleNamespace(speculative="none"), cfg, 64) is None


@pytest.mark.parametrize("numerics, tol", [("exact", 1e-6), ("fast", 1e-3)])
def test_drafter_with_the_kernel_head_proposes_as_the_fp32_one(micro_golden, micro_checkpoint, numerics, tol):
    """What run and serve draft with on a cpu bundle (graphs/dspark.py bundle_drafter with the
    runner's weights): the main head and the Markov head read through the cpu kernels in the
    bundle's numerics from their bf16 panels, no fp32 copy of the head held, the attention on the
    cpu target's C++ kernel; the proposal q is the
    fp32 drafter's within the kernels' rounding (fast: activations rounded to bf16), the greedy
    drafts the same tokens."""
    from golden_target import GoldenTarget
    from dsneuron.graphs.checkpoint import load_checkpoint
    from dsneuron.graphs.dspark import DRAFTER_MAIN_WEIGHTS, drafter_from_tensors
    from dsneuron.graphs.engram import engram_layout
    from dsneuron.kernels_nki.cpu_gemm import prepare_weight

    cfg = micro_golden.cfg
    ckpt = load_checkpoint(micro_checkpoint, cfg, engram_layout(cfg).num_embeddings)
    tensors = {n: t for n, t in ckpt.items() if n.startswith("mtp.") or n in DRAFTER_MAIN_WEIGHTS}
    assert tensors["head.weight"].dtype == torch.bfloat16
    head = {f"kernel_{k}": t for k, t in zip(("w", "w_scale"), prepare_weight("bf16", tensors["head.weight"]).values())}
    fused = drafter_from_tensors(tensors, cfg, micro_golden.max_seq_len, order="fused")
    kernel = drafter_from_tensors(tensors, cfg, micro_golden.max_seq_len, order="fused", head_kernel=head,
                                  head_numerics=numerics)
    d = kernel.dspark
    assert d._main[0].head.weight is None and d.markov_kernel_w is not None and d.head_numerics == numerics
    assert d.cpu_attention and not fused.dspark.cpu_attention  # the C++ attention kernel, not the golden's op
    v = GoldenTarget(micro_golden).prefill([PROMPT])
    start, count = torch.tensor([0]), v.count
    x, pos = v.logits[:, -1].argmax(-1), count - 1
    a = fused.seed(fused.start(1), v.main_hidden, start, count)
    b = kernel.seed(kernel.start(1), v.main_hidden, start, count)
    assert torch.equal(fused.propose(a, x, pos, K, 0.0, None)[0], kernel.propose(b, x, pos, K, 0.0, None)[0])
    _, qa = fused.propose(a, x, pos, K, 1.0, torch.Generator().manual_seed(3))
    _, qb = kernel.propose(b, x, pos, K, 1.0, torch.Generator().manual_seed(3))
    assert (qa[:, 0] - qb[:, 0]).abs().max() < tol


@pytest.mark.slow
def test_rejection_sampling_on_micro_keeps_the_models_distribution(micro_golden, drafter, one_thread):
    """On micro's own distributions: p from a golden verify of [x, d_1, d_2] (temperature 0.3), q
    from the DSpark drafter that drew d_1, d_2 at that temperature; 3,000 seeded trials of the
    rejection sampler: the first emitted token follows p_0 (its 8 likeliest tokens and the rest as
    bins; chi-square at p = 1e-4). Bounded: one prefill, one draft, one verify."""
    from golden_target import GoldenTarget
    from dsneuron.runtime_min.core.sampling import probabilities

    T = 0.3
    target = GoldenTarget(micro_golden)
    v = target.prefill([PROMPT])
    p0 = len(PROMPT)
    g = torch.Generator().manual_seed(1)
    x = torch.multinomial(probabilities(v.logits[:, -1], T), 1, generator=g)[:, 0]
    cache = drafter.seed(drafter.start(1), v.main_hidden, torch.tensor([0]), v.count)
    drafts, q = drafter.propose(cache, x, torch.tensor([p0 - 1]), 2, T, g)
    ver = target.verify(torch.cat([x.view(1, 1), drafts], 1), torch.tensor([p0]), torch.tensor([3]), v.state)
    p = probabilities(ver.logits[0], T)
    counts = torch.zeros(p.size(1), dtype=torch.float64)
    naive = torch.zeros_like(counts)  # the drafts themselves: q_0, not p_0
    for _ in range(3000):
        d = torch.stack([torch.multinomial(q[0, j], 1, generator=g)[0] for j in range(2)])
        a, nxt = sp.accept_sampled(d, p, q[0], g)
        counts[int(d[0]) if a >= 1 else nxt] += 1
        naive[int(d[0])] += 1
    top = torch.argsort(p[0], descending=True)[:8]
    keep = p[0][top] * 3000 >= 5  # bins with an expected count below 5 go to the rest

    def binned(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = top[keep]
        rest = torch.ones_like(p[0], dtype=torch.bool)
        rest[t] = False
        return torch.cat([c[t], c[rest].sum().view(1)]), torch.cat([p[0][t], p[0][rest].sum().view(1)])

    bins_c, bins_p = binned(counts)
    assert len(bins_c) >= 3 and bins_p[-1] * 3000 >= 5
    assert _chi2(bins_c, bins_p) < CHI2[len(bins_c) - 1]
    assert _chi2(*binned(naive)) > CHI2[len(bins_c) - 1]


# ----------------------------------------------------------------------------------------- the scheduler (slow)
class LookupOracle:
    """TEST-ONLY drafter for the scheduler, whose rows run one at a time: proposes the continuation
    of whichever of `seqs` (prompt + plain greedy tokens, one per request) holds `token` at the fed
    position, with draft `wrong_at` replaced by a wrong token (None: never wrong); zeros when none
    does. Sampled, its q is one-hot at its drafts (a deterministic proposal)."""

    block = K

    def __init__(self, seqs: list[list[int]], wrong_at: int | None, vocab: int):
        self.seqs, self.wrong_at, self.vocab = seqs, wrong_at, vocab

    def start(self, batch):
        return None

    def seed(self, cache, main_hidden, start, count):
        return None

    def propose(self, cache, token, pos, k, temperature, generator):
        p, t = int(pos[0]) + 1, int(token[0])
        out = torch.zeros(1, k, dtype=torch.int64)
        for seq in self.seqs:
            if p < len(seq) and seq[p] == t:
                for j in range(k):
                    d = seq[min(p + 1 + j, len(seq) - 1)]
                    out[0, j] = (d + 1) % self.vocab if j == self.wrong_at else d
                break
        if temperature == 0.0:
            return out, None
        # a deterministic proposal: q puts all its mass on the draft
        return out, torch.zeros(1, k, self.vocab, dtype=torch.float64).scatter_(2, out.unsqueeze(-1), 1.0)


def _scheduled(session, prompts, speculation=None, prefix_cache=None, **kw):
    """Every prompt through one scheduler at once -> [(generated ids, text, finish_reason)]."""
    from dsneuron.runtime_min.core.scheduler import Request

    sch = session.scheduler(speculation=speculation, prefix_cache=prefix_cache)
    reqs = [sch.submit(Request(session.encode(p), max_tokens=m, **kw)) for p, m in prompts]
    sch.run()
    return [(r.generated, r.text, r.finish_reason) for r in reqs]


SCHED_PROMPTS = [("Hello there", 9), ("The quick brown fox jumps", 12), ("a", 7), ("Once upon a time, far away", 10)]


@pytest.mark.slow
def test_scheduler_speculation_gives_the_plain_schedulers_output(spec_runner):
    """Four requests at once through the scheduler with speculation (the bundle's own DSpark drafter,
    the TEST-ONLY lookup oracle always right and wrong at draft 1): each request's tokens, text and
    finish reason are the plain scheduler's; the oracle's steps keep drafts (mean acceptance length
    above 2), DSpark's random weights keep none. A stop string ends a request at the same text."""
    from dsneuron.graphs.config import ModelConfig
    from dsneuron.graphs.dspark import bundle_drafter
    from dsneuron.runtime_min.core.speculative import Speculation
    from dsneuron.runtime_min.session import Session

    session = Session(spec_runner)
    plain = _scheduled(session, SCHED_PROMPTS)
    cfg = ModelConfig.from_dict(spec_runner.manifest.model_config)
    seqs = [session.encode(p) + g for (p, _), (g, _, _) in zip(SCHED_PROMPTS, plain)]
    for drafter in (bundle_drafter(spec_runner.bundle, cfg, 1024), LookupOracle(seqs, None, spec_runner.vocab_size),
                    LookupOracle(seqs, 1, spec_runner.vocab_size)):
        spec = Speculation(drafter, K)
        assert _scheduled(session, SCHED_PROMPTS, spec) == plain, type(drafter).__name__
        assert spec.counts.steps > 0
        if isinstance(drafter, LookupOracle) and drafter.wrong_at is None:
            assert spec.counts.mean_length > 2
    text = plain[1][1]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    want = _scheduled(session, [SCHED_PROMPTS[1]], stop=[stop])
    assert want[0][2] == "stop"
    assert _scheduled(session, [SCHED_PROMPTS[1]], Speculation(LookupOracle(seqs, None, spec_runner.vocab_size), K),
                      stop=[stop]) == want


@pytest.mark.slow
def test_scheduler_speculation_with_the_prefix_cache_and_sampling(spec_runner):
    """With speculation: a prompt sent again starts from its prefix-cache snapshot (a fresh drafter
    ring) and gives the same greedy tokens; seeded sampled requests run to max_tokens and are
    reproducible from their seeds."""
    from dsneuron.runtime_min.core.prefix_cache import PrefixCache
    from dsneuron.runtime_min.core.speculative import Speculation
    from dsneuron.runtime_min.session import Session

    session = Session(spec_runner)
    plain = _scheduled(session, SCHED_PROMPTS[:2])
    seqs = [session.encode(p) + g for (p, _), (g, _, _) in zip(SCHED_PROMPTS, plain)]
    cache = PrefixCache(1 << 30)
    spec = Speculation(LookupOracle(seqs, 2, spec_runner.vocab_size), K)
    assert _scheduled(session, SCHED_PROMPTS[:2], spec, cache) == plain
    assert _scheduled(session, SCHED_PROMPTS[:2], spec, cache) == plain
    assert cache.stats()["hits"] >= 2
    sampled = [_scheduled(session, SCHED_PROMPTS, Speculation(LookupOracle(seqs, None, spec_runner.vocab_size), K),
                          temperature=0.8, seed=7) for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert [len(g) for g, _, reason in sampled[0] if reason == "length"] == [m for _, m in SCHED_PROMPTS]


@pytest.mark.slow
def test_served_speculation_with_the_openai_client(spec_runner):
    """`serve --speculative-tokens 3` as a client meets it: the openai package over 127.0.0.1, a greedy
    chat and a streamed completion give the plain server's text, and /metrics counts the verify
    steps (acceptance-length histogram, drafts offered and kept per position)."""
    import urllib.request

    import openai
    from in_process import TIMEOUT, served

    from dsneuron.runtime_min.core.speculative import Speculation
    from dsneuron.runtime_min.session import Session

    session = Session(spec_runner)
    seqs = [session.encode(p) + g for (p, _), (g, _, _) in zip(SCHED_PROMPTS, _scheduled(session, SCHED_PROMPTS))]
    got = []
    for speculation in (None, Speculation(LookupOracle(seqs, None, spec_runner.vocab_size), K)):
        with served(session, speculation=speculation) as (url, _):
            client = openai.OpenAI(base_url=url, api_key="x", timeout=TIMEOUT, max_retries=0)
            chat = client.chat.completions.create(model="bundle", messages=[{"role": "user", "content": "Hi there"}],
                                                  max_tokens=12, temperature=0)
            stream = client.completions.create(model="bundle", prompt="Once upon a time", max_tokens=10, stream=True,
                                               temperature=0)
            got.append((chat.choices[0].message.content, "".join(c.choices[0].text for c in stream)))
            metrics = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=TIMEOUT).read().decode()
            if speculation is not None:
                assert "dsneuron_spec_decode_acceptance_length_count" in metrics
                count = float(metrics.split("dsneuron_spec_decode_acceptance_length_count ")[1].split()[0])
                assert count >= 2 and 'dsneuron_spec_decode_draft_tokens_total{position="0"}' in metrics
            else:
                assert "dsneuron_spec_decode" not in metrics
    assert got[0] == got[1]


def test_runner_target_refuses_a_bundle_without_a_staged_chunk_bucket():
    """Speculation on a bundle whose chunk buckets are single graphs (the neuron target's: they return
    the last position's logits) and that has no verify bucket, or that has neither: a BundleError
    naming what the verify needs, before any request runs (run and serve then exit 2). A verify
    bucket (a neuron bundle compiled with --speculative dspark) or a staged chunk bucket serves."""
    from types import SimpleNamespace

    from dsneuron.runtime_min.bundle.schema import BundleError

    def runner(*buckets):
        return SimpleNamespace(manifest=SimpleNamespace(model_config={"dspark_target_layer_ids": [1]}, target="neuron",
                                                        buckets=[SimpleNamespace(kind=k, stages=st) for k, st in buckets]))

    for buckets in ([("prefill", ()), ("decode", ())], [("chunk", ()), ("decode", ("s",))]):
        with pytest.raises(BundleError, match="verifies drafts on a verify bucket .* or a staged chunk bucket"):
            sp.RunnerTarget(runner(*buckets))
    assert sp.RunnerTarget(runner(("chunk", ("s",)))).target_layers == (1,)
    assert sp.RunnerTarget(runner(("chunk", ()), ("verify", ()))).target_layers == (1,)
