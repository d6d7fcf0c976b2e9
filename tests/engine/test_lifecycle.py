"""Admission, cancellation, back-pressure and request validation on a real engine."""

from __future__ import annotations

import asyncio

import pytest

from runtime.bundle import Bundle
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.request import (
    EngineOverloadedError,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)
from runtime.engine.tokenizer import Tokenizer
from tests.engine.conftest import chat_ids

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def stepped(bundle: Bundle) -> Engine:
    """An engine that is never started: the test drives it with `step()`."""
    return Engine(bundle, EngineConfig(max_batch=2, max_queue=2, max_context=128, prefill_chunk=16))


def _drain(engine: Engine) -> None:
    while engine.stats().queued or engine.stats().running:
        engine.step()


def test_cancellation_frees_the_slot_within_one_step(stepped: Engine, tokenizer: Tokenizer) -> None:
    prompt = chat_ids(tokenizer, "Count from one to fifty.")
    long = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    first = stepped.submit(GenerationRequest("cancel-a", prompt, long))
    second = stepped.submit(GenerationRequest("cancel-b", prompt, long))
    for _ in range(6):
        stepped.step()
    stats = stepped.stats()
    assert stats.running == 2 and stats.kv_used_bytes > 0
    first.cancel()
    stepped.step()
    stats = stepped.stats()
    assert stats.running == 1
    assert stats.kv_used_bytes < 70 * stepped._pool.bytes_per_token  # only `second`'s tokens remain
    outputs = list(first)
    assert outputs[-1].finish_reason is FinishReason.ABORT
    # A queued request can be admitted into the freed slot while `second` keeps going.
    third = stepped.submit(GenerationRequest("cancel-c", prompt, SamplingParams(max_tokens=4, temperature=0)))
    stepped.step()
    assert stepped.stats().running == 2
    _drain(stepped)
    assert next(o for o in reversed(list(second)) if o.finish_reason).finish_reason is FinishReason.LENGTH
    assert sum(len(o.token_ids) for o in third) == 4


def test_a_cancelled_request_ends_every_one_of_its_sequences(stepped: Engine, tokenizer: Tokenizer) -> None:
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=1, n=2, ignore_eos=True)
    stream = stepped.submit(GenerationRequest("cancel-n", chat_ids(tokenizer, "Count to ten."), params))
    for _ in range(4):
        stepped.step()
    stream.cancel()
    stepped.step()
    ends = [(o.index, o.finish_reason) for o in stream if o.finish_reason is not None]
    assert ends == [(0, FinishReason.ABORT), (1, FinishReason.ABORT)]
    assert stepped.stats().running == 0


def test_full_queue_raises_overloaded_with_retry_after(stepped: Engine, tokenizer: Tokenizer) -> None:
    prompt = chat_ids(tokenizer, "hi")
    params = SamplingParams(max_tokens=2, temperature=0)
    stepped.submit(GenerationRequest("q-1", prompt, params))
    stepped.submit(GenerationRequest("q-2", prompt, params))
    with pytest.raises(EngineOverloadedError) as excinfo:
        stepped.submit(GenerationRequest("q-3", prompt, params))
    assert excinfo.value.retry_after > 0
    stepped.abort("q-1")
    stepped.step()  # the abort empties one queue place before admission refills slots
    stepped.submit(GenerationRequest("q-3", prompt, params))
    _drain(stepped)


def test_abort_of_a_queued_request_ends_its_stream(stepped: Engine, tokenizer: Tokenizer) -> None:
    prompt = chat_ids(tokenizer, "hi")
    params = SamplingParams(max_tokens=3, temperature=0)
    busy = [stepped.submit(GenerationRequest(f"busy-{i}", prompt, params)) for i in range(2)]
    stepped.step()
    queued = stepped.submit(GenerationRequest("queued", prompt, params))
    assert stepped.stats().queued == 1
    queued.cancel()
    stepped.step()
    assert [o.finish_reason for o in queued] == [FinishReason.ABORT]
    _drain(stepped)
    assert all(sum(len(o.token_ids) for o in s) == 3 for s in busy)


def test_context_length_exceeded(stepped: Engine) -> None:
    prompt = tuple(range(100, 200))
    with pytest.raises(InvalidRequestError) as excinfo:
        stepped.submit(GenerationRequest("ctx", prompt, SamplingParams(max_tokens=29)), prompt_param="messages")
    assert excinfo.value.code == "context_length_exceeded"
    assert excinfo.value.param == "messages"
    assert "128" in str(excinfo.value)
    stepped.submit(GenerationRequest("ctx-ok", prompt, SamplingParams(max_tokens=28, temperature=0)))
    _drain(stepped)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-0.5), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(presence_penalty=3.0), "presence_penalty"),
        (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
        (SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={5: 500.0}), "logit_bias"),
        (SamplingParams(n=3), "n"),
        (SamplingParams(top_logprobs=3), "top_logprobs"),
        (SamplingParams(stop=("",)), "stop"),
        (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
    ],
)
def test_bad_sampling_values_name_their_parameter(stepped: Engine, params: SamplingParams, param: str) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        stepped.submit(GenerationRequest("bad", (1, 2, 3), params))
    assert excinfo.value.param == param
    assert stepped.stats().queued == 0


def test_bad_prompts_are_rejected(stepped: Engine) -> None:
    with pytest.raises(InvalidRequestError) as empty:
        stepped.submit(GenerationRequest("empty", ()), prompt_param="messages")
    assert empty.value.param == "messages"
    with pytest.raises(InvalidRequestError) as outside:
        stepped.submit(GenerationRequest("oov", (1, 10**7), SamplingParams(max_tokens=1)))
    assert outside.value.param == "prompt"


def test_async_iteration_and_timings(engine: Engine, tokenizer: Tokenizer) -> None:
    prompt = chat_ids(tokenizer, "Say something.")

    async def consume() -> list[str]:
        stream = engine.submit(GenerationRequest("async", prompt, SamplingParams(max_tokens=8, temperature=0)))
        texts = [out.text async for out in stream]
        assert stream.first_output_at is not None and stream.first_output_at > stream.submitted_at
        return texts

    texts = asyncio.run(consume())
    sync = engine.generate(GenerationRequest("sync", prompt, SamplingParams(max_tokens=8, temperature=0)))[0]
    assert "".join(texts) == sync.text


def test_on_step_reports_ttft_and_time_per_token(bundle: Bundle, tokenizer: Tokenizer) -> None:
    reports = []
    eng = Engine(bundle, EngineConfig(max_batch=2, max_context=128), on_step=reports.append)
    prompt = chat_ids(tokenizer, "hi")
    eng.submit(GenerationRequest("timed", prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))
    _drain(eng)
    assert sum(len(r.first_tokens) for r in reports) == 1
    (timing,) = [t for r in reports for t in r.finished]
    assert timing.completion_tokens == 5 and timing.prompt_tokens == len(prompt)
    assert timing.time_to_first_token > 0 and timing.time_per_output_token > 0
    assert [r.batch_size for r in reports] == [0, 1, 1, 1, 1]
