"""Overload and disconnects on a one-slot, one-queue-place engine: 429 + Retry-After, and freed slots."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from runtime.engine.engine import EngineConfig
from runtime.http.state import ServerSettings
from tests.server.conftest import RunningServer, engine_loader, policy_for, serve_in_thread

pytestmark = pytest.mark.real_model

LONG = 400  # tokens: far more than a test ever waits for


@pytest.fixture(scope="module")
def tight(demo_bundle: Path) -> Iterator[RunningServer]:
    settings = ServerSettings(policy=policy_for(demo_bundle, max_tokens_limit=LONG))
    config = EngineConfig(max_batch=1, max_queue=1, max_context=512)
    with serve_in_thread(settings, engine_loader(demo_bundle, config)) as running:
        yield running


def long_chat(server: RunningServer, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Count to one thousand."}]
    model = server.state.policy.model_name
    return {"model": model, "messages": messages, "max_tokens": LONG, "ignore_eos": True, **extra}


def wait_idle(server: RunningServer, timeout: float = 10.0) -> int:
    """Poll until no request holds a slot or waits; returns the engine steps it took."""
    start_steps = server.engine.stats().steps
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.engine.stats()
        if stats.running == 0 and stats.queued == 0:
            return stats.steps - start_steps
        time.sleep(0.002)
    raise AssertionError(f"the engine is still busy after {timeout} s: {server.engine.stats()}")


def read_chunks(response: httpx.Response, count: int) -> Iterator[str]:
    """Read `count` SSE chunks; the caller keeps the returned iterator alive (closing it drops the connection)."""
    lines = response.iter_lines()
    seen = 0
    while seen < count:
        if next(lines).startswith("data: {"):
            seen += 1
    return lines


def test_disconnect_mid_stream_frees_the_slot_within_a_few_steps(tight: RunningServer) -> None:
    tokens_before = tight.engine.stats().tokens_out
    with (
        httpx.Client(base_url=tight.url, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=long_chat(tight, stream=True)) as response,
    ):
        lines = read_chunks(response, 4)
        assert tight.engine.stats().running == 1
        del lines
    # A step is a few ms here: the bound leaves the server's loop thread room to be descheduled on a loaded
    # machine, far below the LONG - 4 steps a slot kept by a gone client would take.
    assert wait_idle(tight) <= 12
    assert tight.engine.stats().tokens_out - tokens_before < LONG // 2


def test_disconnect_while_waiting_for_a_whole_reply_frees_the_slot(tight: RunningServer) -> None:
    tokens_before = tight.engine.stats().tokens_out
    timeout = httpx.Timeout(60, read=1.0)
    with httpx.Client(base_url=tight.url, timeout=timeout) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=long_chat(tight))
    assert wait_idle(tight) <= 12
    assert tight.engine.stats().tokens_out - tokens_before < LONG


def test_a_full_queue_answers_429_with_retry_after(tight: RunningServer) -> None:
    client = openai.OpenAI(base_url=tight.url + "/v1", api_key="unused", max_retries=0)
    body = long_chat(tight)
    extension = {"ignore_eos": body.pop("ignore_eos")}
    as_openai_call = {**body, "extra_body": extension}
    with (
        httpx.Client(base_url=tight.url, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=long_chat(tight, stream=True)) as running,
    ):
        lines = read_chunks(running, 2)  # holds the only slot
        with http.stream("POST", "/v1/chat/completions", json=long_chat(tight, stream=True)) as queued:
            assert queued.status_code == 200
            assert tight.engine.stats().queued == 1
            with pytest.raises(openai.RateLimitError) as caught:
                client.chat.completions.create(**as_openai_call)
        # The queued request's client left before it ever got a slot: it must leave the queue too.
        deadline = time.monotonic() + 5
        while tight.engine.stats().queued and time.monotonic() < deadline:
            time.sleep(0.005)
        assert tight.engine.stats().queued == 0
        assert next(line for line in lines if line).startswith("data: {")  # the first request kept its slot
    error = caught.value
    assert error.status_code == 429
    assert error.type == "rate_limit_error"
    assert error.code == "engine_overloaded"
    assert int(error.response.headers["retry-after"]) >= 1
    wait_idle(tight)
    reply = client.chat.completions.create(**{**as_openai_call, "max_tokens": 2})
    assert reply.usage is not None and reply.usage.completion_tokens == 2
