"""One request's engine work: submit its prompts, merge their output streams, count usage, cancel.

A `Generation` is cancelled as a whole whenever its request ends early (client disconnect, error,
shutdown), so the engine frees the slots within one step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from runtime.api.errors import APIError, from_engine_error
from runtime.api.metrics import RequestTimer
from runtime.engine.request import (
    EngineError,
    EngineOverloadedError,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    SequenceOutput,
)

if TYPE_CHECKING:
    from runtime.engine.engine import Engine
    from runtime.engine.grammar_cache import CompiledGrammar
    from runtime.engine.stream import RequestStream

_DONE = object()


class Generation:
    """The engine streams of one request, one per prompt; outputs are tagged with their prompt index."""

    def __init__(
        self,
        engine: Engine,
        requests: Sequence[GenerationRequest],
        timer: RequestTimer,
        *,
        prompt_param: str,
        grammar: CompiledGrammar | None = None,
    ) -> None:
        """`grammar`: the requests' grammar, compiled off the event loop beforehand (api/grammar_compile.py)."""
        self._timer = timer
        self._streams: list[RequestStream] = []
        self._ended: set[int] = set()
        self._prompt_tokens: dict[int, int] = {}
        self._completion_tokens: dict[tuple[int, int], int] = {}
        try:
            for request in requests:
                self._streams.append(engine.submit(request, prompt_param=prompt_param, grammar=grammar))
        except (InvalidRequestError, EngineOverloadedError) as exc:
            # A later prompt failed: the earlier ones must not keep running for nobody.
            self.cancel()
            raise from_engine_error(exc) from exc

    def cancel(self) -> None:
        """Abort what is still running; streams that ended on their own cost the engine nothing more."""
        for index, stream in enumerate(self._streams):
            if index not in self._ended:
                stream.cancel()

    @property
    def usage(self) -> dict[str, int]:
        prompt = sum(self._prompt_tokens.values())
        completion = sum(self._completion_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def outputs(self) -> AsyncIterator[tuple[int, SequenceOutput]]:
        """Every output of every prompt as it arrives; raises a 503 if the engine aborted a sequence."""
        try:
            if len(self._streams) == 1:  # the common case, without the merging generator's hop per output
                async for output in self._streams[0]:
                    yield self._account(0, output)
                self._ended.add(0)
            else:
                async for prompt_index, output in self._merged():
                    yield self._account(prompt_index, output)
        except EngineError as exc:
            raise APIError(500, str(exc), error_type="server_error") from exc

    def _account(self, prompt_index: int, output: SequenceOutput) -> tuple[int, SequenceOutput]:
        self._timer.observe(prompt_index, output)
        self._prompt_tokens[prompt_index] = output.prompt_tokens
        key = (prompt_index, output.index)
        self._completion_tokens[key] = max(self._completion_tokens.get(key, 0), output.completion_tokens)
        if output.finish_reason is FinishReason.ABORT:
            raise APIError(
                503, "the request was aborted by the server (shutting down)", error_type="service_unavailable"
            )
        return prompt_index, output

    async def _merged(self) -> AsyncIterator[tuple[int, SequenceOutput]]:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
            except Exception as exc:
                queue.put_nowait((index, exc))
            else:
                queue.put_nowait((index, _DONE))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self._streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is _DONE:
                    self._ended.add(index)
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
