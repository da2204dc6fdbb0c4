"""Continuous batching over a bundle's batch buckets: the one decode loop of runtime_min.

    scheduler = Scheduler(session.runner, session.decode, max_queue=64)   # or session.scheduler(64)
    req = scheduler.submit(Request(session.encode("Hello"), max_tokens=32, listener=on_output))
    while scheduler.busy:
        scheduler.step()

`Session.generate` runs its prompts through a Scheduler, and `dsneuron serve` runs one in an engine
thread (runtime_min/serving/server.py). No HTTP here and no executable: the scheduler decides which rows
run, the runner (runtime_min/core/runner.py) runs them. A request carries its own tokens, limits and
sampler, the scheduler keeps a bounded waiting queue and the rows of the batch buckets.

One step:
1. requests cancelled since the last step end (finish_reason "abort"): a waiting one leaves the
   queue, a running one frees its row;
2. waiting requests are admitted in arrival order while a row is free (the largest decode batch
   bucket bounds the rows): each runs a prefill of its own at the smallest batch bucket (batch 1
   where the bundle has it; other rows are filler), whose logits give its first token and whose
   state row 0 (and engram history row) is copied into the next row. A prompt past the largest
   prefill bucket runs as a chunked prefill (Runner.prefill_job) one chunk per step, holding a
   row meanwhile, so the running requests go on decoding between its chunks instead of waiting
   for the whole prompt; one such prompt at a time (the next one waits in the queue, the short
   ones behind it are admitted);
3. one decode over the active rows at the smallest batch bucket holding them: rows 0..n-1, each
   feeding its last token at its own position (prompt + generated - 1), at the smallest context
   capacity holding every row's position (Runner.decode). A row is freed the moment its
   request ends, and the last row moves into its place so the active rows stay at the front.

Prefix cache (runtime_min/core/prefix_cache.py; `prefix_cache`): a request's prefill starts from a
copy of the snapshot of its longest cached prefix and runs only the rest, as chunks
(Runner.prefill_job); the whole prompt counts only from a snapshot that kept the logits after its
last token (a prompt sent again: no executable call, the first token sampled from those logits),
any shorter prefix leaves a rest whose last call gives them. Snapshots are inserted after every
call of a prefill (its prompt so far, with that call's logits: at chunk boundaries and at the end
of the prompt) and when a request's row is freed (the tokens its row was fed: the prompt plus the
completion but its last sampled token, which is never fed back; what a chat's next turn
resends). The output is the request's without the cache, bit for bit: a state row after N tokens
is the same whichever steps produced it (graphs/model.py, one layout for prefill, chunk and
decode; tests/test_model.py).

Speculative decoding (`speculation`, runtime_min/core/speculative.py): each running request keeps
its own one-row state and drafter cache (`SpecRow`) instead of a row of the batch state. Step 3
becomes, per request: the drafter proposes up to k tokens after its last sampled one, one verify
call (the verify bucket of batch 1, or its chunk bucket: bit-identical to that many decode steps)
feeds the token and the drafts, greedy acceptance or rejection sampling keeps a prefix of them
plus one token of its own, and the state returns exactly to the kept position
(`RunnerTarget.commit`). The tokens are then accepted one by one as a decode step's are, so stop
strings, EOS and max_tokens end a request at the same token. A prompt that fits a prefill bucket
runs the plain prefill call (tapped, on the cpu target) and seeds the drafter's ring from it; one
that runs as chunks or starts from a prefix snapshot drafts without its prompt's ring (fewer
drafts kept, the same output). A request with a constraint (a grammar's mask) offers no drafts:
its verify is one token, sampled under the mask. Greedy output is the plain scheduler's bit for
bit; sampled output has the same distribution, not the same draws.

Independence: a request's output is what it gets alone. Its prefill is the call it gets alone
(same batch bucket, its own padded length); a decode row reads and writes only its own state
row; the cpu target's kernels have a fixed order of operations whatever the batch and row
(README "How the cpu target runs a model"); its sampler is its own torch.Generator seeded with
its seed. tests/test_scheduler.py checks it bit for bit.

A request ends at EOS (not part of its text; finish_reason "stop"), at a stop string (its text cut
before the string, as the OpenAI API's `stop`; "stop"), at max_tokens ("length"), by `cancel`
("abort"), or with an error of a step it was in ("error", `Request.error`).

Streaming: `listener(request, piece)` is called after every token a request samples (piece: the
text that became final, possibly ""), and once when it ends, with `finish_reason` set. Text that
could be the start of a stop string is held back until it cannot, so the pieces concatenate to
the final text. Threads: `submit`, `cancel`, `cancel_all` and the counters may be used from any
thread; `step` from one thread at a time.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dsneuron import UserError

from ..executors.collectives import collective_seconds
from . import select
from .checks import ParamError, check_generation
from .prefix_cache import PrefixCache
from .runner import PrefillJob, Runner, State
from .sampling import sample
from .speculative import RunnerTarget, SpecRow, Speculation, accept

#: OpenAI's limit on `stop` sequences (API reference, "stop": up to 4 sequences)
MAX_STOP = 4

Listener = Callable[["Request", str], None]


class TextStream:
    """Incremental detokenisation of one request: `push` a token id, get the text that became final.
    A tail that decodes to U+FFFD (an incomplete UTF-8 byte sequence) is held back until it completes
    or `finish` flushes it. `decode(ids) -> str` is the tokenizer's."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        """Add one id; returns the text that became final (possibly "")."""
        self.ids.append(token)
        text = self._decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        piece, self.emitted = text[len(self.emitted):], text
        return piece

    def finish(self) -> str:
        """The rest of the text (including held-back replacement characters of an invalid tail)."""
        text = self._decode(self.ids)
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece


