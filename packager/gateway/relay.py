"""One request relayed to a function's server, and its answer back as it comes, in raw ASGI.

This runs once per streamed token, so it is kept thin (measured: gateway CPU per token, 8 streams): the
body chunks that came from the server since the last look go out in one ASGI message (upstream.py), with no
Starlette response object or per-chunk task in between. A client that goes away closes the connection to
the server, which then stops generating for it, as it would for a direct client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from packager.gateway.functions import Function
from packager.gateway.upstream import UpstreamError
from runtime.api.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("onnxfn.gateway")
MAX_BODY_BYTES = 32 << 20  # well above any server's own limit, which answers 413 itself
# Per connection, not per message: never relayed (RFC 9110 7.6.1); `host` and `content-length` are set anew.
HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
     b"transfer-encoding", b"upgrade", b"host", b"content-length")
)  # fmt: skip
NOT_RELAYED_BACK = (HOP_BY_HOP - {b"content-length"}) | {b"date", b"server"}  # uvicorn writes its own
WOKE_HEADER = b"x-onnxfn-woke"  # on a response that waited for its function to start again: how, how long


class Disconnected(Exception):
    """The client went away before its request was read."""


async def read_body(receive: Receive) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def relay(function: Function, scope: Scope, receive: Receive, send: Send, body: bytes, woke: str) -> None:
    """Send the request to the function's server and its answer to the client; an APIError before any of the
    answer went out (the server does not answer)."""
    headers = [(name, value) for name, value in scope["headers"] if name not in HOP_BY_HOP]
    target = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    pool = function.pool()  # the connection goes back where it came from, even if the server moved meanwhile
    function.in_flight += 1  # before any await: the idle check must see it at once
    try:
        try:
            upstream = await pool.request(scope["method"], target.decode("latin-1"), headers, body)
        except (OSError, TimeoutError, UpstreamError) as exc:
            raise APIError(
                503,
                f"the server of {function.name} does not answer at {function.deployment.url} ({exc}); "
                f"`pkg status {function.deployment.function_dir}` says why, and `pkg deploy` starts it again",
                error_type="server_error",
                code="function_unavailable",
            ) from exc
        answer = [(name, value) for name, value in upstream.headers if name not in NOT_RELAYED_BACK]
        if woke:
            answer.append((WOKE_HEADER, woke.encode()))
        await send({"type": "http.response.start", "status": upstream.status, "headers": answer})

        async def watch() -> None:  # the client going away closes the server's connection: it stops too
            while (await receive())["type"] != "http.disconnect":
                pass
            upstream.close()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            while data := await upstream.chunks():
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except UpstreamError as exc:
            if not watcher.done():
                log.warning("%s: the server's answer broke off: %s", function.name, exc)
        finally:
            watcher.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        pool.release(upstream)
    finally:
        function.finished()
