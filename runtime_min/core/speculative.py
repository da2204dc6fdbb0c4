"""Speculative decoding: a drafter proposes k tokens, one verify pass of the main model checks them.

The loop (`generate`) is the same whatever runs the main model (a `Target`: the compiled bundle
through `RunnerTarget`, or the eager golden, tests/golden_target.py GoldenTarget) and whatever drafts (a
`Drafter`: DSpark, graphs/dspark.py, or a test's oracle). Per row and step:

1. the drafter proposes d_1..d_k after the row's next token x (fed at position t);
2. verify: the main model runs [x, d_1..d_k] at positions t..t+k as one chunk (graphs/steps.py
   prefill_chunk: bit-identical to k+1 decode steps) and returns the logits at every position and
   main_hidden (the drafter's input) at every position;
3. acceptance: greedy keeps the longest prefix of drafts equal to the verify's argmax, plus the
   verify's own next token at the first mismatch (or after the last draft): 1..k+1 tokens a step,
   each exactly the token plain greedy decoding picks. Sampled decoding uses speculative rejection
   sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
   Algorithm 1; Chen et al. 2023): draft d_i drawn from the drafter's q_i is kept with probability
   min(1, p_i(d_i) / q_i(d_i)), else the token is drawn from max(0, p_i - q_i) normalised and the
   step ends; if all are kept one more is drawn from p_{k+1}. Each emitted token then has the main
   model's distribution p (`runtime_min/core/sampling.py probabilities`: temperature and top-p).
4. the state returns exactly to the accepted position (`Target.commit`): the verify advanced it by
   k+1 positions, the row keeps 1+a of them.

The returned state: the runner replays the accepted tokens as a chunk from the state the verify was
given (Step.state_in; the engram history as it was), because a chunk is bit-identical to its decode
steps by construction and the rejected positions' writes reach every kind of state (window ring
slots, the compressor's pending group, compressed KV and indexer-key rows of groups they complete,
the engram n-gram history); undoing them in place would need the per-position compressor rows the
compiled chunk does not return. The cost is one more chunk call on every step that rejects a
draft (measured: bench/spec.py). A step that keeps every draft costs nothing more. The
drafter's ring is written only at accepted positions (`Drafter.seed`), so it needs no undo.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from .sampling import probabilities


# ----------------------------------------------------------------------------------------- acceptance
def accept_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """drafts int64 [k], verify logits fp32 [k+1, V] (position j predicts the token after draft j,
    j = 0 the row's own token) -> (a, next): a drafts kept (the longest prefix equal to the argmax),
    next the argmax after them."""
    best = logits.argmax(dim=-1)
    k = drafts.numel()
    a = 0
    while a < k and int(drafts[a]) == int(best[a]):
        a += 1
    return a, int(best[a])


def accept_sampled(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative rejection sampling (module docstring). drafts int64 [k]; p float64 [k+1, V] the
    target's distributions at the verify positions; q float64 [k, V] the drafter's proposal
    distributions the drafts were drawn from -> (a, next) as `accept_greedy`."""
    k = drafts.numel()
    for j in range(k):
        d = int(drafts[j])
        u = torch.rand((), dtype=torch.float64, generator=generator)
        if float(u) * float(q[j, d]) < float(p[j, d]):  # u < p/q without dividing by a zero q
            continue
        residual = (p[j] - q[j]).clamp(min=0)
        return j, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def accept(drafts: torch.Tensor, logits: torch.Tensor, q: torch.Tensor | None, temperature: float, top_p: float,
           generator: torch.Generator | None) -> tuple[int, int]:
    """One row's acceptance (module docstring, step 3): `accept_greedy` at temperature 0, else
    `accept_sampled` against the target's p = probabilities(logits, temperature, top_p). drafts
    int64 [k], logits fp32 [k+1, V], q float64 [k, V] (None at temperature 0) -> (a, next)."""
    if temperature == 0.0:
        return accept_greedy(drafts, logits)
    return accept_sampled(drafts, probabilities(logits, temperature, top_p), q, generator)


# ----------------------------------------------------------------------------------------- protocols
@dataclass
class Verified:
    """One verify (or tapped prefill) call. logits fp32 [B, S, V] at every position, or, for a
    prefill, fp32 [B, V] after each row's count[b] tokens (what the loop reads: `last_logits`);
    main_hidden bf16 [B, S, T*D] at every position; state: the target's state after every row's
    count[b] tokens; tokens int64 [B, S], pos int64 [B] (row b's first position), count int64 [B];
    state_in: the state the call was given (None for a prefill); seconds: the call's time.
    hidden_pos: int64 [B], where main_hidden starts when not at pos: a single-graph prefill returns
    each prompt's last positions only (Runner.verify_prefill), all the drafter's rings keep; one
    without them has main_hidden None, and the drafter starts without the prompt's ring."""

    logits: torch.Tensor
    main_hidden: torch.Tensor | None
    state: Any
    tokens: torch.Tensor
    pos: torch.Tensor
    count: torch.Tensor
    state_in: Any = None
    seconds: float = 0.0
    hidden_pos: torch.Tensor | None = None

    def seed_span(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(start, count) int64 [B]: the positions main_hidden[b, :count[b]] hold, from start[b] on
        (what a drafter's `seed` takes after a prefill)."""
        if self.hidden_pos is None:
            return self.pos, self.count
        return self.hidden_pos, self.pos + self.count - self.hidden_pos

    def last_logits(self) -> torch.Tensor:
        """fp32 [B, V]: each row's logits after its count[b] tokens."""
        if self.logits.dim() == 2:
            return self.logits
        return self.logits[torch.arange(self.logits.size(0)), self.count - 1]


class Target(Protocol):
    """The main model. prefill(prompts) -> Verified over the prompts (rows right-padded, count the
    lengths); verify(tokens [B,S], pos [B], count [B], state) -> Verified; commit(v, keep [B]) ->
    the state after row b's first keep[b] (0 <= keep[b] <= count[b]) tokens of v, bit-identical to
    feeding just those (keep 0: the row as the verify found it, a finished row riding along)."""

    def prefill(self, prompts: Sequence[Sequence[int]]) -> Verified: ...

    def verify(self, tokens: torch.Tensor, pos: torch.Tensor, count: torch.Tensor, state: Any) -> Verified: ...

    def commit(self, v: Verified, keep: torch.Tensor) -> Any: ...


class Drafter(Protocol):
    """A drafter. block: the most drafts one call makes. start(B) -> its state for B rows;
    seed(cache, main_hidden [B,S,*], start [B], count [B]) -> cache with row b's positions start[b]..
    start[b]+count[b]-1 written; propose(cache, token [B], pos [B], k, temperature, generator) ->
    (drafts int64 [B, k], q float64 [B, k, V] or None at temperature 0): drafts for positions
    pos+2.. after token (fed at pos+1; pos already seeded)."""

    block: int

    def start(self, batch: int) -> Any: ...

    def seed(self, cache: Any, main_hidden: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> Any: ...

    def propose(self, cache: Any, token: torch.Tensor, pos: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass
class SpecStats:
    """What speculation did: accepted[i] the tokens one verify step emitted for one row (1 + the
    drafts kept), per_position[j] how often draft j was kept, proposed[j] how often it was offered;
    verify_seconds / replay_seconds / draft_seconds: time in the verify calls, the state replays, the
    drafter; tokens: the new tokens emitted."""

    accepted: list[int] = field(default_factory=list)
    per_position: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    verify_seconds: float = 0.0
    replay_seconds: float = 0.0
    draft_seconds: float = 0.0
    replays: int = 0
    #: new tokens emitted, over the rows (EOS included)
    tokens: int = 0

    @property
    def mean_acceptance(self) -> float:
        """Mean tokens per verify step and row (1.0: no draft ever kept)."""
        return sum(self.accepted) / max(len(self.accepted), 1)

    def _count(self, kept: int, offered: int) -> None:
        for name, n in (("per_position", kept), ("proposed", offered)):
            lst = getattr(self, name)
            lst.extend([0] * (offered - len(lst)))
            for j in range(n):
                lst[j] += 1


@dataclass
class Generation:
    """`generate`'s result: tokens[b] the new tokens of row b (max_new of them unless it stopped at
    eos), logits[b] the verify's logits fp32 [V] each of them was chosen from, state the target's
    state after the last token fed, stats."""

    tokens: list[list[int]]
    logits: list[list[torch.Tensor]]
    state: Any
    stats: SpecStats


def generate(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], max_new: int, k: int,
             temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None,
             eos: int | None = None, keep_logits: bool = True) -> Generation:
    """Speculative decoding of every prompt (row b) for max_new tokens each, k drafts a step
    (1 <= k <= drafter.block; a row near its budget drafts fewer). Rows accept different counts
    and advance by them in the same calls. Raises ValueError for k out of range or max_new < 1.

    A finished row still rides along in each call (fed its last token again at position 0) and
    keeps its state: `state` holds each row's state after its last fed token. keep_logits=False
    leaves Generation.logits empty (a long generation's logits are V floats a token)."""
    if not 1 <= k <= drafter.block:
        raise ValueError(f"k must be in 1..{drafter.block} (the drafter's block size), got {k}")
    if max_new < 1:
        raise ValueError(f"max_new must be >= 1, got {max_new}")
    B = len(prompts)
    stats = SpecStats()
    v = target.prefill(prompts)
    lens = v.count.clone()
    out: list[list[int]] = [[] for _ in range(B)]
    out_logits: list[list[torch.Tensor]] = [[] for _ in range(B)]
    t0 = time.perf_counter()
    cache = drafter.start(B)
    if v.main_hidden is not None:
        cache = drafter.seed(cache, v.main_hidden, *v.seed_span())
    stats.draft_seconds += time.perf_counter() - t0
    last = lens - 1  # each row's last position in the state
    first = v.last_logits()
    token = _pick(first, temperature, top_p, generator)
    for b in range(B):
        out[b].append(int(token[b]))
        if keep_logits:
            out_logits[b].append(first[b])
    state = v.state
    done = [max_new <= 1 or (eos is not None and out[b][-1] == eos) for b in range(B)]
    while not all(done):
        need = torch.tensor([0 if done[b] else max_new - len(out[b]) for b in range(B)])
        kb = torch.clamp(need - 1, min=0, max=k)  # drafts per row: never past the row's budget
        t0 = time.perf_counter()
        drafts, q = drafter.propose(cache, token, last, k, temperature, generator)
        stats.draft_seconds += time.perf_counter() - t0
        tokens = torch.cat([token.unsqueeze(1), drafts], dim=1)
        pos = torch.where(torch.tensor(done), 0, last + 1)
        count = torch.where(torch.tensor(done), 1, 1 + kb)
        v = target.verify(tokens, pos, count, state)
        stats.verify_seconds += v.seconds
        keep = torch.zeros(B, dtype=torch.int64)  # a finished row keeps nothing: its state stays
        nxt = torch.zeros(B, dtype=torch.int64)
        for b in range(B):
            if done[b]:
                continue
            n = int(kb[b])
            lg = v.logits[b, :n + 1]
            a, t = accept(drafts[b, :n], lg, None if q is None else q[b, :n], temperature, top_p, generator)
            new = [int(x) for x in drafts[b, :a]] + [t]
            for j, x in enumerate(new):
                out[b].append(x)
                if keep_logits:
                    out_logits[b].append(lg[j])
                if (eos is not None and x == eos) or len(out[b]) >= max_new:
                    done[b] = True
                    break
            keep[b], nxt[b] = 1 + a, t
            stats.accepted.append(1 + a)
            stats._count(a, n)
        replay = bool(((keep > 0) & (keep < v.count)).any())
        t0 = time.perf_counter()
        state = target.commit(v, keep)
        if replay:
            stats.replays += 1
            stats.replay_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        cache = drafter.seed(cache, v.main_hidden, v.pos, keep)
        stats.draft_seconds += time.perf_counter() - t0
        last = torch.where(torch.tensor(done), last, v.pos + keep - 1)
        token = nxt
    stats.tokens = sum(len(o) for o in out)
    return Generation(out, out_logits, state, stats)


# ----------------------------------------------------------------------------------------- in the scheduler
@dataclass
class AcceptanceCounts:
    """Running totals of a server's speculation (Prometheus, runtime_min/serving/engine.py): lengths[L]
    the verify steps that emitted L tokens (1 + the drafts kept; index 0 unused), kept[j] / offered[j]
    how often draft j was kept / offered. Bounded in size by the block, however long it runs."""

    lengths: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    offered: list[int] = field(default_factory=list)

    def add(self, a: int, n: int) -> None:
        """One verify step of one row that offered n drafts and kept a of them."""
        for lst, size in ((self.lengths, a + 2), (self.kept, n), (self.offered, n)):
            lst.extend([0] * (size - len(lst)))
        self.lengths[a + 1] += 1
        for j in range(n):
            self.offered[j] += 1
            if j < a:
                self.kept[j] += 1

    @property
    def steps(self) -> int:
        return sum(self.lengths)

    @property
    def mean_length(self) -> float:
        """Mean tokens a verify step emitted (1.0: no draft ever kept; 0.0 before any step)."""
        return sum(L * c for L, c in enumerate(self.lengths)) / max(self.steps, 1)


@dataclass
class Speculation:
    """Speculative decoding in the scheduler (runtime_min/core/scheduler.py): `drafter` proposes up to
    k tokens a step for each running request, the bundle's verify (or chunk) bucket verifies them
    (`RunnerTarget`); counts: what was kept. Raises ValueError for k outside 1..drafter.block."""

    drafter: Drafter
    k: int
    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)

    def __post_init__(self):
        if not 1 <= self.k <= self.drafter.block:
            raise ValueError(f"speculative tokens must be in 1..{self.drafter.block} (the drafter's block size), got {self.k}")


@dataclass
class SpecRow:
    """One request's speculative decoding state in the scheduler: the target's state of one row
    after the tokens `fed` (the prompt and every kept token: the ids its state holds, which a
    prefix-cache snapshot is keyed by), and the drafter's cache of one row."""

    state: Any
    cache: Any
    fed: list[int]


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, temperature, top_p), 1, generator=generator)[:, 0]


# ----------------------------------------------------------------------------------------- the runner
class RunnerTarget:
    """A compiled bundle as the `Target` (runtime_min/core/runner.py `Runner.verify`): prefill and verify
    read the head at every position and the stream entering each DSpark target layer, from the
    prefill and chunk buckets stage by stage (the cpu target's staged buckets) or from the
    verify buckets' own outputs (the neuron target's; its prefill is read at the last position
    only); commit replays the kept tokens from the verify's input state when a row rejected a
    draft. Raises ValueError for a model without DSpark target layers, BundleError for a bundle
    with neither a verify bucket nor a staged chunk bucket."""

    def __init__(self, runner, target_layers: Sequence[int] | None = None):
        from ..bundle.schema import BundleError

        self.runner = runner
        cfg = runner.manifest.model_config
        self.target_layers = tuple(cfg.get("dspark_target_layer_ids", ()) if target_layers is None else target_layers)
        if not self.target_layers:
            raise ValueError("RunnerTarget: the bundle's model has no DSpark target layers")
        if not any(b.kind == "chunk" and b.stages or b.kind == "verify" for b in runner.manifest.buckets):
            raise BundleError("speculative decoding verifies drafts on a verify bucket (a neuron bundle compiled with "
                              "--speculative dspark) or a staged chunk bucket (a cpu bundle compiled with "
                              "compile.chunked_prefill), which read every position's logits; this bundle "
                              f"({runner.manifest.target} target) has neither")

    def prefill(self, prompts: Sequence[Sequence[int]]) -> Verified:
        return self.runner.verify_prefill(prompts, self.target_layers)

    def verify(self, tokens: torch.Tensor, pos: torch.Tensor, count: torch.Tensor, state) -> Verified:
        return self.runner.verify(tokens, pos, count, state, self.target_layers)

    def commit(self, v: Verified, keep: torch.Tensor):
        state = v.state
        if bool(((keep > 0) & (keep < v.count)).any()):
            state = self.runner.verify(v.tokens, v.pos, keep.clamp(min=1), v.state_in, self.target_layers,
                                       taps=False).state
        idle = [b for b in range(keep.numel()) if keep[b] == 0]
        if not idle:
            return state
        tensors = {n: t.clone() for n, t in state.tensors.items()}
        history = None if state.history is None else state.history.clone()
        for b in idle:  # a finished row: as the verify found it
            for n, t in tensors.items():
                t[b] = v.state_in.tensors[n][b]
            if history is not None:
                history[b] = v.state_in.history[b]
        return type(state)(tensors, history)
