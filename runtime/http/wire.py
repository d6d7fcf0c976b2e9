"""How one HTTP request's responses are written: JSON or msgpack bodies, SSE or back-to-back msgpack streams.

The framings are described in `runtime.api.encoding`, which decodes bodies for every frontend.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from runtime.api.encoding import EVENT_STREAM_TYPE, JSON_TYPE, MSGPACK_TYPE, SSE_DONE, dump_json, is_msgpack
from runtime.api.errors import APIError


@dataclass(frozen=True)
class WireFormat:
    """How one request's responses are written, chosen from its `Accept` header."""

    msgpack: bool

    @classmethod
    def for_accept(cls, accept: str | None) -> WireFormat:
        return cls(msgpack=is_msgpack(accept))

    @property
    def media_type(self) -> str:
        return MSGPACK_TYPE if self.msgpack else JSON_TYPE

    @property
    def stream_media_type(self) -> str:
        return MSGPACK_TYPE if self.msgpack else EVENT_STREAM_TYPE

    def encode(self, obj: Any) -> bytes:
        return msgpack.packb(obj, use_bin_type=True) if self.msgpack else dump_json(obj)

    def response(self, obj: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
        return Response(self.encode(obj), status_code=status, headers=headers, media_type=self.media_type)

    def error_response(self, error: APIError) -> Response:
        return self.response(error.body(), status=error.status, headers=error.headers)

    def frame(self, chunk: Any) -> bytes:
        """One streamed chunk in this format's framing."""
        return self.encode(chunk) if self.msgpack else b"data: " + dump_json(chunk) + b"\n\n"

    def end_of_stream(self) -> bytes:
        return b"" if self.msgpack else SSE_DONE


def http_error_handler(*, where: str, see: str) -> Callable[[Request, Exception], Awaitable[Response]]:
    """starlette's own HTTP errors (no such route, a method not allowed) as OpenAI error bodies in the request's
    wire format; a 404 says where it was (`where`) and what to use instead (`see`)."""

    async def handle(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        wire = WireFormat.for_accept(request.headers.get("accept"))
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}{where}; see {see}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        code = "not_found" if exc.status_code == 404 else None
        return wire.error_response(APIError(exc.status_code, message, code=code, headers=exc.headers))

    return handle
