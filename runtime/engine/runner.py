"""Execute a `SchedulerOutput`: prefill chunks in their slots, then one batched decode step.

First chunks of prompts in consecutive slots run together, right-padded, when the prefill graph allows it.

With a `PromptLookup`, the decode step verifies drafted tokens when the drafter judges it worth it.

The runner writes KV and reports what it computed and sampled (`ModelRunnerOutput`); it changes no sequence's
state: `Scheduler.update_from_output` books the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from runtime.engine.kv_cache import KVPool
from runtime.engine.request import EngineError
from runtime.engine.sampling import sample
from runtime.engine.scheduler import ModelRunnerOutput, PrefillChunk, SchedulerOutput, SequenceState, SequenceStep
from runtime.engine.session import DecoderSession
from runtime.engine.speculative import PromptLookup

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from runtime.engine.kv_cache import KVArray

# Padding a batched prefill may add, as a share of its prompt tokens: a 32- and an 8-token prompt run
# faster one after the other than padded to 2 x 32.
MAX_PREFILL_PADDING = 0.25


class ModelRunner:
    def __init__(
        self,
        session: DecoderSession,
        pool: KVPool,
        drafter: PromptLookup | None = None,
        adapter_rows: NDArray[np.int64] | None = None,
    ) -> None:
        """`adapter_rows`: the adapter slot of each pool row, as the session binds it (graphs taking adapters)."""
        self._session = session
        self._adapter_rows = adapter_rows
        self._pool = pool
        self._drafter = drafter
        # A decode step's inputs, one entry per pool row; every row below the batch's last is rewritten each step.
        self._input_ids = np.zeros(pool.slots, dtype=np.int64)
        self._lengths = np.ones(pool.slots, dtype=np.int64)

    def execute(self, work: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step; reports, per sequence it ran, the positions now computed and the tokens chosen."""
        if self._adapter_rows is not None:
            self._write_adapter_rows(work)
        steps: list[SequenceStep] = []
        for batch in prefill_runs(work.prefills, self._session.prefills_prompts_together):
            steps.extend(self._prefill(batch))
        if work.decode:
            # Sequences are booked after the step, so passengers' masks take this step's prefill from here.
            computed = {step.seq: step.num_computed for step in steps}
            steps.extend(self._decode(work, computed))
        return ModelRunnerOutput(tuple(steps))

    def _write_adapter_rows(self, work: SchedulerOutput) -> None:
        """Each row this step runs takes its request's adapter (slots move as sequences finish: every step)."""
        assert self._adapter_rows is not None
        rows = self._adapter_rows
        for chunk in work.prefills:
            rows[chunk.group.sequences[0].slot] = chunk.group.adapter_slot
        for seq in (*work.decode, *work.passengers):
            rows[seq.slot] = seq.group.adapter_slot

    def _prefill(self, batch: list[PrefillChunk]) -> list[SequenceStep]:
        first_slot = batch[0].group.sequences[0].slot
        if len(batch) == 1:
            (chunk,) = batch
            prompt = chunk.group.request.prompt_token_ids
            logits = self._session.prefill(first_slot, prompt[chunk.start : chunk.stop], chunk.start)[-1:]
        else:
            prompts = [chunk.group.request.prompt_token_ids[: chunk.stop] for chunk in batch]
            logits = self._session.prefill_prompts(first_slot, prompts)
        steps: list[SequenceStep] = []
        for row, chunk in enumerate(batch):
            steps.extend(self._prefilled(chunk, logits[row : row + 1]))
        return steps

    def _prefilled(self, chunk: PrefillChunk, last_logits: NDArray[np.float32]) -> list[SequenceStep]:
        """A computed chunk (`last_logits`: `[1, vocab]`); once its prompt is complete, every sequence of the
        request gets the prompt's KV in its own slot and samples its first token."""
        sequences = chunk.group.sequences
        leader = sequences[0]
        if not chunk.completes_prompt:
            return [SequenceStep(leader, chunk.stop)]
        for seq in sequences[1:]:
            self._pool.copy(leader.slot, seq.slot, chunk.stop)
        # Every sequence samples its first token from the same last-position logits.
        rows = np.repeat(last_logits, len(sequences), axis=0)
        choices = sample(rows, [s.sampler for s in sequences])
        return [SequenceStep(seq, chunk.stop, (choice,)) for seq, choice in zip(sequences, choices, strict=True)]

    def _decode(self, work: SchedulerOutput, computed: dict[SequenceState, int]) -> list[SequenceStep]:
        """One token for every running sequence over pool rows `0..decode_rows-1`.

        Rows held by sequences still in prefill ride along with a dummy token: their mask covers
        exactly their computed positions (`computed`: as this step's prefill left them) plus one, so the
        step only writes the position their next prefill chunk overwrites anyway.
        """
        rows = work.decode_rows
        if self._drafter is not None and rows == 1:
            (seq,) = work.decode  # one row and a sequence decoding in it: no passengers
            draft = self._drafter.propose(seq, self._pool.max_context - seq.num_computed)
            if draft is not None:
                return [self._verify(seq, draft)]
        input_ids, lengths = self._input_ids[:rows], self._lengths[:rows]
        for seq in work.passengers:
            input_ids[seq.slot] = 0
            lengths[seq.slot] = computed.get(seq, seq.num_computed) + 1
        for seq in work.decode:
            input_ids[seq.slot] = seq.next_token
            lengths[seq.slot] = seq.num_computed + 1
        slots = [seq.slot for seq in work.decode]
        logits = self._session.decode(rows, input_ids, lengths)
        if len(slots) != rows or slots != sorted(slots):
            logits = logits[slots]
        choices = sample(logits, [seq.sampler for seq in work.decode])
        return [SequenceStep(seq, seq.num_computed + 1, (c,)) for seq, c in zip(work.decode, choices, strict=True)]

    def _verify(self, seq: SequenceState, draft: NDArray[np.int64]) -> SequenceStep:
        """Feed `[next token, draft...]` to the one decoding row; chooses 1 + accepted tokens.

        Rejected drafts leave KV past the accepted length, which the mask hides and later steps overwrite.
        """
        assert self._drafter is not None
        logits = self._session.verify([seq.next_token, *draft.tolist()], seq.num_computed)
        choices = self._drafter.accept(logits, seq, draft)
        # KV is computed for the fed token and every accepted draft: one position per choice.
        return SequenceStep(seq, seq.num_computed + len(choices), tuple(choices), drafted=draft.size)

    def compute_prefix(self, token_ids: list[int], chunk: int) -> KVArray:
        """The KV of `token_ids` at positions `0..`, prefilled in a free slot that is released again.

        Runs between steps, so the acquired slot is the last one and releasing it moves nothing.
        """
        if self._pool.free == 0:
            raise EngineError("every KV slot is busy; a prefix can only be computed while one is free")
        slot = self._pool.acquire()
        if self._adapter_rows is not None:
            self._adapter_rows[slot] = 0  # pinned prefixes are the base model's (kv_cache.PrefixCache.match)
        try:
            for start in range(0, len(token_ids), chunk):
                self._session.prefill(slot, token_ids[start : start + chunk], start)
            return self._pool.read(slot, 0, len(token_ids))
        finally:
            self._pool.release(slot, 0)


def prefill_runs(chunks: Sequence[PrefillChunk], together: bool) -> list[list[PrefillChunk]]:
    """Group a step's chunks into session runs: with `together`, first chunks of prompts in consecutive
    slots share one run while the padding to the longest stays within `MAX_PREFILL_PADDING`.

    One run over more rows makes bigger matmuls: two 32-token prompts together take 0.84x the time of
    one after the other, eight 0.74x (prefill graph, 2 threads, measured here).
    """
    runs: list[list[PrefillChunk]] = []
    for chunk in chunks:
        if together and runs and _joins(runs[-1], chunk):
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return runs


def _joins(run: list[PrefillChunk], chunk: PrefillChunk) -> bool:
    # ONNX Runtime's GroupQueryAttention takes several new tokens per row only without past context.
    if chunk.start != 0 or run[0].start != 0:
        return False
    if chunk.group.sequences[0].slot != run[-1].group.sequences[0].slot + 1:
        return False
    lengths = [c.stop for c in (*run, chunk)]
    return max(lengths) * len(lengths) <= (1 + MAX_PREFILL_PADDING) * sum(lengths)
