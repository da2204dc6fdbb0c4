"""Generation from a verified bundle: the Python API behind `dsneuron run`.

    session = Session.load("artifacts/")
    text = session.generate("Hello", max_new_tokens=32)                       # greedy
    texts = session.generate(["a", "b"], 32, temperature=0.8, top_p=0.9, seed=1, stream=print_piece)

The session is the tokenize-and-generate front: the executables and state rows are its `runner`
(runtime_min/core/runner.py), which the scheduler drives.

Lifecycle per call: tokenize (bundle tokenizer, BOS per manifest) -> one request per prompt
through the scheduler (runtime_min/core/scheduler.py, the one decode loop, shared with `dsneuron
serve`): each prompt's prefill at the smallest batch bucket, right-padded to its prefill bucket
(first-fit, runtime_min/core/select.py), or, for a prompt past the largest prefill bucket in a bundle
with chunk buckets, a chunked prefill (`Runner.prefill_job`: its first chunk a prefill, the others
chunk buckets continuing the state with the numerics of decode steps), engram ids on the host
from the manifest's parameters, state
starting as the manifest's fill values when the prefill takes state inputs -> sample -> decode one
token per active row per step at the smallest batch bucket holding the rows, each row at its own
position, at the smallest decode capacity holding the positions in use, resizing the state
between capacities (schema.py: append fill rows to grow, drop unused trailing rows to shrink) ->
stop a row at EOS (not part of its text) or max_new_tokens. Any number of prompts: those past the
largest batch bucket wait for a free row, and each prompt's output is what it gets alone.

Prompt limit, decided up front (`Runner.check_prompt_length`): the largest prefill bucket, or, where the
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
from typing import Callable, Sequence

import torch

from dsneuron import UserError

from .bundle.bundle import Bundle
from .bundle.schema import BundleError
from .core.checks import check_context, check_generation
from .core.prefix_cache import PrefixCache
from .core.runner import Runner, Step
from .core.scheduler import GenerationStats, Request, Scheduler


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

    @classmethod
    def of_row0(cls, step: Step) -> "StepResult":
        return cls(step.logits[0], {k: t[0] for k, t in step.probes.items()}, step.seconds,
                   {k: t[:1] for k, t in step.state_in.items()})


class Session:
    """A loaded bundle ready to generate: the tokenizer in front of its `runner` (runtime_min/core/runner.py,
    the executables and state rows). Build with `Session.load(path)`."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self.bundle = runner.bundle
        self.manifest = runner.manifest
        self.tokenizer = _load_tokenizer(runner.bundle)
        #: timings of the last `generate` call (GenerationStats), None before the first
        self.last_stats: GenerationStats | None = None

    @classmethod
    def load(cls, path: str | Path, verify_key: str | Path | None = None,
             shard: tuple[int, int, int] | None = None) -> "Session":
        """Open and verify the bundle at `path` (runtime_min/bundle/bundle.py; with `verify_key`, its
        signature too), load weights and tokenizer. Executables load on first use. shard: (tp, ep,
        rank) when this process is one rank of a sharded bundle (runtime_min/sharded.py). Raises
        BundleError naming the first problem."""
        return cls(Runner.load(path, verify_key, shard))

    @property
    def max_capacity(self) -> int:
        """The context capacity: the largest decode capacity, in tokens."""
        return self.runner.max_capacity

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

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

    def scheduler(self, max_queue: int | None = None, stats: GenerationStats | None = None,
                  prefix_cache: PrefixCache | None = None, speculation=None) -> Scheduler:
        """A Scheduler over this session's runner, detokenizing with `decode` (prefix_cache,
        speculation: Scheduler's)."""
        return Scheduler(self.runner, self.decode, max_queue=max_queue, stats=stats, prefix_cache=prefix_cache,
                         speculation=speculation)

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None,
                 stream: Callable[[int, str], None] | None = None) -> str | list[str]:
        """Generate up to `max_new_tokens` per prompt; returns one text per prompt (a str for a str),
        in prompt order. Any number of prompts (module docstring); each one's output is the one it
        gets alone.

        temperature 0 is greedy; otherwise temperature/top-p sampling, each prompt from its own
        torch.Generator seeded with `seed` (fresh entropy when None). `stream(index, piece)`
        receives a prompt's text as it is final. Raises UserError naming the limit for an empty
        prompt, a prompt `Runner.check_prompt_length` refuses, prompt + max_new_tokens - 1
        beyond the context capacity (`check_context`), a max_new_tokens that is no positive
        integer, a seed outside 0..2**64-1 or bad sampling values (runtime_min/core/checks.py
        `check_generation`).
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
        check_generation(max_new_tokens, temperature, top_p, seed)
        start = time.perf_counter()
        ids = [self.encode(p, i) for i, p in enumerate(prompts)]
        longest = max(len(x) for x in ids)
        for i, x in enumerate(ids):  # the one at fault named, among several
            try:
                self.runner.check_prompt_length(len(x))
                check_context(len(x), max_new_tokens, self.max_capacity)
            except UserError as e:
                raise UserError(f"prompt {i}: {e}" if len(ids) > 1 else str(e)) from None
        self.last_stats = stats = GenerationStats(longest, self.runner.prefill_label(longest), len(ids))
        scheduler = self.scheduler(stats=stats)
        index: dict[str, int] = {}

        def listener(r: Request, piece: str) -> None:
            if piece and stream is not None:
                stream(index[r.id], piece)

        requests = [Request(x, max_new_tokens, temperature, top_p, seed, listener=listener) for x in ids]
        index.update({r.id: i for i, r in enumerate(requests)})
        for r in requests:
            scheduler.submit(r)
        loaded = self.runner.load_seconds
        try:
            scheduler.run()
        finally:  # the executables loaded on first use during this call
            stats.load_s = self.runner.load_seconds - loaded
        stats.first_token_s = min(r.first_token_at for r in requests) - start
        return [r.generated for r in requests]

    def generate_speculative(self, prompt: str, max_new_tokens: int, drafter, k: int, temperature: float = 0.0,
                             top_p: float = 1.0, seed: int | None = None):
        """One prompt by speculative decoding (runtime_min/core/speculative.py) with `drafter` proposing k
        tokens a step, the bundle verifying them (`Runner.verify`: a cpu bundle with a chunk bucket
        of batch 1); stops at max_new_tokens or EOS. Returns (text, SpecStats). Raises UserError as
        `generate_ids`, and for k outside 1..drafter.block."""
        from .core.speculative import RunnerTarget, generate

        if not 1 <= k <= drafter.block:
            raise UserError(f"--speculative-tokens must be in 1..{drafter.block} (the drafter's block size), got {k}")
        check_generation(max_new_tokens, temperature, top_p, seed)
        ids = self.encode(prompt)
        self.runner.check_prompt_length(len(ids))
        # the plain run's limit: `generate` drafts no further than a row's budget, so its verifies
        # feed no position past prompt + max_new_tokens - 1
        check_context(len(ids), max_new_tokens, self.max_capacity)
        gen = None
        if temperature > 0:
            gen = torch.Generator()
            gen.manual_seed(seed) if seed is not None else gen.seed()
        eos = self.manifest.tokenizer.eos_token_id
        res = generate(RunnerTarget(self.runner), drafter, [ids], max_new_tokens, k, temperature, top_p, gen, eos,
                       keep_logits=False)
        out = res.tokens[0][:-1] if res.tokens[0] and res.tokens[0][-1] == eos else res.tokens[0]
        return self.decode(out), res.stats

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
        runner = self.runner
        batch = runner.prefill_batch
        step = runner.prefill([ids[:n_prompt]])
        results = [StepResult.of_row0(step)]
        for p in range(n_prompt, len(ids)):  # feeds ids[p] at position p
            tokens = torch.full((batch,), runner.pad_token_id, dtype=torch.int64)
            tokens[0] = ids[p]
            pos = torch.zeros(batch, dtype=torch.int64)
            pos[0] = p
            step = runner.decode(tokens, pos, step.state)
            results.append(StepResult.of_row0(step))
        return results


def _load_tokenizer(bundle: Bundle):
    from tokenizers import Tokenizer

    path = bundle.tokenizer_file
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception
        raise BundleError(f"{path.relative_to(bundle.root)}: not a valid tokenizer.json ({e})") from None
