"""The runner: a loaded bundle's executables and the state rows they carry.

The one layer that calls executables. The request path goes serve (runtime_min/serving/server.py) ->
scheduler (runtime_min/core/scheduler.py) -> runner -> executable; `Session` (runtime_min/session.py)
tokenizes in front of it, and the teacher-forced runs and the benchmarks call it directly.

    runner = Runner.load("artifacts/")
    step = runner.prefill([ids])                                  # one prompt in row 0
    step = runner.decode(tokens, positions, step.state)           # tokens, positions: int64 [B]

Calls (each returns a `Step`: logits, the new `State`, probes, the state given, the call's time):
- `prefill(prompts)`: prompts in rows 0.., right-padded to the smallest prefill bucket holding the
  longest, at the smallest batch bucket (`prefill_batch`) unless told; rows past the prompts are
  filler (one pad token);
- `prefill_job(ids, prefix=None)`: one prompt's prefill one executable call at a time
  (`PrefillJob`): one call where it fits a prefill bucket, else, in a bundle with chunk buckets, a
  prefill of the first chunk and then `chunk` calls, so a scheduler can decode other rows between
  them; from a prefix-cache snapshot (`snapshot`, `restore`), only the tokens after it, as chunks;
- `chunk(ids, start, state, capacity)`: the next tokens of the prompt in row 0 from position
  `start`, continuing its state (graphs/steps.py prefill_chunk: the numerics of that many decode
  steps);
- `decode(tokens, positions, state)`: one token per row, each row at its own position, at the
  decode bucket of batch B and the smallest capacity holding every position. The one decode
  primitive: the scheduler's loop, the teacher-forced runs and the step benchmark all call it;
- `verify(tokens, pos, count, state, target_layers)` / `verify_prefill(prompts, target_layers)`: a
  speculative verify (runtime_min/core/speculative.py; returns a speculative.Verified, not a Step): the
  chunk (prefill) bucket run stage by stage, read at every position (logits and the DSpark target
  layers' streams).

State carried between calls (`State`): the manifest's state tensors, every one [B, ...] with one
capacity-dependent dimension, and the engram history [B, H]. A call takes the state at any
capacity and resizes it to its bucket's (schema.py's rule: append fill rows to grow, drop unused
trailing rows to shrink); a tensor the state lacks starts as its manifest fill value. Rows are
independent (a row reads and writes only its own state row), so the row operations (`fresh_state`,
`fit_rows`, `place_row`, `move_row`) only copy and pad.

Executables load on first use (`executable`); `load_seconds` adds up the time spent loading them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Generator, Protocol, Sequence, runtime_checkable

import torch

from dsneuron import UserError

from ..bundle import schema
from ..bundle.bundle import Bundle, is_stablehlo, open_bundle
from ..bundle.schema import MAIN_HIDDEN, PROBE_PREFIX, Bucket, BundleError, StateEntry, TensorSpec
from ..executors.executor_cpu import CpuExecutable, StagedExecutable, register_custom_ops
from . import select
from .prefix_cache import Snapshot

DATA_INPUTS = frozenset(n for names in schema.DATA_INPUTS.values() for n in names)


@runtime_checkable
class Executable(Protocol):
    """One loaded bucket, whatever runs it: CpuExecutable and StagedExecutable (executor_cpu.py; a
    sharded bundle's ranks load these too), NeuronExecutable, StableHloExecutable. The weights are
    bound at load; `run(inputs)` takes the data+state tensors of `bucket.inputs` in order and
    returns those of `bucket.outputs`, raising ValueError for an input of another shape or dtype."""

    bucket: Bucket

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]: ...


#: makes one bucket's executable: (path of its file, the bucket, its weights in `bucket.weights` order)
ExecutableFactory = Callable[[Path, Bucket, list[torch.Tensor]], Executable]


@dataclass
class State:
    """The state of B rows between calls. tensors: {manifest state name: [B, ...]} in the state's
    dtype, the capacity-dependent dimension at some bucket's capacity (a name left out starts as its
    fill value at the next call); history: the engram hasher's history int64 [B, H] (H =
    max_ngram_size - 1; kernels_nki/engram_hash.py), None when the bundle hashes no engram ids."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    history: torch.Tensor | None = None


@dataclass
class Step:
    """What one executable call gave. logits: fp32 [B, V] (each row's after its last valid token),
    None where the call skipped the head (a verify reads every position through the taps); state:
    the state after the call (tensors at the bucket's capacity); probes: {stage name without
    PROBE_PREFIX: [B, ...]}, empty unless the bundle was compiled with probes; state_in: the state
    tensors the call was given, {name: [B, ...]} at the bucket's capacity; seconds: wall time of the
    executable call alone (no hashing, no padding); bucket: the bucket that ran."""

    logits: torch.Tensor | None
    state: State
    probes: dict[str, torch.Tensor]
    state_in: dict[str, torch.Tensor]
    seconds: float
    bucket: Bucket
    #: {stage name: {wiring name: tensor}}: the inputs of the stages a call tapped
    #: (StagedExecutable.run_tapped; `verify`), else empty
    taps: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: a verify bucket's main_hidden bf16 [B, S, T*D] (then logits is fp32 [B, S, V]), else None
    main_hidden: torch.Tensor | None = None


