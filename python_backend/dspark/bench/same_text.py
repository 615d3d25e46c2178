"""Same text for every policy: a benchmark's target that decodes a given reference greedily.

In bf16 a greedy run's text depends on the shapes of the batches it was verified in: the
target's logits round to 8 mantissa bits (at 34.5 two logits 0.25 apart are one step apart, and
measured top-2 ties are exact), so a speculative run and a plain one part at a near-tie and from
there decode different texts, one of which may fall into a loop that prompt lookup drafts for
free. Compared token for token, a policy's speed then says as much about which text it drew as
about its scheduling (on SmolLM2 about half of the tokens of every speculative policy came after
such a parting). `SameTextTarget` removes that noise: wrapped around the target, it makes the
reference's next token the argmax of every logits row it returns for a prompt it knows (all
other rows untouched), so every policy decodes the reference text (plain decoding's, from an
untimed pass) and only the parting ties change. The forward passes, and so the costs, are the
real ones; the wrapper itself adds ~0.02 ms to a step of one request and ~0.7 ms to one of 32
(< 1 % of either; a policy that takes fewer steps pays it fewer times). Benchmark-only: serving
never wraps its target.
"""

from __future__ import annotations

import torch

from dspark.runtime.batch import RaggedBatch

FORCED_LOGIT = 1.0e4  # above any real logit, small enough that a softmax over the row stays finite


class SameTextTarget:
    """A target whose greedy text for each known prompt is `references[prompt]` (see module doc).
    Everything else (KV slots, taps, attributes) is the wrapped target's."""

    def __init__(self, target, references: dict[tuple[int, ...], list[int]]) -> None:
        self._target = target
        self._references = {tuple(p): list(r) for p, r in references.items()}
        self._slots: dict[int, tuple[int, torch.Tensor]] = {}  # slot -> (prompt length, reference)

    def __getattr__(self, name: str):
        return getattr(self._target, name)

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self._target.release(slot)

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits, taps = self._target.prefill(slots, prompts)
        for row, (slot, prompt) in enumerate(zip(slots, prompts, strict=True)):
            reference = self._references.get(tuple(prompt))
            if reference is None:
                self._slots.pop(slot, None)
                continue
            self._slots[slot] = (len(prompt), torch.tensor(reference, dtype=torch.int64))
            if reference:
                logits[row, reference[0]] = FORCED_LOGIT
        return logits, taps

    def verify(self, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits [N, V] and taps, with row i (the token at position p of its
        sequence, predicting position p + 1) pointing at the reference's token p + 1."""
        logits, taps = self._target.verify(batch)
        cu = batch.cu_seqlens.tolist()
        rows, tokens = [], []
        for r, slot in enumerate(batch.slots.tolist()):
            known = self._slots.get(slot)
            if known is None:
                continue
            prompt_len, reference = known
            # the reference index each row predicts: position + 1 − prompt length
            index = batch.positions[cu[r]:cu[r + 1]].cpu() + 1 - prompt_len
            inside = (index >= 0) & (index < len(reference))
            rows.append(torch.arange(cu[r], cu[r + 1])[inside])
            tokens.append(reference[index[inside]])
        if rows:
            logits[torch.cat(rows).to(logits.device), torch.cat(tokens).to(logits.device)] = FORCED_LOGIT
        return logits, taps
