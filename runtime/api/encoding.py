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
import math
from typing import Any

import msgpack

from runtime.api.errors import APIError

JSON_TYPE = "application/json"
MSGPACK_TYPE = "application/msgpack"
EVENT_STREAM_TYPE = "text/event-stream"
_MSGPACK_ALIASES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
SSE_DONE = b"data: [DONE]\n\n"
# Deeper than any real request (a JSON schema in `response_format` included); bounds every later walk.
MAX_DEPTH = 64


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def is_msgpack(media_type: str | None) -> bool:
    return media_type is not None and any(alias in media_type.lower() for alias in _MSGPACK_ALIASES)


def decode_body(raw: bytes, content_type: str | None, *, text: bool = True) -> Any:
    """Parse a request body; a malformed one is a 400 that says which format was expected and what is wrong.

    `text=False` leaves `check_text` to the caller (a queue envelope checks its parts one by one).
    """
    if is_msgpack(content_type):
        body = _decode_msgpack(raw)  # its strings are strict UTF-8 already, but it may hold bytes
        _check_depth(body)
        if text:
            check_text(body)
        return body
    body = _decode_json(raw)
    _check_depth(body)
    if text:
        check_text(body)
    return body


def _decode_msgpack(raw: bytes) -> Any:
    # No container or string can hold more items or bytes than the body has bytes, so a header declaring
    # 4 G elements is refused before anything is allocated.
    limit = len(raw)
    try:
        # Integer map keys are allowed: msgpack clients naturally key `logit_bias` by token id.
        return msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=False,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=limit,
        )
    except msgpack.StackError as exc:
        raise _too_deep("msgpack") from exc
    except UnicodeDecodeError as exc:
        raise APIError(
            400,
            f"the msgpack body holds a string that is not UTF-8: {exc.reason} at byte {exc.start}",
            code="invalid_msgpack",
        ) from exc
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise APIError(400, f"the request body is not valid msgpack: {exc}", code="invalid_msgpack") from exc


def _decode_json(raw: bytes) -> Any:
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise APIError(
            400, f"the request body is not UTF-8: {exc.reason} at byte {exc.start}", code="invalid_json"
        ) from exc
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise _too_deep("JSON") from exc
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc


def _check_depth(body: Any) -> None:
    """Refuse bodies nested deeper than `MAX_DEPTH`, walking without recursion (no RecursionError later)."""
    level: list[Any] = [body]
    for _ in range(MAX_DEPTH):
        level = [child for node in level if isinstance(node, dict | list) for child in _children(node)]
        if not level:
            return
    raise _too_deep("the request body")


def check_text(body: Any) -> None:
    """Refuse what is not JSON text, found anywhere in the body, with a 400 naming where it is:

    - strings that are not Unicode text. JSON's `\\ud800` escapes decode to lone UTF-16 surrogates, which no
      tokenizer, log line or UTF-8 response can carry;
    - values JSON has no type for, which a msgpack body can hold: bytes (bin), ext types, map keys other than
      strings and integers (integer keys stay: msgpack clients key `logit_bias` by token id). Every later
      reader (a tool schema's `json.dumps`, a grammar, a template) expects JSON's types;
    - NaN, which msgpack can carry and JSON cannot (infinities, which JSON's `1e999` gives too, are each field's
      validator's to refuse, with the field's own message).
    """
    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(_children(node))
            key = next((k for k in node if not isinstance(k, str | int) or isinstance(k, bool)), _NO_KEY)
            if key is not _NO_KEY:
                param, where = _path_to(body, node) or (None, "the request body")
                raise _not_json(param, f"{where} has a map key {_shown(key)}; JSON keys are strings")
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str):
            if not node.isascii():
                _check_unicode(body, node)
        elif isinstance(node, float):
            if math.isnan(node):
                param, where = _path_to(body, node) or (None, "the request body")
                raise _not_json(param, f"{where} is NaN, which JSON cannot carry; send a number")
        elif not (node is None or isinstance(node, int)):  # bool is an int
            param, where = _path_to(body, node) or (None, "the request body")
            raise _not_json(
                param, f"{where} is {_shown(node)}, which JSON has no type for; send it as a string or a number"
            )


_NO_KEY = object()


def _check_unicode(body: Any, node: str) -> None:
    try:
        node.encode()
    except UnicodeEncodeError as exc:
        bad = node[exc.start : exc.end].encode("unicode_escape").decode()
        param, where = _path_to(body, node) or (None, "the request body")
        raise APIError(
            400,
            f"{where} holds a lone UTF-16 surrogate ({bad}), which is not Unicode text: send valid UTF-8 "
            "(in JSON, a \\uD8xx escape must be followed by a \\uDCxx one)",
            param=param,
            code="invalid_unicode",
        ) from None


def _shown(value: Any) -> str:
    """A value JSON cannot hold, described by its msgpack type (never its bytes: they may be large or secret)."""
    if isinstance(value, bytes | bytearray):
        return f"bytes (a msgpack bin of {len(value)} bytes)"
    if isinstance(value, msgpack.ExtType):
        return f"a msgpack ext value (type {value.code})"
    return f"a {type(value).__name__}"


def _not_json(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_msgpack")


def _path_to(node: Any, target: object, path: str = "") -> tuple[str | None, str] | None:
    """Where `target` (this very object) sits in `node`: the param (`messages[0].content`) and its description."""
    if node is target:
        return path or None, path or "the request body"
    if isinstance(node, list):
        for index, child in enumerate(node):
            found = _path_to(child, target, f"{path}[{index}]")
            if found is not None:
                return found
    elif isinstance(node, dict):
        for key, child in node.items():
            name = ascii(key)[1:-1] if isinstance(key, str) else str(key)
            if key is target:
                return path or None, f"the key '{name}' of {path or 'the request body'}"
            found = _path_to(child, target, f"{path}.{name}" if path else name)
            if found is not None:
                return found
    return None


def _children(node: dict[Any, Any] | list[Any]) -> list[Any]:
    return [*node.keys(), *node.values()] if isinstance(node, dict) else node


def _too_deep(what: str) -> APIError:
    return APIError(400, f"{what} is nested more than {MAX_DEPTH} levels deep", code="too_deeply_nested")


def dump_json(obj: Any) -> bytes:
    # A lone surrogate that reached a response anyway is written as its JSON escape, not a UnicodeEncodeError.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode(errors="backslashreplace")
