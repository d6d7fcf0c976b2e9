"""The runner reports, the scheduler books (runtime/engine/runner.py, `Scheduler.update_from_output`).

On a tiny synthetic pool, with a scripted session instead of a model: each forward's logits pick `TOKEN`,
and a prefill writes each token's id into its positions' KV, so a test can read back whose KV a slot holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
from numpy.typing import NDArray

from runtime.engine.kv_cache import KVPool, PrefixCache
from runtime.engine.output import OutputProcessor
from runtime.engine.request import FinishReason, GenerationRequest, SamplingParams, SequenceOutput
from runtime.engine.runner import ModelRunner
from runtime.engine.sampling import SequenceSampler, TokenChoice
from runtime.engine.scheduler import (
    ModelRunnerOutput,
    RequestState,
    Scheduler,
    SequenceState,
    SequenceStatus,
    SequenceStep,
)
from runtime.engine.session import DecoderSession
from runtime.engine.speculative import PromptLookup
from tests.engine.test_kv_cache import FACTS

TOKEN = 7  # what every scripted forward picks
BLOCK = 8


class ScriptedOutput:
    """Stands in for `OutputProcessor`: a sequence ends at `stop_token` or after `max_tokens`."""

    def __init__(self, request_id: str, index: int, max_tokens: int, stop_token: int | None = None) -> None:
        self._request_id, self._index = request_id, index
        self._max_tokens, self._stop_token = max_tokens, stop_token
        self.completion_tokens = 0

    @property
    def remaining_tokens(self) -> int:
        return self._max_tokens - self.completion_tokens

    def process(self, choice: TokenChoice) -> SequenceOutput:
        self.completion_tokens += 1
        ended = choice.token_id == self._stop_token or self.remaining_tokens == 0
        finish = FinishReason.STOP if ended else None
        return SequenceOutput(self._request_id, self._index, (choice.token_id,), "", finish_reason=finish)


class ScriptedSession:
    """Stands in for `DecoderSession` over `pool`: logits `[rows, vocab]` picking `TOKEN`; records decode masks."""

    prefills_prompts_together = False

    def __init__(self, pool: KVPool) -> None:
        self._pool = pool
        self.decode_lengths: list[list[int]] = []

    def prefill(self, slot: int, token_ids: Sequence[int], past: int) -> NDArray[np.float32]:
        for tensor in self._pool.tensors:
            tensor[slot, :, past : past + len(token_ids)] = np.asarray(token_ids, dtype=np.float32)[None, :, None]
        return self._logits(len(token_ids))

    def decode(self, rows: int, token_ids: NDArray[np.int64], lengths: NDArray[np.int64]) -> NDArray[np.float32]:
        self.decode_lengths.append(lengths[:rows].tolist())
        return self._logits(rows)

    @staticmethod
    def _logits(rows: int) -> NDArray[np.float32]:
        logits = np.zeros((rows, FACTS.vocab_size), dtype=np.float32)
        logits[:, TOKEN] = 1.0
        return logits


def setup(slots: int = 4, prefill_chunk: int = 8) -> tuple[Scheduler, ModelRunner, ScriptedSession]:
    pool = KVPool(FACTS, slots=slots, max_context=64)
    cache = PrefixCache(block_size=BLOCK, capacity_bytes=1 << 20)
    session = ScriptedSession(pool)
    runner = ModelRunner(cast(DecoderSession, session), pool)
    return Scheduler(pool, cache, max_queue=16, prefill_chunk=prefill_chunk), runner, session


def submit(sched: Scheduler, name: str, prompt_len: int, max_tokens: int = 8, n: int = 1) -> RequestState:
    prompt = tuple(range(10, 10 + prompt_len))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, n=n)
    group = RequestState(GenerationRequest(name, prompt, params), submitted_at=0.0)
    group.sequences = [
        SequenceState(
            group, i, SequenceSampler(params, prompt, i), cast(OutputProcessor, ScriptedOutput(name, i, max_tokens))
        )
        for i in range(n)
    ]
    sched.add(group)
    return group


def state(seq: SequenceState) -> tuple[object, ...]:
    return seq.status, seq.slot, seq.num_computed, seq.next_token, tuple(seq.sampler.output_token_ids)


def test_the_runner_reports_without_changing_a_sequence_and_the_scheduler_books_it() -> None:
    sched, runner, _ = setup()
    group = submit(sched, "a", prompt_len=4, n=2)
    work = sched.schedule()
    before = [state(seq) for seq in group.sequences]
    output = runner.execute(work)
    assert [state(seq) for seq in group.sequences] == before
    assert output == ModelRunnerOutput(tuple(SequenceStep(seq, 4, (TokenChoice(TOKEN),)) for seq in group.sequences))
    booked = sched.update_from_output(output)
    assert [(t.seq, t.output.token_ids, t.completes_request) for t in booked] == [
        (seq, (TOKEN,), False) for seq in group.sequences
    ]
    for seq in group.sequences:
        assert (seq.status, seq.num_computed, seq.next_token) == (SequenceStatus.RUNNING, 4, TOKEN)
        assert seq.sampler.output_token_ids == [TOKEN]


def test_a_passenger_rides_along_at_the_length_this_steps_prefill_left_it() -> None:
    sched, runner, session = setup()
    a, b, c = submit(sched, "a", 4), submit(sched, "b", 20), submit(sched, "c", 4)  # slots 0, 1, 2
    sched.update_from_output(runner.execute(sched.schedule()))  # a and c prefilled, b to position 8
    work = sched.schedule()
    assert work.passengers == (b.sequences[0],) and [(ch.start, ch.stop) for ch in work.prefills] == [(8, 16)]
    sched.update_from_output(runner.execute(work))
    # Row 1's dummy token goes at position 16, past the chunk just computed (not at 8, inside it).
    assert session.decode_lengths == [[5, 17, 5]]
    assert [s.sequences[0].num_computed for s in (a, b, c)] == [5, 16, 5]


def test_a_prompt_is_cached_from_its_slot_before_a_finished_sequence_moves_it() -> None:
    sched, runner, _ = setup(prefill_chunk=16)
    short = submit(sched, "short", 4, max_tokens=1)  # slot 0, finished by its first token
    long = submit(sched, "long", 16)  # slot 1: moves into slot 0 when `short` frees it
    sched.update_from_output(runner.execute(sched.schedule()))
    assert short.finished and long.sequences[0].slot == 0 and long.sequences[0].num_computed == 16
    prompt = long.request.prompt_token_ids
    blocks = sched.prefix_cache.match((*prompt, 0))
    assert [int(b[0, 0, 0, 0]) for b in blocks] == [prompt[0], prompt[BLOCK]]
    # The move copied every computed position of the prompt along with the slot.
    assert sched.pool.tensors[0][0, 0, :16, 0].tolist() == list(prompt)


def test_prompts_are_not_cached_while_caching_them_is_off() -> None:
    sched, runner, _ = setup()
    sched.cache_prompt_kv = False
    submit(sched, "a", 16)
    sched.update_from_output(runner.execute(sched.schedule()))
    assert len(sched.prefix_cache) == 0


def test_a_verify_books_tokens_up_to_the_one_that_ends_the_sequence() -> None:
    sched, runner, _ = setup()
    group = submit(sched, "v", 4)
    (seq,) = group.sequences
    seq.output = cast(OutputProcessor, ScriptedOutput("v", 0, max_tokens=8, stop_token=9))
    sched.update_from_output(runner.execute(sched.schedule()))
    tokens = tuple(TokenChoice(t) for t in (5, 9, 11, 13))  # three drafts accepted, the stop token second
    booked = sched.update_from_output(ModelRunnerOutput((SequenceStep(seq, 4 + 4, tokens, drafted=3),)))
    assert [(t.output.token_ids, t.completes_request) for t in booked] == [((5,), False), ((9,), True)]
    assert seq.sampler.output_token_ids == [TOKEN, 5, 9]
    assert seq.status is SequenceStatus.FINISHED and seq.slot == -1 and sched.pool.active == 0
    assert (seq.draft.attempts, seq.draft.drafted, seq.draft.accepted) == (1, 3, 3)


def test_acceptance_penalizes_the_drafts_it_accepted_without_booking_them() -> None:
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    group = RequestState(GenerationRequest("p", (1, 2, 3), params), submitted_at=0.0)
    seq = SequenceState(group, 0, SequenceSampler(params, (1, 2, 3)), cast(OutputProcessor, None))
    logits = np.zeros((3, FACTS.vocab_size), dtype=np.float32)
    logits[0, 5] = 4.0
    logits[1, 5], logits[1, 6] = 3.0, 2.0  # 5 wins unless the accepted 5 counts: then 3.0 / 2 < 2.0
    logits[2, 5] = 4.0
    drafter = PromptLookup(max_draft=2)
    choices = drafter.accept(logits, seq, np.array([5, 5], dtype=np.int64))
    assert [c.token_id for c in choices] == [5, 6]
    assert seq.sampler.output_token_ids == [] and seq.draft.attempts == 0
    assert (drafter.stats.steps, drafter.stats.drafted, drafter.stats.accepted) == (1, 2, 1)
