"""Serve's HTTP proxy, speaking the runtime's error language: installed on a cluster's proxies with

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=runtime.ray_serve.proxy_errors:middlewares

in the environment of `ray start` (a KubeRay pod's env), or passed to `serve.start` by `pkg deploy` when it
starts Serve itself. Without it Serve answers the same statuses, as plain text.

Replicas answer in OpenAI's shapes themselves; the proxy's own answers do not: a full queue (429 or 503 with
`Retry-After`, from `max_queued_requests`), no route (404), no healthy replica (503), a replica lost before it
answered (500). A pure ASGI middleware around the proxy turns each of those text answers into an OpenAI error
body in the request's wire format (JSON, or msgpack when `Accept` asks for it), keeping status and headers.

A replica lost mid-stream (killed, its node gone) leaves Serve's proxy with a started answer it cannot finish:
it stops sending, and the client would see a connection cut inside a chunked body. Here the stream ends
instead with an error event in its own framing, `data: {"error": {...}}` or a final msgpack map (never
`data: [DONE]`), as the runtime ends a stream that fails and the local gateway one whose server died: the
OpenAI SDKs raise on it. Serve replaces the replica; the next request goes to a live one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware import Middleware

from runtime.api.encoding import EVENT_STREAM_TYPE, is_msgpack
from runtime.api.errors import APIError
from runtime.http.wire import WireFormat

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("runtime.ray_serve")
SERVE_TEXT = "text/plain"  # Serve's own answers; replicas never send it
_CODES = {
    404: ("invalid_request_error", "not_found"),
    408: ("server_error", "serve_timeout"),
    429: ("rate_limit_error", "serve_queue_full"),
    503: ("server_error", "serve_unavailable"),
}
_LOST = (
    "the replica answering this request stopped before it finished (killed, or its node left the cluster); "
    "Ray Serve starts another: send the request again"
)


def middlewares() -> list[Middleware]:
    """What `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` names: Serve calls it once per proxy."""
    return [Middleware(ServeErrorsAsOpenAI)]


class ServeErrorsAsOpenAI:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        answer = _Answer(send, WireFormat.for_accept(Headers(scope=scope).get("accept")))
        try:
            await self.app(scope, receive, answer.send)
        finally:
            await answer.finish()


class _Answer:
    """One response on its way out: Serve's text errors rewritten, an unfinished one finished."""

    def __init__(self, send: Send, wire: WireFormat) -> None:
        self._send = send
        self._wire = wire
        self._started = False
        self._finished = False
        self._content_type = ""
        self._rewrite: Message | None = None  # the start of a Serve text error whose body is being collected
        self._text: list[bytes] = []

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = Headers(raw=message.get("headers", []))
            self._content_type = headers.get("content-type", "")
            if message["status"] >= 400 and self._content_type.startswith(SERVE_TEXT):
                self._rewrite = message
                return
            self._started = True
        elif kind == "http.response.body" and self._rewrite is not None:
            self._text.append(message.get("body", b""))
            if not message.get("more_body", False):
                await self._send_error(self._serve_error())
            return
        elif kind == "http.response.body" and not message.get("more_body", False):
            self._finished = True
        await self._send(message)

    async def finish(self) -> None:
        """After the proxy is done with the request: whatever it left unsaid, said."""
        if self._finished:
            return
        if self._rewrite is not None:
            await self._send_error(self._serve_error())
        elif not self._started:
            await self._send_error(APIError(502, _LOST, error_type="server_error", code="replica_lost"))
        elif frame := self._error_frame():
            log.warning("a stream ended unfinished: its replica is gone (or its client)")
            await self._send({"type": "http.response.body", "body": frame, "more_body": False})
            self._finished = True
        # A whole answer cut short cannot be made whole: the connection closes unfinished, as a client must see.

    def _serve_error(self) -> APIError:
        assert self._rewrite is not None
        status = int(self._rewrite["status"])
        text = b"".join(self._text).decode("utf-8", "replace").strip() or f"Ray Serve answered {status}"
        if status >= 500 and status != 503:  # a replica that failed before answering: Serve says 500
            return APIError(502, f"{_LOST} ({text})", error_type="server_error", code="replica_lost")
        error_type, code = _CODES.get(status, ("server_error", "serve_error"))
        passed = Headers(raw=self._rewrite.get("headers", []))
        headers = {"Retry-After": passed["retry-after"]} if "retry-after" in passed else {}
        return APIError(status, f"Ray Serve: {text}", error_type=error_type, code=code, headers=headers)

    async def _send_error(self, error: APIError) -> None:
        body = self._wire.encode(error.body())
        headers = [(b"content-type", self._wire.media_type.encode()), (b"content-length", str(len(body)).encode())]
        headers += [(name.lower().encode(), value.encode()) for name, value in error.headers.items()]
        await self._send({"type": "http.response.start", "status": error.status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
        self._rewrite, self._started, self._finished = None, True, True

    def _error_frame(self) -> bytes:
        """The lost replica's error as the stream's last frame, in the stream's framing."""
        error = APIError(502, _LOST, error_type="server_error", code="replica_lost")
        if self._content_type.startswith(EVENT_STREAM_TYPE):
            return WireFormat(msgpack=False).frame(error.body())
        if is_msgpack(self._content_type):
            return WireFormat(msgpack=True).frame(error.body())
        return b""