@dataclass
class GenerationStats:
    """Timings of the last `Session.generate` call, in seconds (wall clock, time.perf_counter).

    prompt_tokens: the longest prompt's token count; prefill_bucket: "b<batch> s<seq_len>" of the
    longest prompt's prefill executable; rows: the prompts; load_s: executables loaded on first use
    during the call (counted in the step that needed them); prefill_s: the prefill steps (one per
    prompt), logits included; first_token_s: from the call's start to the first token sampled
    (encoding and bucket choice included); decode_steps / decode_s: the decode steps after the
    prefills; decode_tokens: the rows they decoded, summed over the steps; tokens_per_s:
    decode_tokens / decode_s; collective_s: of decode_s, the seconds inside the collectives of a sharded bundle's rank
    (runtime_min/executors/collectives.py collective_seconds; 0 for one process).
    """

    prompt_tokens: int
    prefill_bucket: str
    rows: int
    load_s: float = 0.0
    prefill_s: float = 0.0
    first_token_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    collective_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self) -> str:
        """One line for people: prefill, time to first token, decode rate."""
        load = (f"; executables loaded on first use {self.load_s:.3f} s (in the prefill and decode times)"
                if self.load_s else "")
        decode = (f"decode {self.decode_steps} steps, {self.decode_tokens} tokens of {self.rows} "
                  f"row{'s' if self.rows != 1 else ''} in "
                  f"{self.decode_s:.3f} s = {self.tokens_per_s:.1f} tokens/s" if self.decode_steps else "decode: no step")
        if self.collective_s:
            decode += f" (of which {self.collective_s:.3f} s in this rank's collectives)"
        return (f"prefill {self.prompt_tokens} tokens (bucket {self.prefill_bucket}) {self.prefill_s:.3f} s; "
                f"time to first token {self.first_token_s:.3f} s; {decode}{load}")


class RequestError(ParamError):
    """A request the bundle cannot run; `param` names the field at fault (OpenAI error `param`)."""


class QueueFull(UserError):
    """The waiting queue holds `max_queue` requests already (the server answers 429)."""


