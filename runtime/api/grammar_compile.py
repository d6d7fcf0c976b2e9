"""A chat request's grammar, built, checked and compiled before the request is queued, off the event loop.

Issue 37: a 924 KB Lark grammar held `/health` for 19 s while it was validated and compiled on the event
loop, then came back as a 400 quoting a Rust panic and its backtrace. Now parsing only checks a grammar's
size (api/protocol.py); everything that can take time (GBNF conversion is pure Python, validation
and compiling are llguidance's) runs on the engine's grammar thread (`Grammars.submit`), and the handler
waits `GrammarBudget.compile_s` at most:

- a compile that started but has not finished by then: 400, the grammar "took too long" (it runs on to
  its end within llguidance's limits, and is cached if it succeeds);
- one still waiting for the thread: 429 (`engine_overloaded`), as when `_MAX_PENDING` are waiting:
  other requests' grammars are in the way, and a retry may succeed.

Errors name the field the grammar came from and carry one plain line (`constraints.plain_message`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from runtime.api.errors import from_engine_error, invalid_param
from runtime.api.structured_output import GrammarSource
from runtime.api.tools import check_schemas
from runtime.engine.constraints import plain_message
from runtime.engine.grammar_cache import CompiledGrammar, GrammarError, Grammars
from runtime.engine.request import EngineOverloadedError

if TYPE_CHECKING:
    from runtime.api.protocol import ChatRequest
    from runtime.api.service import ModelService

T = TypeVar("T")


async def resolve_grammar(state: ModelService, parsed: ChatRequest) -> ChatRequest:
    """`parsed`, ready to queue: its grammar built and compiled (or found cached); a 400 if it cannot be used."""
    source = parsed.grammar_source
    if source is None:
        return parsed
    grammars = state.require_engine().grammars  # 503 / 429 before any work, as the submit would
    compiled = await _wait_for_grammar_thread(grammars, partial(_build_and_compile, grammars, source), source.param)
    sampling = replace(parsed.sampling, grammar=compiled.text if compiled is not None else None)
    return replace(parsed, sampling=sampling, grammar_source=None, grammar=compiled)


def _build_and_compile(grammars: Grammars, source: GrammarSource) -> CompiledGrammar | None:
    """On the grammar thread."""
    tools = source.tools
    if tools is not None and not tools.active:
        check_schemas(tools)  # OpenAI refuses an unusable schema whatever the choice
    try:
        text = source.build()
        return grammars.compile(text) if text is not None else None
    except (ValueError, TypeError, GrammarError) as exc:  # TypeError: a msgpack body's bytes in a schema
        if tools is not None and tools.active:
            check_schemas(tools)  # raises naming `tools[i].function.parameters` when one function is at fault
        problem = exc.problem if isinstance(exc, GrammarError) else plain_message(str(exc))
        raise invalid_param(source.param, f"invalid {source.param}: {problem}") from None


async def _wait_for_grammar_thread(grammars: Grammars, work: Callable[[], T], param: str) -> T:
    try:
        future = grammars.submit(work)
    except EngineOverloadedError as exc:
        raise from_engine_error(exc) from exc
    limit = grammars.budget.compile_s
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), limit)
    except TimeoutError:
        if future.cancel():  # it never started: the thread was busy with other requests' grammars
            busy = EngineOverloadedError("other requests' grammars are compiling; retry shortly", retry_after=limit)
            raise from_engine_error(busy) from None
        raise invalid_param(
            param, f"'{param}' took longer than {limit:g} s to compile; use a smaller or simpler grammar"
        ) from None