class PrefillJob:
    """One prompt's prefill, one executable call per `step` (`Runner.prefill_job`): the scheduler
    runs a long prompt's chunks between the decode steps of the running requests. `step()` runs the
    next call and returns True when the prompt is done; `result` is then the Step of its last call
    (logits [B, V] and state with the prompt in row 0). After each call, `fed` is how many of the
    prompt's tokens row 0 of `last.state` holds (a prefix-cache snapshot point) and `started` how
    many came from a snapshot (0 without one)."""

    def __init__(self, calls: Generator[tuple[int, Step], None, Step], total: int, started: int = 0):
        self._calls, self._total = calls, total
        self.result: Step | None = None
        self.last: Step | None = None
        self.fed = self.started = started

    def step(self) -> bool:
        if self.result is None:
            try:
                self.fed, self.last = next(self._calls)
            except StopIteration as end:
                self.result = self.last = end.value
                self.fed = self._total
        return self.result is not None

    def run(self) -> Step:
        """Every call left; returns `result`."""
        while not self.step():
            pass
        return self.result


def resize_state(t: torch.Tensor, spec: TensorSpec, fill: float) -> torch.Tensor:
    """`t` at the shape of `spec`: equal shapes pass through; otherwise exactly one dimension may
    differ (the capacity-dependent one): growing appends rows of `fill`, shrinking drops trailing
    rows (unused below the new capacity, schema.py). Raises BundleError for any other mismatch."""
    if tuple(t.shape) == spec.shape:
        return t
    diff = [d for d, (a, b) in enumerate(zip(t.shape, spec.shape)) if a != b]
    if t.dim() != len(spec.shape) or len(diff) != 1:
        raise BundleError(f"state {spec.name}: cannot carry shape {list(t.shape)} to {list(spec.shape)} "
                          "(only one capacity-dependent dimension may differ)")
    d = diff[0]
    if spec.shape[d] < t.shape[d]:
        return t.narrow(d, 0, spec.shape[d]).contiguous()
    out = torch.full(spec.shape, fill, dtype=t.dtype)
    out.narrow(d, 0, t.shape[d]).copy_(t)
    return out


def make_engram_hasher(params: dict):
    """The host-side n-gram hasher for the manifest's engram parameters."""
    from dsneuron.kernels_nki.engram_hash import NgramHasher

    try:
        return NgramHasher(params)
    except (TypeError, ValueError) as e:  # TypeError: a value of the wrong JSON type
        raise BundleError(f"manifest host_preprocessing.engram: {e}") from None


def executable_factory(bundle: Bundle) -> ExecutableFactory:
    """The maker of `bundle`'s one-file executables, by target: AOTInductor packages for cpu, XLA:CPU
    for a StableHLO-only neuron bundle (a check of the neuron path), NEFFs otherwise (checked for
    this host here). Raises BundleError naming the first problem."""
    m = bundle.manifest
    if m.target == "cpu":
        register_custom_ops(m.compiler.get("custom_ops", {}))
        return CpuExecutable
    if is_stablehlo(m):
        from ..executors.executor_stablehlo import StableHloExecutable

        return StableHloExecutable
    from ..executors.executor_neuron import NeuronExecutor  # open_bundle admits only known targets

    return NeuronExecutor(bundle.root, m)