@dataclass(eq=False)
class Request:
    """One generation. prompt_ids: token ids (BOS included when wanted, `Session.encode`);
    max_tokens: new tokens at most; temperature / top_p / seed: as runtime_min/core/sampling.py (seed
    None: fresh entropy); stop: strings that end the generation (at most MAX_STOP, none empty);
    constraint: what may be sampled next, e.g. a runtime_min/serving/grammar.py Constraint (`allowed()`:
    bool [V] mask; `accept(token)` after each token but EOS), None for any token;
    max_tokens_name: what the caller calls max_tokens in its errors (a chat request may send
    `max_completion_tokens`).

    Filled in as it runs: `generated` (token ids, EOS excluded), `text` (final text so far),
    `sampled` (tokens sampled, EOS included: the OpenAI usage's completion_tokens), `finish_reason`
    ("stop", "length", "abort", "error" or None while running), `error`, and perf_counter times
    `arrival` (submit), `first_token_at`, `finished_at`.
    """

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    listener: Listener | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    constraint: object | None = None
    max_tokens_name: str = "max_tokens"
    generated: list[int] = field(default_factory=list, init=False)
    text: str = field(default="", init=False)
    sampled: int = field(default=0, init=False)
    finish_reason: str | None = field(default=None, init=False)
    error: str | None = field(default=None, init=False)
    arrival: float = field(default=0.0, init=False)
    first_token_at: float | None = field(default=None, init=False)
    finished_at: float | None = field(default=None, init=False)
    cancelled: bool = field(default=False, init=False)

    def __post_init__(self):
        self.stop = tuple(self.stop)
        self._generator = torch.Generator()
        self._stream: TextStream | None = None
        self._pending = ""  # final text held back: it may be the start of a stop string
        self._job: PrefillJob | None = None  # while the prompt is prefilled
        self._fed = 0  # tokens its state row holds: the prompt, then one more per decode step
        self._spec: SpecRow | None = None  # its own state and drafter cache, when the scheduler speculates

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _allowed(self) -> torch.Tensor | None:
        return None if self.constraint is None else self.constraint.allowed()

    def _take(self, piece: str, last: bool) -> str:
        """Add final text; returns what can be emitted now. At the first stop string the request
        ends ("stop") and the text is cut before it; otherwise, unless `last`, the longest tail
        that could still grow into a stop string is held back."""
        self._pending += piece
        if self.stop:
            hits = [i for i in (self._pending.find(s) for s in self.stop) if i >= 0]
            if hits:
                out, self._pending = self._pending[:min(hits)], ""
                self.finish_reason = "stop"
                return out
        hold = 0
        if not last and self.stop:
            for k in range(min(max(map(len, self.stop)) - 1, len(self._pending)), 0, -1):
                if any(s.startswith(self._pending[-k:]) for s in self.stop):
                    hold = k
                    break
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out


