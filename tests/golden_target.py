"""The eager golden model as the speculative loop's Target (runtime_min/core/speculative.py): the
reference the runner's verify is checked against in tests/test_speculative.py."""

from __future__ import annotations

import torch

from dsneuron.graphs.context import Capture
from dsneuron.graphs.dspark import logits_from_capture, main_hidden_from_capture
from dsneuron.runtime_min.core.speculative import Verified


class GoldenTarget:
    """The eager golden (graphs/golden.py Golden) as runtime_min/core/speculative.py's Target: prefill
    reads graphs/steps.py prefill with a Capture at every position (`logits_from_capture`,
    `main_hidden_from_capture`), verify is graphs/steps.py verify_chunk (the same reads of a chunk); commit replays the kept tokens as a chunk
    from the verify's input state. State: (state tensors, each row's token history for the engram
    hashes)."""

    def __init__(self, golden):
        self.golden = golden

    def _engram(self, history: list[list[int]], tokens: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Hash ids [B, S, E, C] of row b's tokens after its history (rows hashed alone, padding 0)."""
        B, S = tokens.shape
        rows = []
        for b in range(B):
            n = int(count[b])
            full = torch.tensor([history[b] + tokens[b, :n].tolist()], dtype=torch.int64)
            e = self.golden.engram_ids(full)[:, len(history[b]):]
            rows.append(torch.cat([e, e.new_zeros(1, S - n, *e.shape[2:])], dim=1))
        return torch.cat(rows)

    def prefill(self, prompts) -> Verified:
        from dsneuron.graphs.steps import prefill

        B, S = len(prompts), max(len(p) for p in prompts)
        tokens = torch.zeros(B, S, dtype=torch.int64)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = torch.tensor(list(p))
        count = torch.tensor([len(p) for p in prompts])
        cap = Capture()
        with torch.inference_mode():
            _, state = prefill(self.golden.model, tokens, count, self._engram([[] for _ in prompts], tokens, count), cap,
                               routed=True)
            v = self._read(cap, tokens)
        hist = [list(p) for p in prompts]
        return Verified(*v, (state, hist), tokens, torch.zeros(B, dtype=torch.int64), count)

    def verify(self, tokens: torch.Tensor, pos: torch.Tensor, count: torch.Tensor, state) -> Verified:
        from dsneuron.graphs.steps import verify_chunk

        tensors, hist = state
        with torch.inference_mode():
            *v, new = verify_chunk(self.golden.model, tokens, pos, count, self._engram(hist, tokens, count), tensors,
                                   routed=True)
        hist2 = [h[:int(p)] + tokens[b, :int(count[b])].tolist() for b, (h, p) in enumerate(zip(hist, pos))]
        return Verified(*v, (new, hist2), tokens, pos, count, state)

    def commit(self, v: Verified, keep: torch.Tensor):
        from dsneuron.graphs.steps import prefill_chunk

        tensors, hist = v.state_in
        new, new_hist = v.state
        if bool(((keep > 0) & (keep < v.count)).any()):
            n = keep.clamp(min=1)
            with torch.inference_mode():
                _, new = prefill_chunk(self.golden.model, v.tokens, v.pos, n, self._engram(hist, v.tokens, n), tensors,
                                       routed=True)
        idle = keep == 0  # a finished row: as the verify found it
        new = {k: torch.where(idle.view(-1, *[1] * (t.dim() - 1)), tensors[k], t) for k, t in new.items()}
        return new, [hist[b] if idle[b] else hist[b][:int(v.pos[b])] + v.tokens[b, :int(keep[b])].tolist()
                     for b in range(len(hist))]

    def _read(self, cap: Capture, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.golden.model
        return logits_from_capture(m, cap), main_hidden_from_capture(m, cap, tokens)
