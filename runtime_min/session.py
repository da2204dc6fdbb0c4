"""Generation from a verified bundle: the Python API behind `dsneuron run`.

    session = Session.load("artifacts/")
    text = session.generate("Hello", max_new_tokens=32)                       # greedy
    texts = session.generate(["a", "b"], 32, temperature=0.8, top_p=0.9, seed=1, stream=print_piece)

Lifecycle per call: tokenize (bundle tokenizer, BOS per manifest) -> one request per prompt
through the scheduler (runtime_min/scheduler.py, the one decode loop, shared with `dsneuron
serve`): each prompt's prefill at the smallest batch bucket, right-padded to its prefill bucket
(first-fit, runtime_min/select.py), or, for a prompt past the largest prefill bucket in a bundle
with chunk buckets, a chunked prefill (`Session.prefill`: its first chunk a prefill, the others
chunk buckets continuing the state with the numerics of decode steps), engram ids on the host
from the manifest's parameters, state
starting as the manifest's fill values when the prefill takes state inputs -> sample -> decode one
token per active row per step at the smallest batch bucket holding the rows, each row at its own
position, at the smallest decode capacity holding the positions in use, resizing the state
between capacities (schema.py: append fill rows to grow, drop unused trailing rows to shrink) ->
stop a row at EOS (not part of its text) or max_new_tokens. Any number of prompts: those past the
largest batch bucket wait for a free row, and each prompt's output is what it gets alone.

Prompt limit, decided up front (`check_prompt_length`): the largest prefill bucket, or, where the
bundle has chunk buckets, the largest capacity they continue (the context capacity); the refusal
names the limit.

Context limit, decided up front: a prompt of L tokens may generate N tokens only when
L + N - 1 <= the largest decode capacity. The prefill holds positions 0..L-1 and its logits give the
first new token; each later token comes from a decode step that feeds the previous new token at
position L + k - 1 (k = 1..N-1), so the last step writes position L + N - 2 and the last new token
is sampled but never fed back. Otherwise the call is refused before any work with a UserError
naming the capacity (so no partial generation is cut off silently).

Streaming: `stream(row, piece)` gets each row's new text as it is generated. The whole generated
id list is decoded each time and the new suffix emitted, holding back a trailing U+FFFD (an
incomplete multi-byte character) until the bytes that complete it arrive; the pieces of a row
concatenate to its returned text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from dsneuron import UserError

from . import schema, select
from .bundle import Bundle, is_stablehlo, open_bundle
from .executor_cpu import CpuExecutable, StagedExecutable, register_custom_ops
from .sampling import check_params, check_seed
from .scheduler import GenerationStats, Request, Scheduler, check_context
from .schema import PROBE_PREFIX, Bucket, BundleError, StateEntry, TensorSpec

if TYPE_CHECKING:
    from .executor_neuron import NeuronExecutable

DATA_INPUTS = frozenset(n for names in schema.DATA_INPUTS.values() for n in names)


@dataclass
class StepResult:
    """One step of `Session.teacher_forced`: logits fp32 [V] of row 0, its stage probes (empty unless
    the bundle was compiled with probes; names without the prefix, batch row 0), the wall time in
    seconds of the executable call alone, and the state tensors the step was given (batch row 0 kept
    as a batch of 1, at the bucket's capacity; empty for the prefill)."""

    logits: torch.Tensor
    probes: dict[str, torch.Tensor]
    seconds: float
    state_in: dict[str, torch.Tensor]


def fresh_state(specs: Sequence[TensorSpec], fills: dict[str, StateEntry]) -> dict[str, torch.Tensor]:
    """State tensors of `specs`, each filled with its manifest fill value."""
    return {s.name: torch.full(s.shape, fills[s.name].fill, dtype=s.torch_dtype) for s in specs}


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
    from .engram_hash import NgramHasher

    try:
        return NgramHasher(params)
    except (TypeError, ValueError) as e:  # TypeError: a value of the wrong JSON type
        raise BundleError(f"manifest host_preprocessing.engram: {e}") from None


class PrefillJob:
    """One prompt's prefill, one executable call per `step` (Session.prefill_job): the scheduler
    runs a long prompt's chunks between the decode steps of the running requests.
    `step()` runs the next call and returns True when the prompt is done; `result` is then
    (logits [vocab] fp32, state {name: [batch, ...]} with the prompt in row 0, engram history
    [batch, H] int64 or None)."""

    def __init__(self, calls):
        # a prompt that fits a prefill bucket comes as its result (its one call ran already); a
        # chunked one as the generator of its calls (Session._chunks)
        self._calls = calls if not isinstance(calls, tuple) else None
        self.result = calls if isinstance(calls, tuple) else None

    def step(self) -> bool:
        if self.result is None:
            try:
                next(self._calls)
            except StopIteration as end:
                self.result = end.value
        return self.result is not None

    def run(self):
        """Every call left; returns `result`."""
        while not self.step():
            pass
        return self.result


class Session:
    """A loaded bundle ready to generate. Build with `Session.load(path)`."""

    def __init__(self, bundle: Bundle):
        m = bundle.manifest
        if m.target == "cpu":
            register_custom_ops(m.compiler.get("custom_ops", {}))
            self._make: Callable[..., CpuExecutable | NeuronExecutable] = CpuExecutable
        elif is_stablehlo(m):  # the neuron path's modules, run on XLA:CPU (a check)
            from .executor_stablehlo import StableHloExecutable

            self._make = StableHloExecutable
        else:  # open_bundle admits only known targets; the NEFFs are checked for this host here
            from .executor_neuron import NeuronExecutor

            self._make = NeuronExecutor(bundle.root, m)
        self.bundle = bundle
        self.manifest = m
        self.weights = bundle.load_weights()
        self.tokenizer = _load_tokenizer(bundle)
        self.fills = {s.name: s for s in m.state}
        self._buckets = {(b.kind, b.batch, b.length): b for b in m.buckets}
        self._loaded: dict[tuple[str, int, int], CpuExecutable | NeuronExecutable] = {}
        self.batch_sizes = sorted({b.batch for b in m.buckets if b.kind == "prefill"})
        #: every prefill runs one prompt, at the smallest batch bucket (rows past 0 are filler)
        self.prefill_batch = select.pick_batch(self.batch_sizes, 1)
        cols = {tuple(s.shape[2:]) for b in m.buckets for s in b.inputs if s.name == "engram_ids"}
        self.engram_cols = max(cols, default=(0, 0))
        params = m.host_preprocessing.get("engram")
        if self.engram_cols[0] > 0 and not params:
            raise BundleError("manifest host_preprocessing.engram: the executables take engram ids but the "
                              "manifest carries no hashing parameters")
        self.hasher = make_engram_hasher(params) if self.engram_cols[0] > 0 else None
        #: timings of the last `generate` call (GenerationStats), None before the first
        self.last_stats: GenerationStats | None = None
        self.vocab_size = vocab = m.buckets[0].outputs[0].shape[1]  # schema.py checks every bucket agrees
        if self.hasher is not None and self.hasher.vocab_size != vocab:
            raise BundleError(f"manifest host_preprocessing.engram.token_map: maps {self.hasher.vocab_size} token ids, "
                              f"the model's vocabulary has {vocab}")

    @classmethod
    def load(cls, path: str | Path, verify_key: str | Path | None = None,
             shard: tuple[int, int, int] | None = None) -> "Session":
        """Open and verify the bundle at `path` (runtime_min/bundle.py; with `verify_key`, its
        signature too), load weights and tokenizer. Executables load on first use. shard: (tp, ep,
        rank) when this process is one rank of a sharded bundle (runtime_min/sharded.py). Raises
        BundleError naming the first problem."""
        return cls(open_bundle(path, verify_key, shard=shard))

    # ------------------------------------------------------------------ buckets
    def _lengths(self, kind: str, batch: int) -> list[int]:
        return sorted(length for (k, b, length) in self._buckets if k == kind and b == batch)

    def _executable(self, kind: str, batch: int, length: int) -> CpuExecutable | NeuronExecutable:
        key = (kind, batch, length)
        if key not in self._loaded:
            t0 = time.perf_counter()
            b = self._buckets[key]
            if b.stages:
                self._loaded[key] = StagedExecutable(self.bundle.root, b, self.weights)
            else:
                self._loaded[key] = self._make(self.bundle.root / b.file, b, [self.weights[n] for n in b.weights])
            if self.last_stats is not None:
                self.last_stats.load_s += time.perf_counter() - t0
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

    @property
    def max_capacity(self) -> int:
        return max(b.capacity for b in self.manifest.buckets if b.kind == "decode")

    # ------------------------------------------------------------------ generation
    def encode(self, prompt: str, index: int = 0) -> list[int]:
        """Token ids of one prompt (BOS first when the manifest says so); UserError if empty."""
        if not isinstance(prompt, str) or prompt == "":
            raise UserError(f"prompt {index} is empty; a prompt needs at least one character")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # e.g. undecodable command-line bytes, kept as surrogates
            raise UserError(f"prompt {index} is not valid UTF-8 text (character {e.start})") from None
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        return ([self.manifest.tokenizer.bos_token_id] if self.manifest.tokenizer.add_bos else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens (EOS, role markers) left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None,
                 stream: Callable[[int, str], None] | None = None) -> str | list[str]:
        """Generate up to `max_new_tokens` per prompt; returns one text per prompt (a str for a str),
        in prompt order. Any number of prompts (module docstring); each one's output is the one it
        gets alone.

        temperature 0 is greedy; otherwise temperature/top-p sampling, each prompt from its own
        torch.Generator seeded with `seed` (fresh entropy when None). `stream(index, piece)`
        receives a prompt's text as it is final. Raises UserError naming the limit for an empty
        prompt, a prompt `check_prompt_length` refuses, prompt + max_new_tokens - 1
        beyond the context capacity (`check_context`), a seed outside 0..2**64-1 or bad sampling
        values (runtime_min/sampling.py).
        """
        single = isinstance(prompts, str)
        ids = self.generate_ids([prompts] if single else list(prompts), max_new_tokens, temperature, top_p, seed, stream)
        texts = [self.decode(g) for g in ids]
        return texts[0] if single else texts

    def generate_ids(self, prompts: Sequence[str], max_new_tokens: int = 64, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int | None = None,
                     stream: Callable[[int, str], None] | None = None) -> list[list[int]]:
        """As `generate`, returning the generated token ids per prompt (EOS excluded)."""
        if not prompts:
            raise UserError("no prompts given")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        check_params(temperature, top_p)
        check_seed(seed)
        start = time.perf_counter()
        ids = [self.encode(p, i) for i, p in enumerate(prompts)]
        batch = self.prefill_batch
        longest = max(len(x) for x in ids)
        for i, x in enumerate(ids):  # the one at fault named, among several
            try:
                self.check_prompt_length(len(x))
                check_context(len(x), max_new_tokens, self.max_capacity)
            except UserError as e:
                raise UserError(f"prompt {i}: {e}" if len(ids) > 1 else str(e)) from None
        lengths = self._lengths("prefill", batch)
        label = (f"b{batch} s{select.pick_prefill(lengths, longest)}" if longest <= max(lengths) else
                 f"b{batch} s{max(lengths)} + chunks at capacity "
                 f"{select.pick_chunk_capacity(self._lengths('chunk', batch), longest)}")
        self.last_stats = GenerationStats(longest, label, len(ids))
        scheduler = Scheduler(self, stats=self.last_stats)
        index: dict[str, int] = {}

        def listener(r: Request, piece: str) -> None:
            if piece and stream is not None:
                stream(index[r.id], piece)

        requests = [Request(x, max_new_tokens, temperature, top_p, seed, listener=listener) for x in ids]
        index.update({r.id: i for i, r in enumerate(requests)})
        for r in requests:
            scheduler.submit(r)
        scheduler.run()
        self.last_stats.first_token_s = min(r.first_token_at for r in requests) - start
        return [r.generated for r in requests]

    def teacher_forced(self, ids: Sequence[int], n_prompt: int) -> list[StepResult]:
        """Prefill ids[:n_prompt] at batch 1, then decode ids[n_prompt:] one token per step (teacher
        forcing: the given ids are fed whatever the logits say). Returns len(ids) - n_prompt + 1
        results: the prefill's (prediction after the prompt) and one per decoded id.
        Raises UserError when n_prompt is not in 1..len(ids), the prompt exceeds the largest prefill
        bucket, or len(ids) exceeds the context capacity.
        """
        ids = [int(t) for t in ids]
        self.last_stats = None  # timings are kept for generate calls only
        if not 1 <= n_prompt <= len(ids):
            raise UserError(f"n_prompt must be in 1..{len(ids)} (the sequence length), got {n_prompt}")
        if len(ids) > self.max_capacity:
            raise UserError(f"sequence of {len(ids)} tokens exceeds the context capacity of this bundle, "
                            f"{self.max_capacity} tokens (compile.decode_context_lens)")
        batch = self.prefill_batch
        seq_len = select.pick_prefill(self._lengths("prefill", batch), n_prompt)
        exe, args, history = self._prefill_call([ids[:n_prompt]], batch, seq_len)
        results, state = [], {}
        for p in range(n_prompt, len(ids) + 1):
            if p > n_prompt:
                feed = torch.full((batch, 1), self.manifest.tokenizer.pad_token_id, dtype=torch.int64)
                feed[0, 0] = ids[p - 1]
                pos = torch.zeros(batch, dtype=torch.int64)
                pos[0] = p - 1
                exe, args, history = self._decode_call(feed, pos, history, state)
            t0 = time.perf_counter()
            outs = exe.run(args)
            seconds = time.perf_counter() - t0
            state = self._collect(exe.bucket, outs)
            probes = {spec.name[len(PROBE_PREFIX):]: t[0] for spec, t in zip(exe.bucket.outputs, outs)
                      if spec.name.startswith(PROBE_PREFIX)}
            state_in = {spec.name: t[:1] for spec, t in zip(exe.bucket.inputs, args) if spec.name not in DATA_INPUTS}
            results.append(StepResult(outs[0][0], probes, seconds, state_in))
        return results

    def check_prompt_length(self, n_tokens: int) -> None:
        """Raise UserError naming the limit unless `prefill` runs a prompt of n_tokens tokens: up to
        the largest prefill bucket in one call, or, in a bundle with chunk buckets, up to the
        largest capacity they continue (the chunked prefill's limit, the context capacity)."""
        batch = self.prefill_batch
        lengths = self._lengths("prefill", batch)
        if n_tokens <= max(lengths) or not self._lengths("chunk", batch):
            select.pick_prefill(lengths, n_tokens)
            return
        select.pick_chunk_capacity(self._lengths("chunk", batch), n_tokens)

    def needs_chunks(self, n_tokens: int) -> bool:
        """Whether a prompt of n_tokens is past the largest prefill bucket (`prefill_job` runs it
        in chunks)."""
        return n_tokens > max(self._lengths("prefill", self.prefill_batch))

    def prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
        """The prefill of one prompt as it runs alone (`prefill_job`, run to its end). Returns
        (logits [vocab] fp32 after the prompt's last token, the state {name: [batch, ...]} whose
        row 0 is the prompt's, the engram history [batch, H] int64 or None). Raises UserError as
        `check_prompt_length`."""
        return self.prefill_job(ids).run()

    def chunked_prefill(self, ids: Sequence[int], chunk: int
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
        """`prefill` of one prompt in chunks of `chunk` tokens (`prefill_job`), whatever its length;
        a chunk must be a length the prefill and chunk buckets take. Raises UserError when the
        bundle has no chunk bucket or none holds the prompt, ValueError for a chunk length the
        buckets do not take."""
        return self.prefill_job(ids, chunk).run()

    def prefill_job(self, ids: Sequence[int], chunk: int | None = None) -> "PrefillJob":
        """The prefill of one prompt as it runs alone, at the smallest batch bucket, as a
        `PrefillJob` of one executable call at a time: right-padded to the smallest prefill bucket
        holding it, one call; a prompt longer than the largest prefill bucket P (or any prompt,
        given `chunk`), in a bundle with chunk buckets, as a chunked prefill: its first P (chunk)
        tokens in a prefill bucket, then chunks of up to P (chunk) tokens, each run at its chunk
        bucket's padded length and continuing the state at its start position (graphs/steps.py
        prefill_chunk: the numerics of that many decode steps), at the smallest chunk capacity
        holding the prompt; rows past 0 are filler. Raises UserError as `check_prompt_length`."""
        ids = list(ids)
        self.check_prompt_length(len(ids))
        batch = self.prefill_batch
        lengths = self._lengths("prefill", batch)
        if chunk is None and len(ids) <= max(lengths):
            return PrefillJob(self._one_shot(ids, batch, select.pick_prefill(lengths, len(ids))))
        if not self._lengths("chunk", batch):
            raise UserError(f"this bundle has no chunk bucket of batch {batch} (compile with compile.chunked_prefill "
                            "and a decode capacity above the largest prefill length)")
        capacity = select.pick_chunk_capacity(self._lengths("chunk", batch), len(ids))
        return PrefillJob(self._chunks(ids, batch, chunk or max(lengths), capacity))

    def _one_shot(self, ids: list[int], batch: int, seq_len: int):
        exe, args, history = self._prefill_call([ids], batch, seq_len)
        outs = exe.run(args)
        return outs[0][0], self._collect(exe.bucket, outs), history

    def _chunks(self, ids: list[int], batch: int, chunk: int, capacity: int):
        """Generator of `prefill_job`'s chunked calls: yields after each but the last, returns as `prefill`."""
        first = min(chunk, len(ids))
        exe, args, history = self._prefill_call([ids[:first]], batch,
                                                select.pick_prefill(self._lengths("prefill", batch), first))
        outs = exe.run(args)
        state = self._collect(exe.bucket, outs)
        exe = self._executable("chunk", batch, capacity)
        pad = self.manifest.tokenizer.pad_token_id
        for p in range(first, len(ids), chunk):
            yield
            part = ids[p:p + chunk]
            tokens, valid = select.pad_prompts([part], batch, exe.bucket.padded_len(len(part)), pad)
            pos = torch.zeros(batch, dtype=torch.int64)
            pos[0] = p
            engram = None
            if self.hasher is not None:
                engram, history = self.hasher.hash(tokens, history, valid)
            data = {"tokens": tokens, "pos": pos, "valid_len": valid, "engram_ids": engram}
            outs = exe.run(self._inputs(exe.bucket, data, self._state_for(exe.bucket, state)))
            state = self._collect(exe.bucket, outs)
        return outs[0][0], state, history

    def _prefill_call(self, ids: list[list[int]], batch: int, seq_len: int):
        """(executable, its inputs, engram history) of the prefill of `ids` right-padded to (batch,
        seq_len), or for a bucket with a token range to `Bucket.padded_len` of the longest prompt."""
        exe = self._executable("prefill", batch, seq_len)
        tokens, valid = select.pad_prompts(ids, batch, exe.bucket.padded_len(max(len(x) for x in ids)),
                                           self.manifest.tokenizer.pad_token_id)
        engram = history = None
        if self.hasher is not None:
            engram, history = self.hasher.hash(tokens, self.hasher.initial_history(batch), valid)
        return exe, self._inputs(exe.bucket, {"tokens": tokens, "valid_len": valid, "engram_ids": engram}, self._state_for(exe.bucket, {})), history

    def _decode_call(self, feed: torch.Tensor, pos: torch.Tensor, history, state: dict[str, torch.Tensor]):
        """(executable, its inputs, engram history') of one decode step of feed [B,1] at positions
        pos [B], at the smallest capacity holding every position, with the state carried over."""
        batch = feed.size(0)
        engram = None
        if self.hasher is not None:
            engram, history = self.hasher.hash(feed, history)
        exe = self._executable("decode", batch, select.pick_capacity(self._lengths("decode", batch), int(pos.max()) + 1))
        return exe, self._inputs(exe.bucket, {"tokens": feed, "pos": pos, "engram_ids": engram}, self._state_for(exe.bucket, state)), history

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

    def _inputs(self, bucket: Bucket, data: dict[str, torch.Tensor | None], state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        args = []
        for spec in bucket.inputs:
            if spec.name == "engram_ids" and data.get("engram_ids") is None:
                shape = (spec.shape[0], data["tokens"].shape[1], *spec.shape[2:])
                args.append(torch.zeros(shape, dtype=torch.int64))  # E = 0: an empty tensor
            elif spec.name in DATA_INPUTS:
                args.append(data[spec.name].contiguous())
            else:
                args.append(state[spec.name])
        return args

    @staticmethod
    def _collect(bucket: Bucket, outs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {spec.name: t for spec, t in zip(bucket.outputs[1:], outs[1:]) if not spec.name.startswith(PROBE_PREFIX)}


def _load_tokenizer(bundle: Bundle):
    from tokenizers import Tokenizer

    path = bundle.tokenizer_file
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception
        raise BundleError(f"{path.relative_to(bundle.root)}: not a valid tokenizer.json ({e})") from None