class Scheduler:
    """Continuous batching of `Request`s over a bundle's `Runner` (module docstring).

    detokenize(ids) -> str: the text of token ids (runtime_min/session.py Session.decode), for the
    streamed text and stop strings; max_queue: waiting requests at most (None: no bound, for a
    caller that submits a known list); stats: a GenerationStats that the steps add their times to
    (Session.generate's last_stats); prefix_cache: where prompts start from the state after their
    longest cached prefix and leave snapshots (module docstring, "Prefix cache"); None: no cache;
    speculation: draft and verify every request's tokens (module docstring, "Speculative
    decoding"); None: one token a decode step. Raises UserError for a max_queue below 1, ValueError
    for speculation on a bundle whose model has no DSpark target layers.
    """

    def __init__(self, runner: Runner, detokenize: Callable[[list[int]], str], max_queue: int | None = None,
                 stats: GenerationStats | None = None, prefix_cache: PrefixCache | None = None,
                 speculation: Speculation | None = None):
        if max_queue is not None and max_queue < 1:
            raise UserError(f"max_queue must be a positive integer, got {max_queue}")
        self.runner = runner
        self.detokenize = detokenize
        self.max_queue = max_queue
        self.stats = stats
        self.prefix_cache = prefix_cache
        self.speculation = speculation
        self._target = RunnerTarget(runner) if speculation is not None else None
        self.max_rows = max(runner.decode_batches)
        self.vocab_size = runner.vocab_size
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # row i holds _running[i]
        self._prefilling: Request | None = None  # a prompt in chunked prefill, one chunk a step
        self._state = State()  # rows >= the running requests, each tensor [rows, ...]
        #: set whenever there is work; an engine thread may wait on it when idle
        self.wake = threading.Event()

    # ------------------------------------------------------------------ requests
    def check(self, r: Request) -> None:
        """RequestError naming the field and the limit unless the bundle can run `r`: prompt ids
        within the vocabulary, as many as Runner.check_prompt_length allows (the largest prefill
        bucket, or the context capacity where the bundle has chunk buckets), max_tokens, sampling
        values and seed as checks.py `check_generation` (max_tokens within the context capacity),
        stop at most MAX_STOP non-empty strings."""
        ids = r.prompt_ids
        if not ids:
            raise RequestError("the prompt is empty; a prompt needs at least one token", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be integers in 0..{self.vocab_size - 1} (the vocabulary)",
                               "prompt")
        try:
            self.runner.check_prompt_length(len(ids))
        except UserError as e:
            raise RequestError(str(e), "prompt") from None
        try:
            check_generation(r.max_tokens, r.temperature, r.top_p, r.seed, names={"max_new_tokens": r.max_tokens_name},
                             context=(len(ids), self.runner.max_capacity))
        except ParamError as e:
            raise RequestError(str(e), e.param) from None
        if len(r.stop) > MAX_STOP or not all(isinstance(s, str) and s for s in r.stop):
            raise RequestError(f"stop must be at most {MAX_STOP} non-empty strings, got {list(r.stop)!r}", "stop")

    def submit(self, r: Request, checked: bool = False) -> Request:
        """Queue `r` (after `check`, unless `checked`: the caller ran it, as the server's engine
        does before it queues anything); returns it. Raises RequestError, QueueFull when max_queue
        requests wait already."""
        if not checked:
            self.check(r)
        if r.seed is None:
            r._generator.seed()
        else:
            r._generator.manual_seed(r.seed)
        r._stream = TextStream(self.detokenize)
        with self._lock:
            if self.max_queue is not None and len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting, --max-queue); retry later")
            r.arrival = time.perf_counter()
            self._waiting.append(r)
        self.wake.set()
        return r

    def cancel(self, r: Request) -> None:
        """End `r` at the next step ("abort"), freeing its row; nothing for an ended request."""
        r.cancelled = True
        self.wake.set()

    def cancel_all(self) -> None:
        """Cancel every waiting and running request (each ends "abort" at the next step)."""
        with self._lock:
            for r in [*self._waiting, *self._running, *([self._prefilling] if self._prefilling else [])]:
                r.cancelled = True
        self.wake.set()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Rows in use: decoding requests, and a prompt in chunked prefill."""
        return len(self._running) + (self._prefilling is not None)

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._running or self._prefilling)

    # ------------------------------------------------------------------ the loop
    def step(self) -> None:
        """One step (module docstring). An exception of a prefill ends that request ("error") and
        one of a decode ends every running request ("error", their rows freed) before it is
        re-raised: the scheduler stays usable."""
        self._reap()
        self._admit()
        if self._running:
            if self.speculation is not None:
                self._decode_speculative()
            else:
                self._decode()
        if not self.busy:
            self.wake.clear()

    def run(self) -> None:
        """Step until no request waits or runs."""
        while self.busy:
            self.step()

    def _reap(self) -> None:
        with self._lock:
            gone = [r for r in self._waiting if r.cancelled]
            for r in gone:
                self._waiting.remove(r)
        for r in gone:
            self._end(r, "abort")
        for r in [r for r in self._running if r.cancelled]:
            self._free(r)
            self._end(r, "abort")
        if self._prefilling is not None and self._prefilling.cancelled:
            r, self._prefilling = self._prefilling, None
            self._end(r, "abort")

    def _admit(self) -> None:
        """Step 2 of the module docstring. A prompt past the largest prefill bucket (chunked
        prefill, Runner.prefill_job) holds a row while it runs one chunk per step; one such
        prompt at a time, the requests behind it in the queue go on being admitted unless they
        need chunks too (they wait for it, in arrival order)."""
        if self._prefilling is not None:
            self._prefill(self._prefilling)
        while len(self._running) + (self._prefilling is not None) < self.max_rows:
            with self._lock:
                if not self._waiting:
                    return
                r = self._waiting[0]
                if self._prefilling is not None and self.runner.needs_chunks(len(r.prompt_ids)):
                    return
                self._waiting.popleft()
            self._prefill(r)

    def _prefill(self, r: Request) -> None:
        """The next executable call of r's prefill (the first one creates its job, from the longest
        usable cached prefix); when the prompt is done, its first token and its row. Snapshots go
        to the prefix cache after every call. A prompt cached whole with its logits runs no call."""
        t0 = time.perf_counter()
        try:
            if r._job is None:
                ids, hit = r.prompt_ids, None
                if self.prefix_cache is not None:
                    hit = self.prefix_cache.longest_prefix(ids, usable=lambda n, s: n < len(ids) or s.logits is not None)
                if hit is not None and hit[0] == len(ids):
                    self._start_row(r, hit[1].logits[None], self.runner.restore(hit[1]))
                    return
                if self.speculation is not None and hit is None and not self.runner.needs_chunks(len(ids)) \
                        and self.runner.can_tap_prefill(1):
                    self._prefill_seeding(r, t0)
                    return
                r._job = self.runner.prefill_job(ids, prefix=hit)
            done = r._job.step()
        except BaseException as e:
            if self._prefilling is r:
                self._prefilling = None
            self._end(r, "error", f"{type(e).__name__}: {e}")
            raise
        self._keep(r.prompt_ids[:r._job.fed], r._job.last.state, 0, r._job.last.logits)
        if self.stats is not None:
            self.stats.prefill_s += time.perf_counter() - t0
        if not done:
            self._prefilling = r
            return
        if self._prefilling is r:  # a short prompt admitted beside a chunked one leaves that one running
            self._prefilling = None
        prefilled = r._job.result
        r._job = None  # its state is copied into the row: not kept twice
        self._start_row(r, prefilled.logits[:1], prefilled.state)

    def _prefill_seeding(self, r: Request, t0: float) -> None:
        """Speculation's prefill of a prompt that fits a prefill bucket: the same call as the plain
        one (Runner.verify_prefill: the same logits, and main_hidden at every position, or at the
        prompt's last positions from a single-graph prefill), main_hidden seeding the drafter's cache
        of the row."""
        ids, spec = r.prompt_ids, self.speculation
        try:
            v = self._target.prefill([ids])
            start, count = v.seed_span()
            cache = spec.drafter.seed(spec.drafter.start(1), v.main_hidden[:1], start[:1], count[:1])
        except BaseException as e:
            self._end(r, "error", f"{type(e).__name__}: {e}")
            raise
        logits = v.last_logits()[:1]
        self._keep(ids, v.state, 0, logits)
        if self.stats is not None:
            self.stats.prefill_s += time.perf_counter() - t0
        self._start_row(r, logits, v.state, cache)

    def _start_row(self, r: Request, logits: torch.Tensor, state: State, cache=None) -> None:
        """r's prompt is fed (its last token's logits [1, V], its state in row 0 of `state`): its
        first token, then, unless that ended it, row 0 of `state` into the next free row (when
        speculating: into the request's own SpecRow, with the drafter's `cache` of it, or a fresh
        one: a prompt that ran as chunks or from a prefix snapshot drafts without its prompt's ring)."""
        r._fed = len(r.prompt_ids)
        self._accept(r, int(sample(logits, r.temperature, r.top_p, r._generator, r._allowed())[0]))
        if not r.finished and self.speculation is not None:
            d = self.speculation.drafter
            r._spec = SpecRow(self.runner.fit_rows(state, 1), d.start(1) if cache is None else cache, list(r.prompt_ids))
            self._running.append(r)
        elif not r.finished:
            n = len(self._running)
            rows = select.first_fit(self.runner.decode_batches, n + 1)
            self._state = self.runner.place_row(self._state, n, state, rows)
            self._running.append(r)

    def _keep(self, fed: list[int], state: State, row: int, logits: torch.Tensor | None = None) -> None:
        """Snapshot row `row` of `state`, the state after the tokens `fed` (and `logits`, fp32
        [B, V] after them, when the call that fed them gave them), into the prefix cache."""
        if self.prefix_cache is not None and fed and self.prefix_cache.max_bytes:
            self.prefix_cache.insert(fed, self.runner.snapshot(state, row, logits))

    def _decode(self) -> None:
        n = len(self._running)
        batch = select.first_fit(self.runner.decode_batches, n)
        self._state = self.runner.fit_rows(self._state, batch)
        tokens = torch.full((batch,), self.runner.pad_token_id, dtype=torch.int64)
        pos = torch.zeros(batch, dtype=torch.int64)
        for i, r in enumerate(self._running):
            tokens[i] = r.generated[-1]
            pos[i] = len(r.prompt_ids) + len(r.generated) - 1
        t0, c0 = time.perf_counter(), collective_seconds()
        try:
            step = self.runner.decode(tokens, pos, self._state)
        except BaseException as e:
            for r in list(self._running):
                self._end(r, "error", f"{type(e).__name__}: {e}")
            self._running, self._state = [], State()
            raise
        self._state = step.state
        for i, r in enumerate(self._running):
            r._fed += 1
            self._accept(r, int(sample(step.logits[i:i + 1], r.temperature, r.top_p, r._generator, r._allowed())[0]))
        if self.stats is not None:
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.collective_s += collective_seconds() - c0
            self.stats.decode_steps += 1
            self.stats.decode_tokens += n
        for r in [r for r in self._running if r.finished]:
            self._free(r)

    def _decode_speculative(self) -> None:
        """Step 3 with speculation (module docstring): per running request, one verify call of its
        token and its drafts (none for a request with a constraint, whose mask the drafts would
        bypass, nor past max_tokens), its kept tokens accepted one by one until one ends it."""
        spec = self.speculation
        t0, emitted = time.perf_counter(), 0
        for r in list(self._running):
            row = r._spec
            last = len(row.fed) - 1  # the position of the last token the state holds
            n = 0 if r.constraint is not None else max(0, min(spec.k, r.max_tokens - len(r.generated) - 1))
            token = torch.tensor([r.generated[-1]])
            try:
                drafts, q = (spec.drafter.propose(row.cache, token, torch.tensor([last]), n, r.temperature, r._generator)
                             if n else (torch.zeros(1, 0, dtype=torch.int64), None))
                v = self._target.verify(torch.cat([token.view(1, 1), drafts[:, :n]], dim=1), torch.tensor([last + 1]),
                                        torch.tensor([1 + n]), row.state)
                lg = v.logits[0, :n + 1]
                if n == 0:  # the plain decode step's sampling, under the request's mask
                    a, nxt = 0, int(sample(lg[:1], r.temperature, r.top_p, r._generator, r._allowed())[0])
                else:
                    a, nxt = accept(drafts[0, :n], lg, None if q is None else q[0, :n], r.temperature, r.top_p,
                                    r._generator)
                keep = torch.tensor([1 + a])
                row.state = self._target.commit(v, keep)
                row.cache = spec.drafter.seed(row.cache, v.main_hidden, v.pos, keep)
            except BaseException as e:
                for x in list(self._running):
                    self._end(x, "error", f"{type(e).__name__}: {e}")
                self._running = []
                raise
            row.fed += [int(x) for x in v.tokens[0, :1 + a]]
            r._fed = len(row.fed)
            spec.counts.add(a, n)
            for x in [*(int(d) for d in drafts[0, :a]), nxt]:
                emitted += 1
                self._accept(r, x)
                if r.finished:
                    break
        if self.stats is not None:
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.decode_steps += 1
            self.stats.decode_tokens += emitted
        for r in [r for r in self._running if r.finished]:
            self._free(r)

    def _free(self, r: Request) -> None:
        """Free r's row (a snapshot of it to the prefix cache first: what a chat's next turn
        resends); the last row moves into it."""
        if r._spec is not None:  # its own row, keyed by the ids its state holds
            self._keep(r._spec.fed, r._spec.state, 0)
            r._spec = None
            self._running.remove(r)
            return
        i, last = self._running.index(r), len(self._running) - 1
        self._keep((r.prompt_ids + r.generated)[:r._fed], self._state, i)
        if i != last:
            self.runner.move_row(self._state, i, last)
            self._running[i] = self._running[last]
        self._running.pop()

    # ------------------------------------------------------------------ outputs
    def _accept(self, r: Request, token: int) -> None:
        r.sampled += 1
        if r.first_token_at is None:
            r.first_token_at = time.perf_counter()
        if token == self.runner.manifest.tokenizer.eos_token_id:
            self._end(r, "stop")
            return
        if r.constraint is not None:
            r.constraint.accept(token)
        r.generated.append(token)
        piece = r._take(r._stream.push(token), last=False)
        if r.finished:  # a stop string
            self._end(r, "stop", prefix=piece)
        elif len(r.generated) >= r.max_tokens:
            self._end(r, "length", prefix=piece)
        else:
            self._emit(r, piece)

    def _end(self, r: Request, reason: str, error: str | None = None, prefix: str = "") -> None:
        """End r: flush its held-back text (none after a stop string or an error) and tell its
        listener. A stop string found in the flushed text makes the reason "stop"."""
        piece = prefix
        if r.finish_reason is None and reason != "error":
            piece += r._take(r._stream.finish(), last=True)
        r.finish_reason = r.finish_reason or reason
        r.error = error
        r.finished_at = time.perf_counter()
        self._emit(r, piece)

    def _emit(self, r: Request, piece: str) -> None:
        r.text += piece
        if r.listener is not None:
            r.listener(r, piece)
