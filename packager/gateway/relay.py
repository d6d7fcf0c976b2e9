"""One request relayed to a function's server, and its answer back as it comes, in raw ASGI.

This runs once per streamed token, so it is kept thin (measured: gateway CPU per token, 8 streams): the
body chunks that came from the server since the last look go out in one ASGI message (upstream.py), with no
Starlette response object or per-chunk task in between. A client that goes away closes the connection to
the server, which then stops generating for it, as it would for a direct client.

A server that breaks off (killed, crashed) never looks like a finished answer:
- a stream (a chunked body: SSE or msgpack frames) ends with an OpenAI-style error event in its own framing,
  `data: {"error": {...}}` (never `data: [DONE]`) or a final `{"error": ...}` map, as the runtime itself ends
  a stream that fails; the OpenAI SDKs raise on it;
- any other answer is read whole before a byte of it goes out, so its client gets a 502 with an error body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgpack

from packager.gateway.functions import Function
from packager.gateway.upstream import Unreachable, Upstream, UpstreamError
from packager.targets.local import server_process
from runtime.api.encoding import EVENT_STREAM_TYPE, dump_json, is_msgpack
from runtime.api.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("onnxfn.gateway")
# Per connection, not per message: never relayed (RFC 9110 7.6.1); `host` and `content-length` are set anew.
HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
     b"transfer-encoding", b"upgrade", b"host", b"content-length")
)  # fmt: skip
NOT_RELAYED_BACK = (HOP_BY_HOP - {b"content-length"}) | {b"date", b"server"}  # uvicorn writes its own
WOKE_HEADER = b"x-onnxfn-woke"  # on a response that waited for its function to start again: how, how long
EXIT_WAIT = 0.5  # the kernel closes a killed process's sockets a moment before the process is gone


async def relay(
    function: Function, scope: Scope, receive: Receive, send: Send, body: bytes, woke: str
) -> APIError | None:
    """Send the request to the function's server and its answer to the client; the error that ended the stream
    when the server broke off mid-answer. Raises `Unreachable` when nothing reached a server (it may be sent
    again), an APIError when the server took the request and failed before any of the answer went out."""
    serving = function.serving()
    if serving is None:
        raise Unreachable(f"{function.name} has no server ready yet")
    pool, pid = function.pool(serving), serving[1]  # the connection goes back where it came from
    headers = [(name, value) for name, value in scope["headers"] if name not in HOP_BY_HOP]
    target = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    function.in_flight += 1  # before any await: the idle check must see it at once
    try:
        try:
            upstream = await pool.request(scope["method"], target.decode("latin-1"), headers, body)
        except UpstreamError as exc:
            raise await broke_off(function, pid, exc) from exc
        answer = [(name, value) for name, value in upstream.headers if name not in NOT_RELAYED_BACK]
        if woke:
            answer.append((WOKE_HEADER, woke.encode()))
        watcher = asyncio.get_running_loop().create_task(_watch(receive, upstream))
        try:
            broke = None
            if upstream.streamed:
                broke = await _stream(function, pid, upstream, answer, send, watcher)
            else:
                await _whole(function, pid, upstream, answer, send, watcher)
        finally:
            watcher.cancel()
        pool.release(upstream)
        return broke
    finally:
        function.finished()


async def _watch(receive: Receive, upstream: Upstream) -> None:
    """The client going away closes the server's connection: it stops generating too."""
    while (await receive())["type"] != "http.disconnect":
        pass
    upstream.close()


async def _stream(
    function: Function, pid: int, upstream: Upstream, answer: list[tuple[bytes, bytes]], send: Send, watcher: Any
) -> APIError | None:
    await send({"type": "http.response.start", "status": upstream.status, "headers": answer})
    broke = None
    try:
        while data := await upstream.chunks():
            await send({"type": "http.response.body", "body": data, "more_body": True})
    except UpstreamError as exc:
        if not watcher.done():  # not the client's doing
            error = await broke_off(function, pid, exc)
            log.warning("%s: the server's stream broke off: %s", function.name, error.message)
            frame = _error_frame(answer, error)
            if frame:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            broke = error
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return broke


async def _whole(
    function: Function, pid: int, upstream: Upstream, answer: list[tuple[bytes, bytes]], send: Send, watcher: Any
) -> None:
    parts = []
    try:
        while data := await upstream.chunks():
            parts.append(data)
    except UpstreamError as exc:
        if watcher.done():
            return  # the client went away: nobody to answer
        raise await broke_off(function, pid, exc) from exc
    await send({"type": "http.response.start", "status": upstream.status, "headers": answer})
    await send({"type": "http.response.body", "body": b"".join(parts), "more_body": False})


async def broke_off(function: Function, pid: int, exc: Exception) -> APIError:
    """The 502 for a server that took a request and did not finish its answer: it ended, or it misbehaved."""
    log_file = function.deployment.log_file
    deadline = asyncio.get_running_loop().time() + EXIT_WAIT
    while server_process.alive(pid) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    if not server_process.alive(pid):
        return APIError(
            502,
            f"the server of {function.name} (pid {pid}) ended while answering; the gateway starts it again for "
            f"the next request; its log ({log_file}) and `pkg ps` say why",
            error_type="server_error",
            code="function_crashed",
        )
    return APIError(
        502,
        f"the server of {function.name} broke off its answer ({exc}); its log: {log_file}",
        error_type="server_error",
        code="upstream_failed",
    )


def _error_frame(answer: list[tuple[bytes, bytes]], error: APIError) -> bytes:
    """The error as the stream's last frame, in the stream's framing (b"" for one the runtime never sends)."""
    content_type = next((value.decode("latin-1") for name, value in answer if name == b"content-type"), "")
    if content_type.startswith(EVENT_STREAM_TYPE):
        return b"data: " + dump_json(error.body()) + b"\n\n"
    if is_msgpack(content_type):
        return bytes(msgpack.packb(error.body(), use_bin_type=True))
    return b""
