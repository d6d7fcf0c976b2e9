"""Wire formats: JSON or msgpack bodies in, JSON or msgpack responses out, and their streaming framings.

Request bodies are msgpack when `Content-Type` names msgpack and JSON otherwise (clients such as curl often
omit the header). Responses are msgpack when `Accept` names msgpack, errors included.

Streams:
- JSON: Server-Sent Events as OpenAI sends them, one `data: {...}\\n\\n` event per chunk, then `data: [DONE]\\n\\n`.
- msgpack: the same chunk objects as msgpack maps written back to back (`Content-Type: application/msgpack`).
  msgpack is self-delimiting, so `msgpack.Unpacker` yields each map as its bytes arrive; the stream ends with
  the body (there is no `[DONE]` sentinel). An error mid-stream is a final `{"error": {...}}` map, as in SSE.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
from starlette.responses import Response

from runtime.server.errors import APIError

JSON_TYPE = "application/json"
MSGPACK_TYPE = "application/msgpack"
EVENT_STREAM_TYPE = "text/event-stream"
_MSGPACK_ALIASES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
SSE_DONE = b"data: [DONE]\n\n"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def is_msgpack(media_type: str | None) -> bool:
    return media_type is not None and any(alias in media_type.lower() for alias in _MSGPACK_ALIASES)


def decode_body(raw: bytes, content_type: str | None) -> Any:
    """Parse a request body; a malformed one is a 400 that says which format was expected."""
    if is_msgpack(content_type):
        try:
            # Integer map keys are allowed: msgpack clients naturally key `logit_bias` by token id.
            return msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException, TypeError) as exc:
            raise APIError(400, f"the request body is not valid msgpack: {exc}", code="invalid_msgpack") from exc
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc


def dump_json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


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
