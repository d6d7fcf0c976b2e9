"""Waiting for a grammar off the event loop (api/grammar_compile.py): a slow compile is a 400, a busy
compiler a 429, and the event loop runs on meanwhile. Real grammar threads, timed with real sleeps."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from runtime.api.errors import APIError
from runtime.api.grammar_compile import _wait_for_grammar_thread
from runtime.engine.grammar_cache import GrammarBudget, Grammars

LIMIT_S = 0.2


def grammars() -> Grammars:
    # No grammar is compiled here, so the tokenizer is never read.
    return Grammars(Path("unused-tokenizer.json"), 1, [0], GrammarBudget(compile_s=LIMIT_S))


def test_a_compile_past_the_limit_is_a_400_and_the_loop_kept_running() -> None:
    service = grammars()

    async def scenario() -> tuple[APIError, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        with pytest.raises(APIError) as slow:
            await _wait_for_grammar_thread(service, lambda: time.sleep(1.0), "guided_grammar")
        ticker.cancel()
        return slow.value, ticks

    error, ticks = asyncio.run(scenario())
    assert (error.status, error.param) == (400, "guided_grammar")
    assert error.message == "'guided_grammar' took longer than 0.2 s to compile; use a smaller or simpler grammar"
    # The loop kept ticking while the thread worked (~19 ticks idle; a loop the compile blocked gets 0 or 1).
    assert ticks >= 3


def test_a_compile_still_waiting_for_its_turn_is_a_429_and_never_runs() -> None:
    service = grammars()
    release, ran = threading.Event(), threading.Event()
    holder = service.submit(release.wait)
    try:
        with pytest.raises(APIError) as busy:
            asyncio.run(_wait_for_grammar_thread(service, ran.set, "response_format"))
        assert (busy.value.status, busy.value.code) == (429, "engine_overloaded")
        assert busy.value.headers == {"Retry-After": "1"}
    finally:
        release.set()
    assert holder.result(timeout=10) is True
    assert service.submit(lambda: None).result(timeout=10) is None  # the line has moved on...
    assert not ran.is_set()  # ...without the cancelled one
