"""Prompt-lookup speculative decoding: draft tokens from earlier text, verify them in one decode forward.

A sequence whose last n tokens (n = 3, then 2, then 1) occurred earlier in its prompt or output
drafts the tokens that followed that occurrence. One forward of the decode graph then runs
`[next token, draft...]`: GroupQueryAttention writes the new positions into the shared KV buffer with
causal attention among them. The sequence keeps the longest draft prefix its own choices agree
with, plus the choice after it; KV written for rejected positions lies beyond its mask and is
overwritten by the next step.

Greedy outputs equal plain decoding's only up to float rounding: for several new tokens ONNX
Runtime's CPU attention multiplies by V with a GEMM where a one-token step takes MLAS's GEMV path,
the int8 activation quantization of the next layers amplifies the ~1e-6 difference, and a near-tie
argmax can flip (measured: 8 of 12 copying and 0 of 12 chat outputs of 128 tokens stayed identical).
That, and a verify of 4 tokens costing ~2.8 decode steps, is why `EngineConfig.speculative` is off.

Only greedy, unconstrained sequences draft (a sampled token would need rejection sampling to keep
the distribution, and a grammar would need a mask per drafted position). Verifying k drafts costs
well over one decode step on the CPU (int8 MatMulNBits with several activation rows), so a draft
pays only when most of it is accepted: each sequence keeps a moving average of its acceptance and
stops drafting when that falls low.

Only a sequence decoding alone speculates: ONNX Runtime's CPU GroupQueryAttention (1.31) rejects
several new tokens per row with past context once the batch holds more than one row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from runtime.engine.sampling import TokenChoice, sample

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from runtime.engine.scheduler import SequenceState

MAX_NGRAM = 3


def lookup_draft(tokens: NDArray[np.int64], max_tokens: int) -> NDArray[np.int64]:
    """Up to `max_tokens` tokens that followed the latest earlier occurrence of the longest matching suffix.

    `tokens`: a sequence's prompt and output, `[length]`; returns `[0..max_tokens]`.
    """
    length = tokens.size
    for n in range(min(MAX_NGRAM, length - 1), 0, -1):
        # Windows start before the suffix itself, so every match has at least one token after it.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + max_tokens]
    return tokens[:0]


@dataclass
class SpeculationStats:
    """Counters since engine start: verify steps run, draft tokens proposed, draft tokens accepted."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0


class PromptLookup:
    """Drafts for a sequence decoding alone, and acceptance of the verify forward's logits.

    Reads sequences and changes none: the scheduler books the accepted tokens and the drafting record.
    """

    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft
        self.stats = SpeculationStats()

    def propose(self, seq: SequenceState, room: int) -> NDArray[np.int64] | None:
        """Tokens to verify after `seq.next_token` (`[1..max_draft]`), or None when this sequence does not draft now.

        `room`: positions the sequence's KV slot can still take, so a draft never outgrows the context.
        """
        if not seq.draft.enabled or not seq.sampler.greedy or seq.sampler.constraint is not None:
            return None
        limit = min(self.max_draft, room - 1, seq.output.remaining_tokens - 1)
        if limit < 1:
            return None
        output = np.asarray(seq.sampler.output_token_ids, dtype=np.int64)
        draft = lookup_draft(np.concatenate([seq.group.prompt_array, output]), limit)
        return draft if draft.size else None

    def accept(self, logits: NDArray[np.float32], seq: SequenceState, draft: NDArray[np.int64]) -> list[TokenChoice]:
        """The sequence's new tokens from verify logits `[draft.size + 1, vocab]`: 1 + accepted drafts.

        Each position samples exactly as a decode step would: penalties see the tokens accepted before it
        as output, though none is booked yet. The first disagreement with the draft ends the run.
        """
        chosen: list[TokenChoice] = []
        for position in range(logits.shape[0]):
            pending = [c.token_id for c in chosen]
            (choice,) = sample(logits[position : position + 1], [seq.sampler], pending=[pending])
            chosen.append(choice)
            if position == draft.size or int(draft[position]) != choice.token_id:
                break
        accepted = len(chosen) - 1
        self.stats.steps += 1
        self.stats.drafted += draft.size
        self.stats.accepted += accepted
        return chosen
