"""How much prefill work a step takes (runtime/engine/scheduler.py), on a real slot pool and prefix cache."""

from __future__ import annotations

from typing import cast

from runtime.engine.kv_cache import KVPool, PrefixCache
from runtime.engine.output import OutputProcessor
from runtime.engine.request import GenerationRequest, SamplingParams
from runtime.engine.sampling import SequenceSampler
from runtime.engine.scheduler import RequestState, Scheduler, SequenceState, SequenceStatus, prefill_budget
from tests.engine.test_kv_cache import FACTS

CHUNK = 16


def scheduler() -> Scheduler:
    pool = KVPool(FACTS, slots=8, max_context=64)
    return Scheduler(pool, PrefixCache(block_size=8, capacity_bytes=0), max_queue=16, prefill_chunk=CHUNK)


def submit(sched: Scheduler, name: str, prompt_len: int) -> RequestState:
    prompt = tuple(range(1, prompt_len + 1))
    group = RequestState(GenerationRequest(name, prompt, SamplingParams(max_tokens=8)), submitted_at=0.0)
    sampler = SequenceSampler(group.request.sampling, prompt, 0, None)
    # These tests book no tokens, so nothing reads the sequence's output processor.
    group.sequences = [SequenceState(group, 0, sampler, cast(OutputProcessor, None))]
    sched.add(group)
    return group


def decoding(sched: Scheduler, count: int) -> None:
    """`count` requests admitted and prefilled, as booking their prompts leaves them: each now decodes."""
    for i in range(count):
        submit(sched, f"running-{i}", 4)
    sched.schedule()
    for group in sched.running:
        (seq,) = group.sequences
        seq.status, seq.num_computed = SequenceStatus.RUNNING, 4


def chunks(sched: Scheduler) -> list[tuple[str, int, int]]:
    work = sched.schedule()
    return [(c.group.request.request_id, c.start, c.stop) for c in work.prefills]


def test_with_nothing_decoding_every_prompt_gets_a_chunk() -> None:
    sched = scheduler()
    for name in "abc":
        submit(sched, name, 40)
    assert chunks(sched) == [("a", 0, 16), ("b", 0, 16), ("c", 0, 16)]


def test_many_running_streams_are_held_up_by_one_chunk() -> None:
    sched = scheduler()
    decoding(sched, 4)
    submit(sched, "a", 40)
    submit(sched, "b", 10)
    assert chunks(sched) == [("a", 0, 16)]


def test_a_burst_behind_one_running_stream_is_prefilled_together() -> None:
    # The first request of a burst started alone; the other five arrived during its prefill.
    sched = scheduler()
    decoding(sched, 1)
    for name in "abcde":
        submit(sched, name, 12)
    assert chunks(sched) == [(name, 0, 12) for name in "abcde"]


def test_the_budget_grows_with_the_prompts_waiting_per_running_stream() -> None:
    assert prefill_budget(CHUNK, prefilling=3, decoding=0) == 3 * CHUNK
    assert prefill_budget(CHUNK, prefilling=0, decoding=0) == 0
    assert prefill_budget(CHUNK, prefilling=1, decoding=7) == CHUNK
    assert prefill_budget(CHUNK, prefilling=4, decoding=4) == CHUNK
    assert prefill_budget(CHUNK, prefilling=5, decoding=2) == 3 * CHUNK
