"""The DSpark drafter's compiled bucket as runtime_min/core/speculative.py's `Drafter`.

A bundle compiled with `--speculative dspark` holds a draft bucket at batch 1 (the neuron and the
cpu target compile it; runtime_min/bundle/schema.py, kind "draft";
graphs/dspark.py DraftStep): one call seeds the drafter's rings with the positions the last
verify kept and drafts a block, as the reference's forward_spec does at a decode step. The rings
are the drafter's own state (one bf16 [B, W, head_dim] per stage), kept here per call site (the
library loop's batch, or one request's row in the scheduler), never in the model's state.

`seed` records what to write and the next `propose` writes it in the same call as the draft: the
last window_size positions of a seed at most (all a ring keeps; the bucket takes that many a
call). Seeds recorded twice before a draft run as calls of their own first, their drafts unused. Sampling: the caller's
generator draws the Gumbel noise the bucket's draw takes (the Gumbel-max draw of softmax(logits
/ T), graphs/dspark.py DraftStep), and q is softmax(logits / T) of the returned logits, as the
eager drafter reports it (graphs/dspark.py draft_probs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..bundle.schema import DATA_INPUTS, BundleError
from . import select


@dataclass
class DraftRings:
    """A drafter state: rings bf16 [B, W, head_dim] per stage, and the seeds not yet written
    [(main_hidden bf16 [B, S, T*D], start int64 [B], count int64 [B])] (the next call writes them)."""

    rings: list[torch.Tensor]
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


class CompiledDrafter:
    """The draft buckets of `runner`'s bundle (runtime_min/core/runner.py Runner) as a Drafter:
    start / seed / propose (runtime_min/core/speculative.py). block: the bucket's K. A batch of B
    rows runs at the smallest draft bucket of batch >= B (extra rows are filler). Raises
    BundleError when the bundle has no draft bucket."""

    def __init__(self, runner):
        buckets = sorted((b for b in runner.manifest.buckets if b.kind == "draft"), key=lambda b: b.batch)
        if not buckets:
            raise BundleError("the bundle has no draft bucket (compile --speculative dspark for a target that "
                              "compiles the drafter)")
        self.runner, self.buckets = runner, buckets
        first = buckets[0]
        self.block = first.seq_len
        specs = {s.name: s for s in first.inputs}
        self.seed_len = specs["main_hidden"].shape[1]
        self.hidden_width = specs["main_hidden"].shape[2]
        self.vocab = specs["gumbel"].shape[2]
        self.ring_shapes = [tuple(s.shape[1:]) for s in first.inputs[len(DATA_INPUTS["draft"]):]]
        self.window = self.ring_shapes[0][0]

    def start(self, batch: int) -> DraftRings:
        return DraftRings([torch.zeros(batch, *shape, dtype=torch.bfloat16) for shape in self.ring_shapes])

    def seed(self, cache: DraftRings, main_hidden: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> DraftRings:
        """Write row b's positions start[b] .. start[b]+count[b]-1 (main_hidden bf16 [B, S, T*D]) at
        the next call: the last seed_len (= window_size) of them, all a ring keeps."""
        B, S, _ = main_hidden.shape
        first = torch.maximum(start, start + count - self.seed_len)
        if not B or not bool((count > 0).any()):
            return cache
        rows = (first - start).unsqueeze(1) + torch.arange(self.seed_len)  # [B, seed_len] within main_hidden
        piece = main_hidden.gather(1, rows.clamp(max=S - 1).unsqueeze(-1).expand(B, self.seed_len, main_hidden.size(2)))
        return DraftRings(cache.rings, [*cache.pending, (piece, first, start + count - first)])

    def propose(self, cache: DraftRings, token: torch.Tensor, pos: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts int64 [B, k] of rows at positions pos (int64 [B]) fed token (int64 [B]), and their
        proposal distributions float64 [B, k, V] when temperature > 0 (else None). Writes the
        pending seeds into `cache` (in place: later calls see them written)."""
        from dsneuron.graphs.dspark import draft_probs

        B = token.size(0)
        batch = select.first_fit([b.batch for b in self.buckets], B)
        if batch is None:
            raise ValueError(f"draft: {B} rows; the bundle's largest draft bucket takes {self.buckets[-1].batch}")
        exe = self.runner.executable("draft", batch, next(b.capacity for b in self.buckets if b.batch == batch))
        pad = batch - B

        def rows(t: torch.Tensor) -> torch.Tensor:  # filler rows past B
            return t if not pad else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])

        K, V = self.block, self.vocab
        idle = (torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64))
        seeds = cache.pending or [(torch.zeros(B, self.seed_len, self.hidden_width, dtype=torch.bfloat16), *idle[:2])]
        rings = [rows(r) for r in cache.rings]
        for i, (hidden, start, count) in enumerate(seeds):
            last = i == len(seeds) - 1
            hot = last and temperature > 0
            gumbel = (-torch.empty(batch, K, V).exponential_(generator=generator).log() if hot
                      else torch.zeros(batch, K, V))
            args = [rows(token if last else idle[0]), rows(pos if last else idle[1]), rows(hidden), rows(start),
                    rows(count), gumbel, torch.full((batch,), float(temperature) if last else 0.0), *rings]
            tokens, logits, _confidence, *rings = exe.run(args)
        cache.rings, cache.pending = [r[:B] for r in rings], []
        q = draft_probs(logits[:B, :k], temperature) if temperature > 0 else None
        return tokens[:B, :k], q
