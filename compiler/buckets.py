"""Bucket planning: which (batch, length) shapes to compile, validated before any compile starts.

A prefill bucket is (batch, seq_len); a decode bucket is (batch, context capacity). Each prefill
bucket hands its state to decode at the smallest decode capacity >= its seq_len (its `capacity`); the
runtime grows the state to a larger capacity when generation needs one (runtime_min/bundle/schema.py says
how). Lists come from the config, or are generated like NxDI's autobucketing (powers of two from 128
up to the maximum, plus the maximum), then sorted and deduplicated.

Constraints checked here (chosen for the V4.1 step graphs and their kernels; each failure is a
ConfigError naming the key and the limit):
- prefill seq_len is a multiple of every positive compress ratio (their lcm): the compressor pools
  whole groups of r tokens, so S // r groups tile the bucket exactly (graphs Compressor.prefill);
- prefill seq_len <= the largest decode capacity: the prefill's state must fit a decode bucket;
- decode capacity >= window_size: the sliding-window ring is W rows in every bucket, so a smaller
  capacity saves nothing and would hold a ring larger than the context;
- decode capacity is a multiple of r * candidate_block_size for every positive ratio r (r alone
  when no candidate filter is configured): the compressed cache of a ratio-r source holds C // r
  rows, which must be an integer and split into whole candidate blocks, so the candidate filter
  never scores a padded partial block and block tiles stay aligned.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dsneuron.graphs.config import ConfigError, ModelConfig

from .config import CompileConfig

GENERATED_MIN = 128  # smallest generated bucket, as NxDI's generate_buckets


@dataclass(frozen=True)
class PlannedBucket:
    """One shape to compile. kind "prefill": seq_len tokens per call, its state at `capacity`;
    kind "decode": one token per call (seq_len 1) against a state of `capacity` positions; kind
    "chunk": seq_len tokens per call continuing a state of `capacity` positions (a chunked
    prefill's later chunks, graphs/steps.py prefill_chunk); kind "verify": a chunk returning every
    position's logits and main_hidden (speculative decoding's verify, graphs/steps.py verify_chunk);
    kind "draft": the DSpark drafter's step drafting seq_len tokens (graphs/dspark.py DraftStep)."""

    kind: str
    batch: int
    seq_len: int
    capacity: int
    #: > 0: a prefill taking any multiple of seq_len_step in min_seq_len..seq_len tokens (a dynamic
    #: token dimension)
    min_seq_len: int = 0
    seq_len_step: int = 1

    @property
    def length(self) -> int:
        """The length in the bucket's file name: seq_len (prefill) or capacity (decode)."""
        return self.seq_len if self.kind == "prefill" else self.capacity

    @property
    def label(self) -> str:
        return f"{self.kind} b{self.batch} s{self.length}"

    @property
    def batch_label(self) -> str:
        """The label of what every bucket of this batch size shares (the per-token stages)."""
        return f"b{self.batch}"


@dataclass(frozen=True)
class BucketPlan:
    """Sorted, deduplicated bucket lists; prefill before decode, then by batch, then by length."""

    batch_sizes: tuple[int, ...]
    prefill_seq_lens: tuple[int, ...]
    decode_capacities: tuple[int, ...]
    #: > 0: every prefill bucket takes the multiples of prefill_step in min_prefill..its seq_len
    #: tokens (`with_dynamic_prefill`)
    min_prefill: int = 0
    prefill_step: int = 1
    #: the decode capacities that get a chunk bucket (`with_chunks`)
    chunk_capacities: tuple[int, ...] = ()
    #: the batch sizes of the decode buckets (batch_sizes plus compile.decode_batch_sizes)
    decode_batches: tuple[int, ...] = ()
    #: > 0: the tokens of a verify bucket per batch size and decode capacity (`with_verify`)
    verify_len: int = 0
    #: > 0: the block of a draft bucket per batch size (`with_draft`)
    draft_len: int = 0

    @property
    def prefill(self) -> tuple[PlannedBucket, ...]:
        return tuple(PlannedBucket("prefill", b, s, self.capacity_for(s), self.min_prefill, self.prefill_step)
                     for b in self.batch_sizes for s in self.prefill_seq_lens)

    def with_dynamic_prefill(self, step: int) -> "BucketPlan":
        """The plan of a backend whose prefill executables take a dynamic token count: one prefill
        bucket per batch size, for every multiple of `step` from `step` to the largest prefill
        length (a prompt runs at its own length rounded up to `step`: one compile instead of one
        per length, and padding below `step` tokens instead of up to the next bucket; a chunk of
        1 + 5 tokens, a speculative verify on tiny, runs at 8 tokens)."""
        return dataclasses.replace(self, prefill_seq_lens=(self.prefill_seq_lens[-1],), min_prefill=step,
                                   prefill_step=step)

    def with_chunks(self) -> "BucketPlan":
        """The plan plus one chunk bucket per batch size and decode capacity at or above the largest
        prefill length P: seq_len P tokens per call (the range of the prefill buckets when they
        take one), continuing a state of that capacity. A prompt longer than P runs as a prefill
        of its first P tokens, then chunks of up to P at the smallest capacity holding it; a
        prompt that starts from a prefix-cache snapshot (runtime_min/core/prefix_cache.py) runs its
        rest as chunks, so the capacity P itself gets one too (tiny's only capacity)."""
        return dataclasses.replace(self, chunk_capacities=tuple(c for c in self.decode_capacities
                                                                if c >= self.prefill_seq_lens[-1]))

    @property
    def chunk(self) -> tuple[PlannedBucket, ...]:
        P = self.prefill_seq_lens[-1]
        return tuple(PlannedBucket("chunk", b, P, c, self.min_prefill, self.prefill_step)
                     for b in self.batch_sizes for c in self.chunk_capacities)

    def with_verify(self, tokens: int) -> "BucketPlan":
        """The plan plus one verify bucket of `tokens` tokens (1 + the drafter's block: the last
        accepted token and its drafts) per decode capacity, at the smallest batch size (1 unless
        the config has none): the scheduler and `run` verify each request in a call of its own. A
        verify continues a decode state of any length, at the smallest capacity holding it, as a
        decode step does. Where the prefill takes a token range (`with_dynamic_prefill`: a staged
        target), the verify buckets are instead the chunk buckets' shapes at batch_sizes[0] (their
        stages are the chunk's, the head at every position: the same executables but one)."""
        return dataclasses.replace(self, verify_len=tokens)

    def with_draft(self, block: int) -> "BucketPlan":
        """The plan plus one draft bucket (the DSpark drafter's step, drafting `block` tokens) at
        the smallest batch size, as `with_verify`, and the largest decode capacity: its rings are
        window_size rows whatever the context, and the capacity only bounds the positions it
        drafts at."""
        return dataclasses.replace(self, draft_len=block)

    @property
    def draft(self) -> tuple[PlannedBucket, ...]:
        if not self.draft_len:
            return ()
        return (PlannedBucket("draft", self.batch_sizes[0], self.draft_len, self.decode_capacities[-1]),)

    @property
    def verify(self) -> tuple[PlannedBucket, ...]:
        if not self.verify_len:
            return ()
        if self.min_prefill:
            return tuple(dataclasses.replace(pb, kind="verify") for pb in self.chunk if pb.batch == self.batch_sizes[0])
        return tuple(PlannedBucket("verify", self.batch_sizes[0], self.verify_len, c) for c in self.decode_capacities)

    @property
    def decode(self) -> tuple[PlannedBucket, ...]:
        return tuple(PlannedBucket("decode", b, 1, c) for b in self.decode_batches or self.batch_sizes
                     for c in self.decode_capacities)

    @property
    def buckets(self) -> tuple[PlannedBucket, ...]:
        return self.prefill + self.decode + self.chunk + self.verify + self.draft

    def capacity_for(self, seq_len: int) -> int:
        """The decode capacity a prefill of `seq_len` hands its state to: the smallest >= seq_len."""
        return next(c for c in self.decode_capacities if c >= seq_len)


