"""A request body at the gateway: read within the servers' limit, and only as far as routing needs it.

The gateway routes by the body's `model`, so it must read a body before it knows the function, and so before
it can check that function's key. What bounds an outsider's cost is done first (app.py): a key that opens no
function deployed here is refused before a byte of the body is read; a `Content-Length` over the limit is
refused unread; a body that grows past the limit is refused at the limit (uvicorn stops reading a socket
whose unread body is over 64 KiB, so an unread body costs no memory either).

The limit is the servers' own (`MAX_BODY_BYTES`, 1 MiB): a body larger than that would only be refused by
the server. Within it, `model` is found without building the body: a msgpack body's other values are
skipped in C (a megabyte of empty maps is 72 MB of Python objects when decoded, 2.5 ms and no memory when
skipped); a JSON body is decoded on a worker thread, at most `DECODES_AT_ONCE` at a time (25 MB and ~50 ms
at worst for a megabyte of `{}`), since the standard library has no skipping JSON reader.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgpack

from runtime.api.encoding import decode_body, is_msgpack
from runtime.api.errors import APIError
from runtime.http.connection_limits import MAX_BODY_BYTES

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]

DECODES_AT_ONCE = 2
INLINE_JSON_BYTES = 64 << 10  # a JSON body this small is decoded on the loop: a thread hop costs more
# msgpack str headers: fixstr (0xa0-0xbf), str 8, str 16, str 32
_STR_HEADERS = frozenset((*range(0xA0, 0xC0), 0xD9, 0xDA, 0xDB))
_MAP_HEADERS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))  # fixmap, map 16, map 32
_decodes = asyncio.Semaphore(DECODES_AT_ONCE)


class Disconnected(Exception):
    """The client went away before its request was read."""


def refuse_declared(headers: list[tuple[bytes, bytes]], limit: int = MAX_BODY_BYTES) -> None:
    """413 when `Content-Length` says the body is over `limit`: nothing of it is read."""
    for name, value in headers:
        if name == b"content-length":
            # ASCII digits only, and few of them: int() of a 5,000-digit header is refused by Python itself.
            if value.isdigit() and (len(value) > 18 or int(value) > limit):
                raise _too_large(limit)
            return


async def read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is over {limit} bytes, the limit of every function's server",
        code="request_too_large",  # the servers' code for it
    )


async def model_of(body: bytes, content_type: str | None) -> str:
    """The body's `model`: which function the request is for. A 400 when the body does not parse or names none."""
    if is_msgpack(content_type):
        model = _msgpack_model(body)
    elif len(body) <= INLINE_JSON_BYTES:
        model = _json_model(body, content_type)
    else:
        async with _decodes:
            model = await asyncio.to_thread(_json_model, body, content_type)
    if not isinstance(model, str) or not model:
        raise APIError(
            400,
            "the request has no `model`: the gateway routes by it; give a deployed function's name "
            "(GET /v1/models lists them)",
            param="model",
            code="missing_required_parameter",  # the runtime's code for it
        )
    return model


def _json_model(body: bytes, content_type: str | None) -> object:
    data = decode_body(body, content_type, text=False)  # a 400 naming the format when it does not parse
    return data.get("model") if isinstance(data, dict) else None


def _msgpack_model(body: bytes) -> object:
    """The top-level map's `model` string; every other value is skipped, never built."""
    unpacker = _unpacker(body)
    try:
        if not body or body[0] not in _MAP_HEADERS:
            unpacker.skip()  # valid or not: no map, no `model` (the caller says so)
            return None
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack() if _next_is_str(unpacker, body) else unpacker.skip()
            if key == "model" and _next_is_str(unpacker, body):
                return unpacker.unpack()
            unpacker.skip()
    except msgpack.OutOfData as exc:
        raise APIError(
            400, "the request body is not valid msgpack: it ends inside a value", code="invalid_msgpack"
        ) from exc
    except UnicodeDecodeError as exc:
        raise APIError(
            400, f"the msgpack body holds a string that is not UTF-8: {exc.reason}", code="invalid_msgpack"
        ) from exc
    except msgpack.StackError as exc:
        raise APIError(400, "the msgpack body is nested too deeply", code="too_deeply_nested") from exc
    except (ValueError, msgpack.UnpackException) as exc:
        why = str(exc) or f"a reserved byte at {unpacker.tell()}"
        raise APIError(400, f"the request body is not valid msgpack: {why}", code="invalid_msgpack") from exc
    return None


def _unpacker(body: bytes) -> msgpack.Unpacker:
    limit = max(1, len(body))  # no string or container can be longer than the body
    unpacker = msgpack.Unpacker(
        raw=False, strict_map_key=False, max_buffer_size=limit, max_str_len=limit, max_bin_len=limit,
        max_array_len=limit, max_map_len=limit, max_ext_len=limit,
    )  # fmt: skip
    unpacker.feed(body)
    return unpacker


def _next_is_str(unpacker: msgpack.Unpacker, body: bytes) -> bool:
    offset = unpacker.tell()
    return offset < len(body) and body[offset] in _STR_HEADERS