class Runner:
    """A verified bundle's executables (loaded on first use) and its state rows. Build with
    `Runner.load(path)` or `Runner(bundle)`. Raises BundleError when the manifest's engram
    parameters are missing or disagree with the executables."""

    def __init__(self, bundle: Bundle):
        m = bundle.manifest
        self.bundle = bundle
        self.manifest = m
        #: (path, bucket, weights) -> the bucket's executable, for unstaged buckets
        self.make_executable = executable_factory(bundle)
        self.weights = bundle.load_weights()
        self.fills: dict[str, StateEntry] = {s.name: s for s in m.state}
        self._buckets = {(b.kind, b.batch, b.length): b for b in m.buckets}
        self._loaded: dict[tuple[str, int, int], Executable] = {}
        #: seconds spent loading executables, summed since construction
        self.load_seconds = 0.0
        #: every prefill runs one prompt, at the smallest batch bucket (rows past 0 are filler)
        self.prefill_batch = select.pick_batch(sorted({b.batch for b in m.buckets if b.kind == "prefill"}), 1)
        self.decode_batches = sorted({b.batch for b in m.buckets if b.kind == "decode"})
        self.max_capacity = max(b.capacity for b in m.buckets if b.kind == "decode")
        self.pad_token_id = m.tokenizer.pad_token_id
        cols = {tuple(s.shape[2:]) for b in m.buckets for s in b.inputs if s.name == "engram_ids"}
        takes_engram = max(cols, default=(0, 0))[0] > 0
        params = m.host_preprocessing.get("engram")
        if takes_engram and not params:
            raise BundleError("manifest host_preprocessing.engram: the executables take engram ids but the "
                              "manifest carries no hashing parameters")
        self.hasher = make_engram_hasher(params) if takes_engram else None
        # schema.py checks every bucket agrees (a draft bucket's first output is its tokens)
        self.vocab_size = vocab = next(b for b in m.buckets if b.kind == "prefill").outputs[0].shape[1]
        if self.hasher is not None and self.hasher.vocab_size != vocab:
            raise BundleError(f"manifest host_preprocessing.engram.token_map: maps {self.hasher.vocab_size} token ids, "
                              f"the model's vocabulary has {vocab}")

    @classmethod
    def load(cls, path: str | Path, verify_key: str | Path | None = None,
             shard: tuple[int, int, int] | None = None) -> "Runner":
        """Open and verify the bundle at `path` (runtime_min/bundle/bundle.py; with `verify_key`, its
        signature too) and load its weights. shard: (tp, ep, rank) when this process is one rank of
        a sharded bundle (runtime_min/sharded.py). Raises BundleError naming the first problem."""
        return cls(open_bundle(path, verify_key, shard=shard))

    # ------------------------------------------------------------------ buckets
    def lengths(self, kind: str, batch: int) -> list[int]:
        """The lengths (prefill: seq_len; decode, chunk: capacity) of the `kind` buckets of `batch`, ascending."""
        return sorted(length for (k, b, length) in self._buckets if k == kind and b == batch)

    def _lengths_of(self, kind: str, batch: int) -> list[int]:
        """`lengths`, ValueError naming the batches there are when there is none."""
        lengths = self.lengths(kind, batch)
        if not lengths:
            have = sorted({b for (k, b, _) in self._buckets if k == kind})
            raise ValueError(f"no {kind} bucket of batch {batch}; the bundle's {kind} batches: {have}")
        return lengths

    def bucket(self, kind: str, batch: int, length: int) -> Bucket:
        """The manifest's bucket; ValueError naming the buckets of that kind when there is none."""
        try:
            return self._buckets[(kind, batch, length)]
        except KeyError:
            have = sorted((b, n) for (k, b, n) in self._buckets if k == kind)
            raise ValueError(f"no {kind} bucket of batch {batch} and length {length}; the bundle's {kind} buckets "
                             f"(batch, length): {have}") from None

    def executable(self, kind: str, batch: int, length: int) -> Executable:
        """The bucket's executable, loaded on first use (staged buckets stage by stage, executor_cpu.py).
        Raises ValueError as `bucket`, BundleError when the executable cannot be loaded."""
        key = (kind, batch, length)
        if key not in self._loaded:
            b = self.bucket(kind, batch, length)
            t0 = time.perf_counter()
            if b.stages:
                self._loaded[key] = StagedExecutable(self.bundle.root, b, self.weights)
            else:
                self._loaded[key] = self.make_executable(self.bundle.root / b.file, b, [self.weights[n] for n in b.weights])
            self.load_seconds += time.perf_counter() - t0
        return self._loaded[key]

    def stage_timers(self) -> dict[tuple[str, int, int], dict[str, float]]:
        """Time the stages of every staged executable loaded so far: {(kind, batch, length): the
        dict its runs from now on add each stage's wall seconds to, by stage name}
        (StagedExecutable.stage_seconds; the benchmark's per-stage tables)."""
        out = {}
        for key, exe in self._loaded.items():
            if isinstance(exe, StagedExecutable):
                exe.stage_seconds = out[key] = {}
        return out

    def check_prompt_length(self, n_tokens: int) -> None:
        """Raise UserError naming the limit unless `prefill_job` runs a prompt of n_tokens tokens: up
        to the largest prefill bucket in one call, or, in a bundle with chunk buckets, up to the
        largest capacity they continue (the chunked prefill's limit, the context capacity)."""
        batch = self.prefill_batch
        lengths = self.lengths("prefill", batch)
        if n_tokens <= max(lengths) or not self.lengths("chunk", batch):
            select.pick_prefill(lengths, n_tokens)
            return
        select.pick_chunk_capacity(self.lengths("chunk", batch), n_tokens)

    def needs_chunks(self, n_tokens: int) -> bool:
        """Whether a prompt of n_tokens is past the largest prefill bucket (`prefill_job` runs it in chunks)."""
        return n_tokens > max(self.lengths("prefill", self.prefill_batch))

    def prefill_label(self, n_tokens: int) -> str:
        """The buckets a prompt of n_tokens runs at, for people: "b<batch> s<seq_len>", plus the chunk
        capacity of a chunked prefill. Raises UserError as `check_prompt_length`."""
        batch = self.prefill_batch
        lengths = self.lengths("prefill", batch)
        if n_tokens <= max(lengths):
            return f"b{batch} s{select.pick_prefill(lengths, n_tokens)}"
        return (f"b{batch} s{max(lengths)} + chunks at capacity "
                f"{select.pick_chunk_capacity(self.lengths('chunk', batch), n_tokens)}")

    # ------------------------------------------------------------------ calls
    def prefill(self, prompts: Sequence[Sequence[int]], batch: int | None = None) -> Step:
        """One prefill call: prompt i (token ids) in row i, right-padded to the smallest prefill
        bucket of `batch` (default `prefill_batch`) holding the longest (for a bucket with a token
        range, to `Bucket.padded_len`); rows past the prompts are filler. Engram history starts
        fresh. Raises UserError when the longest prompt exceeds the largest prefill bucket,
        ValueError for an empty prompt, more prompts than rows or a batch without prefill buckets."""
        batch = self.prefill_batch if batch is None else batch
        prompts = [list(p) for p in prompts]
        longest = max(len(p) for p in prompts)
        exe = self.executable("prefill", batch, select.pick_prefill(self._lengths_of("prefill", batch), longest))
        tokens, valid = select.pad_prompts(prompts, batch, exe.bucket.padded_len(longest), self.pad_token_id)
        engram, history = self._hash(tokens, self.fresh_state(batch).history, valid)
        return self._call(exe, {"tokens": tokens, "valid_len": valid, "engram_ids": engram}, State(), history)

    def prefill_job(self, ids: Sequence[int], chunk: int | None = None,
                    prefix: tuple[int, Snapshot] | None = None) -> PrefillJob:
        """The prefill of one prompt in row 0 at `prefill_batch`, as a `PrefillJob` of one executable
        call at a time: right-padded to the smallest prefill bucket holding it, one call; a prompt
        longer than the largest prefill bucket P (or any prompt, given `chunk`), in a bundle with
        chunk buckets, as a chunked prefill: its first P (chunk) tokens in a prefill bucket, then
        `chunk` calls of up to P (chunk) tokens at the smallest chunk capacity holding the prompt.
        prefix: (n, the snapshot of `snapshot` after ids[:n]), 1 <= n < len(ids): the prompt
        starts from a copy of it and only ids[n:] run (`_resume`). Raises UserError as
        `check_prompt_length`, or when `chunk` is given and the bundle has no chunk bucket;
        ValueError for a prefix outside 1..len(ids)-1, and (at a call) for a chunk length the
        buckets do not take."""
        ids = list(ids)
        self.check_prompt_length(len(ids))
        batch = self.prefill_batch
        lengths = self.lengths("prefill", batch)
        if prefix is not None:
            n, snap = prefix
            if not 1 <= n < len(ids):
                raise ValueError(f"prefill_job: a prefix of {n} tokens of a {len(ids)}-token prompt; must be 1..{len(ids) - 1}")
            return PrefillJob(self._resume(ids, n, snap), len(ids), started=n)
        if chunk is None and len(ids) <= max(lengths):
            return PrefillJob(self._calls(ids, len(ids), 0), len(ids))
        if not self.lengths("chunk", batch):
            raise UserError(f"this bundle has no chunk bucket of batch {batch} (compile with compile.chunked_prefill "
                            "and a decode capacity above the largest prefill length)")
        capacity = select.pick_chunk_capacity(self.lengths("chunk", batch), len(ids))
        return PrefillJob(self._calls(ids, chunk or max(lengths), capacity), len(ids))

    def _calls(self, ids: list[int], chunk: int, capacity: int) -> Generator[tuple[int, Step], None, Step]:
        """`prefill_job`'s calls: yields (tokens fed, Step) after each but the last, returns the last one's Step."""
        step = self.prefill([ids[:chunk]])
        for p in range(chunk, len(ids), chunk):
            yield p, step
            step = self.chunk(ids[p:p + chunk], p, step.state, capacity)
        return step

    def _resume(self, ids: list[int], n: int, snap: Snapshot) -> Generator[tuple[int, Step], None, Step]:
        """ids[n:] after a copy of `snap` (the state after ids[:n]): chunk calls of up to the chunk
        bucket's length at the smallest chunk capacity holding the prompt; in a bundle without
        chunk buckets, one decode call per token (the same numerics: graphs/steps.py prefill_chunk
        is that many decode steps composed, tests/test_model.py). Bit-identical to the prompt's
        own prefill, as a state row after a token is the same whichever steps produced it."""
        batch = self.prefill_batch
        state = self.fit_rows(self.restore(snap), batch)
        caps = self.lengths("chunk", batch)
        if caps:
            capacity = select.pick_chunk_capacity(caps, len(ids))
            size = self.bucket("chunk", batch, capacity).seq_len
            for p in range(n, len(ids), size):
                step = self.chunk(ids[p:p + size], p, state, capacity)
                if p + size >= len(ids):
                    return step
                state = step.state
                yield p + size, step
        dbatch = min(self.decode_batches)
        state = self.fit_rows(state, dbatch)
        for p in range(n, len(ids)):
            tokens = torch.full((dbatch,), self.pad_token_id, dtype=torch.int64)
            pos = torch.zeros(dbatch, dtype=torch.int64)
            tokens[0], pos[0] = ids[p], p
            step = self.decode(tokens, pos, state)
            if p + 1 == len(ids):
                return step
            state = step.state
            if (p + 1 - n) % 64 == 0:  # a scheduler's decode steps run in between every 64 tokens
                yield p + 1, step

    def chunk(self, ids: Sequence[int], start: int, state: State, capacity: int) -> Step:
        """The chunk bucket of `prefill_batch` and `capacity` on the tokens `ids` of the prompt in
        row 0, at positions start.., continuing `state` (its prefill's, or the previous chunk's);
        the tokens are right-padded to the bucket's length. Raises ValueError for a bucket that is
        not in the bundle or a chunk length it does not take."""
        batch = self.prefill_batch
        exe = self.executable("chunk", batch, capacity)
        ids = list(ids)
        tokens, valid = select.pad_prompts([ids], batch, exe.bucket.padded_len(len(ids)), self.pad_token_id)
        pos = torch.zeros(batch, dtype=torch.int64)
        pos[0] = start
        engram, history = self._hash(tokens, state.history, valid)
        return self._call(exe, {"tokens": tokens, "pos": pos, "valid_len": valid, "engram_ids": engram}, state, history)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, state: State) -> Step:
        """One decode step of B rows: row i feeds tokens[i] (int64 [B]) at position positions[i]
        (int64 [B]) on its row of `state` (B rows, any capacity; its history [B, H] when the bundle
        hashes engram ids), at the decode bucket of batch B and the smallest capacity holding every
        position. Rows a caller does not use still run (feed them a pad token at position 0).
        Raises ValueError when no decode bucket has batch B or the history is missing, UserError
        when a position is past the context capacity."""
        batch = tokens.size(0)
        feed = tokens.reshape(batch, 1)
        if self.hasher is not None and state.history is None:
            raise ValueError("decode: this bundle hashes engram ids; the state needs its history [B, H]")
        engram, history = self._hash(feed, state.history)
        exe = self.executable("decode", batch,
                              select.pick_capacity(self._lengths_of("decode", batch), int(positions.max()) + 1))
        return self._call(exe, {"tokens": feed, "pos": positions, "engram_ids": engram}, state, history)

    # ------------------------------------------------------------------ speculative decoding
    def verify(self, tokens: torch.Tensor, pos: torch.Tensor, count: torch.Tensor, state: State,
               target_layers: Sequence[int], taps: bool = True):
        """A speculative verify (runtime_min/core/speculative.py): row b feeds tokens[b, :count[b]]
        (int64 [B, S], count int64 [B] in 1..S) at positions pos[b].. on its row of `state`, as one
        call at the smallest capacity holding every row: of the verify bucket of batch B where the
        bundle has one (the neuron target's returns both reads itself; the cpu target's, staged,
        returns the logits and is tapped for main_hidden), else of the staged chunk bucket of batch
        B, tapped, its logits through the widest decode bucket's head (`_position_logits`). Each is
        bit-identical in state to that many decode steps of its target. Returns a
        speculative.Verified with the logits fp32 [B, S, V] at every position and main_hidden bf16
        [B, S, T*D] (the stream entering each target layer's attention, averaged over its hc
        copies); taps=False skips both (a replay).
        Raises ValueError for rows outside that contract (`check_verify_args`), more tokens a row
        than the verify bucket takes, or no target layer when tapped; BundleError when the chunk
        bucket is not staged and there is no verify bucket; ValueError without a bucket of batch B;
        UserError past the context capacity."""
        from .speculative import Verified

        check_verify_args(tokens, pos, count)
        if taps and not target_layers:
            raise ValueError("verify: target_layers must name at least one layer (the drafter's dspark_target_layer_ids)")
        B, S = tokens.shape
        if self.hasher is not None and state.history is None:
            raise ValueError("verify: this bundle hashes engram ids; the state needs its history [B, H]")
        kind = "verify" if self.lengths("verify", B) else "chunk"
        capacity = select.pick_chunk_capacity(self._lengths_of(kind, B), int((pos + count).max()))
        exe = self.executable(kind, B, capacity)
        if kind == "verify" and S > exe.bucket.seq_len:
            raise ValueError(f"verify: {S} tokens a row; the verify bucket takes {exe.bucket.seq_len} "
                             "(1 + the drafter's block, compile --speculative)")
        padded = torch.full((B, exe.bucket.padded_len(S)), self.pad_token_id, dtype=torch.int64)
        padded[:, :S] = tokens
        engram, history = self._hash(padded, state.history, count)
        data = {"tokens": padded, "pos": pos, "valid_len": count, "engram_ids": engram}
        staged = isinstance(exe, StagedExecutable)
        if kind == "verify" and not staged:
            step = self._call(exe, data, state, history)
            logits, hidden = (step.logits[:, :S], step.main_hidden[:, :S]) if taps else (None, None)
        elif kind == "verify":  # a replay reads no logits: its head (every position's) is skipped
            step = self._call(exe, data, state, history, self._taps(exe, target_layers, head=False) if taps else (),
                              skip=() if taps else ("head",))
            logits, hidden = (step.logits[:, :S], self._tapped_hidden(step, S, target_layers)) if taps else (None, None)
        else:
            # the chunk's own head reads one position a row; the taps give every position's
            step = self._call(exe, data, state, history, self._taps(exe, target_layers) if taps else (),
                              skip=("head",) if staged else ())
            logits, hidden = self._tapped_outputs(exe, step, S, target_layers) if taps else (None, None)
        return Verified(logits, hidden, step.state, tokens, pos, count, State(step.state_in, state.history),
                        step.seconds)

    def can_tap_prefill(self, batch: int) -> bool:
        """Whether `verify_prefill` gives main_hidden to seed the drafter with for `batch` rows:
        the cpu target's staged prefill buckets, tapped at every prompt position, or a prefill
        bucket returning it at each prompt's last positions (a speculative compile's neuron
        prefill); else it runs the plain prefill and gives none."""
        lengths = self.lengths("prefill", batch)
        if not lengths:
            return False
        b = self.bucket("prefill", batch, lengths[0])
        return bool(b.stages) or any(o.name == MAIN_HIDDEN for o in b.outputs)

    def verify_prefill(self, prompts: Sequence[Sequence[int]], target_layers: Sequence[int]):
        """`prefill` of the prompts in rows 0.., at the prefill bucket of batch len(prompts): a
        speculative.Verified with the logits fp32 [B, V] after each prompt (the call's own head:
        the loop reads only those) and, tapped as `verify` is, main_hidden bf16 [B, S, T*D] at every
        prompt position (count: the prompt lengths). Where the prefill bucket is one graph, its own
        main_hidden output, each prompt's last W positions (hidden_pos: where they start), or
        without one (`can_tap_prefill`) none: the drafter then starts without its prompt's ring.
        One prompt longer than the largest prefill bucket runs as chunks (`prefill_job`), without
        main_hidden, as the scheduler runs it. Raises as `prefill`."""
        from .speculative import Verified

        batch = len(prompts)
        prompts = [list(p) for p in prompts]
        longest = max(len(p) for p in prompts)
        lengths = self.lengths("prefill", batch)
        if batch == 1 and self.needs_chunks(longest):
            step = self.prefill_job(prompts[0]).run()
            return Verified(step.logits[:1], None, self.fit_rows(step.state, 1), torch.tensor([prompts[0]]),
                            torch.zeros(1, dtype=torch.int64), torch.tensor([longest]), None, step.seconds)
        if not (lengths and self.bucket("prefill", batch, lengths[0]).stages):
            step = self.prefill(prompts, batch)
            tokens, valid = select.pad_prompts(prompts, batch, longest, self.pad_token_id)
            hidden = step.main_hidden
            start = None if hidden is None else (valid - hidden.size(1)).clamp(min=0)
            return Verified(step.logits, hidden, step.state, tokens, torch.zeros(batch, dtype=torch.int64), valid, None,
                            step.seconds, hidden_pos=start)
        exe = self.executable("prefill", batch, select.pick_prefill(self._lengths_of("prefill", batch), longest))
        tokens, valid = select.pad_prompts(prompts, batch, exe.bucket.padded_len(longest), self.pad_token_id)
        engram, history = self._hash(tokens, self.fresh_state(batch).history, valid)
        step = self._call(exe, {"tokens": tokens, "valid_len": valid, "engram_ids": engram}, State(), history,
                          self._taps(exe, target_layers, head=False))
        hidden = self._tapped_hidden(step, longest, target_layers)
        return Verified(step.logits, hidden, step.state, tokens[:, :longest], torch.zeros(batch, dtype=torch.int64),
                        valid, None, step.seconds)

    @staticmethod
    def _taps(exe: Executable, target_layers: Sequence[int], head: bool = True) -> tuple[str, ...]:
        """The stages whose inputs a tapped call keeps: the target layers' attention (main_hidden)
        and, with head, the head (the logits at every position)."""
        if not isinstance(exe, StagedExecutable):
            raise BundleError(f"{exe.bucket.kind} bucket b{exe.bucket.batch} {exe.bucket.length}: speculative decoding "
                              "reads the head's and the target layers' inputs, which only a staged (cpu target) bucket gives")
        return (*(f"layers.{L}.attn" for L in target_layers), *(("head",) if head else ()))

    def _tapped_outputs(self, exe: "StagedExecutable", step: Step, S: int, target_layers: Sequence[int]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits fp32 [B, S, V], main_hidden bf16 [B, S, T*D]) of a tapped call's first S positions."""
        return self._position_logits(exe, step.taps["head"], S), self._tapped_hidden(step, S, target_layers)

    @staticmethod
    def _tapped_hidden(step: Step, S: int, target_layers: Sequence[int]) -> torch.Tensor:
        """main_hidden bf16 [B, S, T*D] of a tapped call's first S positions."""
        from dsneuron.kernels_nki.hc_mean import main_hidden_of

        return torch.cat([main_hidden_of(step.taps[f"layers.{L}.attn"]["h"][:, :S]) for L in target_layers], dim=-1)

    def _position_logits(self, exe: "StagedExecutable", head: dict[str, torch.Tensor], S: int) -> torch.Tensor:
        """Logits fp32 [B, S, V] at positions 0..S-1 of every row of a call whose head stage was
        given `head` (h bf16 [B, Sp, hc, D], pre_mix fp32 [B, Sp, hc]). The head stage reads one
        position a row, so the B * S positions go, as rows of one token each, through the head stage
        of the staged decode bucket with the most rows (G): one read of the head's weight per G
        positions instead of per position (the weight dominates: tiny's is 265 MB). A row's logits do
        not depend on its batch bucket or its neighbours (the kernels' batch invariance, what the
        scheduler's same-text-as-alone rests on), so they are the bits of the call's own head at
        each position, which is what runs, once per position, when no decode bucket has G >= 2."""
        h, mix = head["h"], head["pre_mix"]
        B = h.size(0)
        batches = [g for g in self.decode_batches if self._buckets[("decode", g, self.lengths("decode", g)[0])].stages]
        G = max(batches, default=1)
        if G < 2 or B * S < 2:
            return torch.stack([exe.run_stage("head", {**head, "last": torch.full((B,), j, dtype=torch.int64)})[0]
                                for j in range(S)], dim=1)
        wide = self.executable("decode", G, self.lengths("decode", G)[0])
        rows_h = h[:, :S].reshape(B * S, 1, *h.shape[2:])
        rows_mix = mix[:, :S].reshape(B * S, 1, mix.size(2))
        out = []
        for i in range(0, B * S, G):
            n = min(G, B * S - i)
            # a last group's spare rows repeat its first position; their logits are dropped
            take = torch.tensor([*range(i, i + n), *[i] * (G - n)])
            got = wide.run_stage("head", {"h": rows_h[take].contiguous(), "pre_mix": rows_mix[take].contiguous(),
                                          "last": torch.zeros(G, dtype=torch.int64)})[0]
            out.append(got[:n])
        return torch.cat(out).view(B, S, -1)

    def _hash(self, tokens: torch.Tensor, history: torch.Tensor | None, valid: torch.Tensor | None = None
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(engram ids, the next history) of `tokens` after `history`; (None, None) without engram."""
        if self.hasher is None:
            return None, None
        return self.hasher.hash(tokens, history, valid)

    def _call(self, exe: Executable, data: dict[str, torch.Tensor | None], state: State,
              history: torch.Tensor | None, taps: Sequence[str] = (), skip: Sequence[str] = ()) -> Step:
        """Run `exe` on the data inputs and `state` (resized to its bucket, missing tensors fresh);
        taps: stage names whose inputs to keep, skip: stages not to run (their outputs None; a
        StagedExecutable's run_tapped)."""
        b = exe.bucket
        state_in = self._state_for(b, state.tensors)
        args = []
        for spec in b.inputs:
            if spec.name == "engram_ids" and data.get("engram_ids") is None:
                shape = (spec.shape[0], data["tokens"].shape[1], *spec.shape[2:])
                args.append(torch.zeros(shape, dtype=torch.int64))  # E = 0: an empty tensor
            elif spec.name in DATA_INPUTS:
                args.append(data[spec.name].contiguous())
            else:
                args.append(state_in[spec.name])
        t0 = time.perf_counter()
        tapped: dict[str, dict[str, torch.Tensor]] = {}
        if taps or skip:
            outs, tapped = exe.run_tapped(args, taps, skip)
        else:
            outs = exe.run(args)
        seconds = time.perf_counter() - t0
        tensors = {spec.name: t for spec, t in zip(b.outputs[1:], outs[1:])
                   if not spec.name.startswith(PROBE_PREFIX) and spec.name != MAIN_HIDDEN}
        probes = {spec.name[len(PROBE_PREFIX):]: t for spec, t in zip(b.outputs, outs) if spec.name.startswith(PROBE_PREFIX)}
        hidden = next((t for spec, t in zip(b.outputs, outs) if spec.name == MAIN_HIDDEN), None)
        return Step(outs[0], State(tensors, history), probes, state_in, seconds, b, tapped, hidden)

    def _state_for(self, bucket: Bucket, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state inputs of `bucket`: carried over (resized to its capacity) or fresh."""
        out = {}
        for spec in bucket.inputs:
            if spec.name in DATA_INPUTS:
                continue
            if spec.name not in self.fills:
                raise BundleError(f"{bucket.file}: input {spec.name} is neither a data input nor a state tensor of the manifest")
            fill = self.fills[spec.name].fill
            out[spec.name] = (resize_state(state[spec.name], spec, fill) if spec.name in state
                              else torch.full(spec.shape, fill, dtype=spec.torch_dtype))
        return out

    # ------------------------------------------------------------------ rows
    def fresh_state(self, batch: int) -> State:
        """The state of `batch` rows before any token: no tensors (each call starts them at their
        fill values) and the engram history's initial rows (None without engram)."""
        return State({}, None if self.hasher is None else self.hasher.initial_history(batch))

    def fit_rows(self, state: State, batch: int) -> State:
        """`state` at exactly `batch` rows: trailing rows dropped, or fill rows appended."""
        tensors = {k: v[:batch] if v.shape[0] >= batch else _grow(v, (batch, *v.shape[1:]), self.fills[k].fill)
                   for k, v in state.tensors.items()}
        h = state.history
        if h is not None:
            h = h[:batch] if h.shape[0] >= batch else _grow(h, (batch, h.shape[1]), self.hasher.pad_id)
        return State(tensors, h)

    def place_row(self, state: State, row: int, src: State, rows: int) -> State:
        """`state` (rows 0..row-1 in use) with row 0 of `src` (a prefill's) copied into row `row`, at
        least `rows` rows. row 0 starts anew: src's row 0 then fill rows, `state` unused. Otherwise
        the tensors of `state` are grown in place where needed: where the two sit at different
        capacities, both go to the larger (growing appends fill rows, schema.py)."""
        if row == 0:
            tensors = {k: _grow(v[:1], (rows, *v.shape[1:]), self.fills[k].fill) for k, v in src.tensors.items()}
            h = src.history
            return State(tensors, None if h is None else _grow(h[:1], (rows, h.shape[1]), self.hasher.pad_id))
        tensors = dict(state.tensors)
        for k, v in src.tensors.items():
            cur = tensors[k]
            shape = (max(rows, cur.shape[0]), *(max(a, b) for a, b in zip(cur.shape[1:], v.shape[1:])))
            cur = tensors[k] = _grow(cur, shape, self.fills[k].fill)
            cur[row].copy_(_grow(v[:1], (1, *shape[1:]), self.fills[k].fill)[0])
        h = state.history
        if src.history is not None:
            h = _grow(h, (max(rows, h.shape[0]), src.history.shape[1]), self.hasher.pad_id)
            h[row].copy_(src.history[0])
        return State(tensors, h)

    def snapshot(self, state: State, row: int, logits: torch.Tensor | None = None) -> Snapshot:
        """A copy of row `row` of `state` (every state tensor [1, ...] at its capacity, the engram
        history [1, H]) and of `logits` (fp32 [B, V] of the call that fed the row's last token, or
        None), for the prefix cache (runtime_min/core/prefix_cache.py): the state after the tokens that
        row was fed. A copy, so the row may go on running."""
        h = state.history
        return Snapshot({k: v[row:row + 1].clone() for k, v in state.tensors.items()},
                        None if h is None else h[row:row + 1].clone(),
                        None if logits is None else logits[row].clone())

    def restore(self, snap: Snapshot) -> State:
        """A one-row State from a copy of `snap` (the cache keeps its own tensors unchanged)."""
        h = snap.engram_history
        return State({k: v.clone() for k, v in snap.state.items()}, None if h is None else h.clone())

    def move_row(self, state: State, dst: int, src: int) -> None:
        """Copy row `src` of `state` into row `dst`, in place (a freed row taken by the last one)."""
        for v in state.tensors.values():
            v[dst].copy_(v[src])
        if state.history is not None:
            state.history[dst].copy_(state.history[src])


def check_verify_args(tokens: torch.Tensor, pos: torch.Tensor, count: torch.Tensor) -> None:
    """Runner.verify's contract on its rows, a ValueError naming the first breach: tokens [B, S]
    with B, S >= 1, pos and count [B], pos >= 0, count in 1..S."""
    if tokens.dim() != 2 or tokens.size(1) < 1 or tokens.size(0) < 1:
        raise ValueError(f"verify: tokens must be [B, S] with B, S >= 1, got shape {tuple(tokens.shape)}")
    B, S = tokens.shape
    if tuple(pos.shape) != (B,) or tuple(count.shape) != (B,):
        raise ValueError(f"verify: pos and count must be [B] = [{B}], got {tuple(pos.shape)} and {tuple(count.shape)}")
    if int(pos.min()) < 0:
        raise ValueError(f"verify: pos must be >= 0, got {pos.tolist()}")
    if int(count.min()) < 1 or int(count.max()) > S:
        raise ValueError(f"verify: count must lie in 1..S = 1..{S}, got {count.tolist()}")


def _grow(t: torch.Tensor, shape: Sequence[int], fill: float) -> torch.Tensor:
    """`t` in a tensor of `shape` (every dimension >= t's), the rest `fill`; `t` itself if equal.
    Growing a capacity dimension appends unused rows, as schema.py's state rule allows."""
    if tuple(t.shape) == tuple(shape):
        return t
    out = torch.full(tuple(shape), fill, dtype=t.dtype)
    out[tuple(slice(0, d) for d in t.shape)] = t
    return out
