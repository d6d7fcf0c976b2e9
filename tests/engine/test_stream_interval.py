"""Decoding on between deliveries (`EngineConfig.stream_interval_s`): same tokens, and new work still gets in.

The engine here has an interval far longer than any test, so only a finish, a new request or a cancellation
can end a run of repeated steps: each test fails if the engine missed the one it is about.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from runtime.bundle import Bundle
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.reports import StepReport
from runtime.engine.request import FinishReason, GenerationRequest, SamplingParams, SequenceOutput
from runtime.engine.stream import RequestStream
from runtime.engine.tokenizer import Tokenizer
from tests.engine.conftest import chat_ids

pytestmark = pytest.mark.real_model

LONG_INTERVAL_S = 300.0


def _config(bundle: Bundle, interval: float) -> EngineConfig:
    kv = 2 * 256 * bundle.manifest.model.kv_bytes_per_token()
    return EngineConfig(max_batch=2, max_context=256, kv_memory_bytes=kv, stream_interval_s=interval)


@pytest.fixture(scope="module")
def reports() -> list[StepReport]:
    return []


@pytest.fixture(scope="module")
def patient(bundle: Bundle, reports: list[StepReport]) -> Iterator[Engine]:
    engine = Engine(bundle, _config(bundle, LONG_INTERVAL_S), on_step=reports.append)
    engine.start()
    yield engine
    engine.shutdown()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class _Reader(threading.Thread):
    """Reads a stream to its end, noting when it ended."""

    def __init__(self, stream: RequestStream) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.outputs: list[SequenceOutput] = []
        self.ended_at = 0.0

    def run(self) -> None:
        self.outputs.extend(self.stream)
        self.ended_at = time.perf_counter()

    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]


def test_a_lone_stream_gets_its_tokens_in_one_delivery_and_the_same_tokens(
    bundle: Bundle, patient: Engine, reports: list[StepReport], tokenizer: Tokenizer
) -> None:
    prompt = chat_ids(tokenizer, "Name the planets of the solar system.")
    reports.clear()
    (alone,) = patient.generate(GenerationRequest("lone", prompt, _greedy(40)))
    # The prompt's step gives the first token; every other token comes from one run of repeated steps.
    assert [r.decode_tokens for r in reports] == [0, 39]
    assert alone.finish_reason is FinishReason.LENGTH and len(alone.token_ids) == 40
    every_step = Engine(bundle, _config(bundle, 0.0))
    try:
        (reference,) = every_step.generate(GenerationRequest("lone", prompt, _greedy(40)))
    finally:
        every_step.shutdown()
    assert alone.token_ids == reference.token_ids and alone.text == reference.text


def test_a_request_arriving_mid_run_is_admitted_at_the_next_step(patient: Engine, tokenizer: Tokenizer) -> None:
    prompt = chat_ids(tokenizer, "Write a long story about a lighthouse keeper.")
    first = patient.submit(GenerationRequest("long-a", prompt, _greedy(200)))
    next(iter(first))  # the prompt's token: `first` now decodes on in repeated steps
    late = _Reader(patient.submit(GenerationRequest("late-b", chat_ids(tokenizer, "Say hi."), _greedy(4))))
    early = _Reader(first)
    late.start()
    early.start()
    late.join(60)
    early.join(60)
    assert len(late.tokens()) == 4 and len(early.tokens()) == 199
    assert late.ended_at < early.ended_at  # without the check for waiting requests, `late` waits for all 200


def test_a_cancel_mid_run_ends_the_stream_at_the_next_step(patient: Engine, tokenizer: Tokenizer) -> None:
    stream = patient.submit(GenerationRequest("cancel-mid-run", chat_ids(tokenizer, "Count to 200."), _greedy(200)))
    next(iter(stream))
    time.sleep(0.2)  # well into the run of repeated steps, which takes seconds to reach max_tokens
    stream.cancel()
    rest = list(stream)
    # Without the check for cancellations the run goes on to max_tokens and ends with `length`.
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert 1 < rest[-1].completion_tokens < 200
    assert patient.stats().running == 0
