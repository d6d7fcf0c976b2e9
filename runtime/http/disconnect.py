"""Stop work the moment the client goes away, streaming or not.

Starlette's `StreamingResponse` only notices a disconnect on ASGI servers older than spec 2.4, and on newer
ones only when the next send fails; these helpers watch `http.disconnect` explicitly so a dropped client
frees its engine slot within one step whatever the server.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `work` until it finishes or the client disconnects; returns (finished, result).

    `work` must clean up after itself when cancelled (the engine requests it submitted).
    """
    outcome: list[T] = []
    failure: list[BaseException] = []

    async def run(scope: anyio.CancelScope) -> None:
        try:
            outcome.append(await work())
        except Exception as exc:  # re-raised below, outside the task group, so it is not wrapped in a group
            failure.append(exc)
        scope.cancel()

    async def watch(scope: anyio.CancelScope) -> None:
        await wait_for_disconnect(receive)
        scope.cancel()

    async with anyio.create_task_group() as group:
        group.start_soon(run, group.cancel_scope)
        group.start_soon(watch, group.cancel_scope)
    if failure:
        raise failure[0]
    return (True, outcome[0]) if outcome else (False, None)


class CancellableStream(Response):
    """A streamed body whose generator is closed as soon as the client disconnects or the stream ends.

    The generator's `finally` is where the engine requests get cancelled, so it must always run promptly.
    """

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        *,
        media_type: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.chunks = chunks
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def stream(scope: anyio.CancelScope) -> None:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            scope.cancel()

        async def watch(scope: anyio.CancelScope) -> None:
            await wait_for_disconnect(receive)
            scope.cancel()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(stream, group.cancel_scope)
                group.start_soon(watch, group.cancel_scope)
        finally:
            with anyio.CancelScope(shield=True):
                await self.chunks.aclose()