def generated_lengths(maximum: int, minimum: int = GENERATED_MIN) -> tuple[int, ...]:
    """Powers of two from `minimum` below `maximum`, plus `maximum` itself (just it when < minimum)."""
    out, p = [], minimum
    while p < maximum:
        out.append(p)
        p *= 2
    return tuple(out) + (maximum,)


def plan_buckets(compile_cfg: CompileConfig, model_cfg: ModelConfig) -> BucketPlan:
    """The bucket plan of a config, validated before any compile (constraints: module docstring).

    Explicit lists are used as given (sorted, deduplicated); an empty list is generated from
    compile.max_seq_len. Raises ConfigError naming the key, the offending length and the limit.
    """
    batches = tuple(sorted(set(compile_cfg.batch_sizes)))
    if not batches or batches[0] <= 0:
        raise ConfigError(f"compile.batch_sizes: needs at least one positive batch size (got {list(compile_cfg.batch_sizes)})")
    prefill, p_note = _lengths(compile_cfg, "prefill_seq_lens")
    decode, d_note = _lengths(compile_cfg, "decode_context_lens")

    ratios = sorted({r for r in model_cfg.compress_ratios[:model_cfg.n_layers] if r > 0})
    group = math.lcm(*ratios) if ratios else 1
    for s in prefill:
        if s % group:
            raise ConfigError(f"compile.prefill_seq_lens{p_note}: {s} is not a multiple of {group}, the lcm of the compress "
                              f"ratios {ratios} (the compressor pools whole groups of ratio tokens)")
    window = model_cfg.window_size
    filtered = model_cfg.candidate_source_layer >= 0
    step = math.lcm(*(r * (model_cfg.candidate_block_size if filtered else 1) for r in ratios)) if ratios else 1
    for c in decode:
        if c < window:
            raise ConfigError(f"compile.decode_context_lens{d_note}: capacity {c} is below model.window_size={window} "
                              "(the sliding-window ring alone holds that many positions)")
        if c % step:
            why = (f"r * candidate_block_size (block {model_cfg.candidate_block_size}) for every compress ratio r in {ratios}"
                   if filtered else f"every compress ratio in {ratios}")
            raise ConfigError(f"compile.decode_context_lens{d_note}: capacity {c} is not a multiple of {step}, the lcm of {why}, "
                              "so compressed caches would not split into whole candidate blocks")
    if prefill[-1] > decode[-1]:
        raise ConfigError(f"compile.prefill_seq_lens{p_note}: {prefill[-1]} exceeds the largest decode capacity {decode[-1]} "
                          "(compile.decode_context_lens); a prefill's state must fit a decode bucket")
    return BucketPlan(batches, prefill, decode,
                      decode_batches=tuple(sorted({*batches, *compile_cfg.decode_batch_sizes})))


def _lengths(compile_cfg: CompileConfig, key: str) -> tuple[tuple[int, ...], str]:
    """(sorted unique lengths, a note for error messages saying whether they were generated)."""
    given = getattr(compile_cfg, key)
    if not given:
        return generated_lengths(compile_cfg.max_seq_len), f" (generated from compile.max_seq_len={compile_cfg.max_seq_len})"
    lengths = tuple(sorted(set(given)))
    if lengths[0] <= 0 or lengths[-1] > compile_cfg.max_seq_len:
        raise ConfigError(f"compile.{key}: entries must be in 1..max_seq_len={compile_cfg.max_seq_len} (got {list(given)})")
    return lengths, ""
