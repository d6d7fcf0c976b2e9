"""Hostile request bodies that once gave a 500 (issue 37, row 6; issue 47, row 6), and their neighbours.

Each case is a body's fields (merged into a valid chat or completion request) and the 400 it must get: the
same on HTTP and as a queue message. The strings hold lone UTF-16 surrogates, which `json.dumps` writes as
`\\udc80` escapes: what a hostile client sends, since no UTF-8 encoder will write the surrogate itself.
`MSGPACK_CASES` hold what only msgpack can carry (bytes, ext types, NaN, non-string keys), sent as msgpack.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import msgpack

LONE = "a\udc80b"  # a low surrogate with no high one before it
DIGITS_5000 = "1" * 5000


@dataclass(frozen=True)
class HostileCase:
    name: str
    fields: dict[str, Any]
    code: str | None  # the error's `code`
    param: str | None  # the error's `param`
    kind: str = "chat"  # chat or completion
    message: str = ""  # a part of the error message

    def body(self, model: str) -> dict[str, Any]:
        base: dict[str, Any] = {"model": model, "max_tokens": 2}
        if self.kind == "chat":
            base["messages"] = [{"role": "user", "content": "Hi"}]
        else:
            base["prompt"] = "Hi"
        return {**base, **self.fields}

    def raw(self, model: str, envelope: dict[str, Any] | None = None) -> bytes:
        """The body as a client would send it: ASCII JSON with \\uXXXX escapes, `Literal`s written verbatim.

        With `envelope`, the body is its `body` field: a queue message.
        """
        literals: dict[str, str] = {}

        def placeholder(value: Any) -> str:
            literals[f"@literal{len(literals)}@"] = str(value)
            return f"@literal{len(literals) - 1}@"

        document = self.body(model) if envelope is None else {**envelope, "body": self.body(model)}
        text = json.dumps(document, default=placeholder)
        for key, literal in literals.items():
            text = text.replace(f'"{key}"', literal)
        return text.encode()

    def packed(self, model: str, envelope: dict[str, Any] | None = None) -> bytes:
        """The body as msgpack (bytes as bin, `msgpack.ExtType` as ext); with `envelope`, a queue message's."""
        document = self.body(model) if envelope is None else {**envelope, "body": self.body(model)}
        return msgpack.packb(document, use_bin_type=True)


class Literal:
    """JSON text no Python value dumps to: a number of 5,000 digits, `1e400`."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def _user(content: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}]}


_TOOL = {"type": "function", "function": {"name": "f", "description": LONE, "parameters": {"type": "object"}}}

CASES = [
    # Row 6 as reported.
    HostileCase("surrogate-in-content", _user(LONE), "invalid_unicode", "messages[0].content", message="\\udc80"),
    HostileCase(
        "surrogate-in-content-part",
        _user([{"type": "text", "text": LONE}]),
        "invalid_unicode",
        "messages[0].content[0].text",
    ),
    HostileCase(
        "surrogate-in-system-message",
        {"messages": [{"role": "system", "content": LONE}, {"role": "user", "content": "Hi"}]},
        "invalid_unicode",
        "messages[0].content",
    ),
    HostileCase(
        "surrogate-in-tool-description", {"tools": [_TOOL]}, "invalid_unicode", "tools[0].function.description"
    ),
    HostileCase("surrogate-in-prompt", {"prompt": LONE}, "invalid_unicode", "prompt", kind="completion"),
    HostileCase(
        "surrogate-in-prompt-echo", {"prompt": LONE, "echo": True}, "invalid_unicode", "prompt", kind="completion"
    ),
    HostileCase("logit-bias-superscript-key", {"logit_bias": {"²": 1}}, None, "logit_bias", message="'²'"),
    HostileCase("logit-bias-5000-digit-key", {"logit_bias": {DIGITS_5000: 1}}, None, "logit_bias"),
    HostileCase("surrogate-unknown-key", {"\ud800": 1}, "invalid_unicode", None, message="the key '\\ud800'"),
    # Neighbours.
    HostileCase("high-surrogate-at-end", _user("abc\ud83d"), "invalid_unicode", "messages[0].content"),
    HostileCase("surrogate-in-stop", {"stop": ["x", LONE]}, "invalid_unicode", "stop[1]"),
    HostileCase("surrogate-in-model", {"model": LONE}, "invalid_unicode", "model"),
    HostileCase("surrogate-in-user", {"user": LONE}, "invalid_unicode", "user"),
    HostileCase(
        "surrogate-in-prompt-list", {"prompt": ["ok", LONE]}, "invalid_unicode", "prompt[1]", kind="completion"
    ),
    HostileCase(
        "surrogate-in-schema-key",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"\udfff": {"type": "string"}}},
                },
            }
        },
        "invalid_unicode",
        "response_format.json_schema.schema.properties",
    ),
    HostileCase("surrogate-in-guided-regex", {"guided_regex": "a\udc80+"}, "invalid_unicode", "guided_regex"),
    HostileCase("logit-bias-arabic-indic-digits", {"logit_bias": {"١٢": 1}}, None, "logit_bias"),
    HostileCase("logit-bias-negative-key", {"logit_bias": {"-1": 1}}, None, "logit_bias"),
    HostileCase("logit-bias-float-key", {"logit_bias": {"1e3": 1}}, None, "logit_bias"),
    HostileCase("logit-bias-padded-key", {"logit_bias": {" 12": 1}}, None, "logit_bias"),
    HostileCase("logit-bias-hex-key", {"logit_bias": {"0x10": 1}}, None, "logit_bias"),
    HostileCase("logit-bias-key-past-vocab", {"logit_bias": {"99999999999": 1}}, None, "logit_bias"),
    HostileCase("logit-bias-infinite-amount", {"logit_bias": {"12": Literal("Infinity")}}, "invalid_json", None),
    HostileCase("logit-bias-overflowing-amount", {"logit_bias": {"12": Literal("1e400")}}, None, "logit_bias"),
    HostileCase(
        "max-tokens-5000-digits", {"max_tokens": Literal(DIGITS_5000)}, "invalid_json", None, message="not valid JSON"
    ),
    HostileCase("temperature-overflow", {"temperature": Literal("1e400")}, None, "temperature"),
    HostileCase("seed-past-64-bits", {"seed": 2**70}, None, "seed"),
]

# A valid astral character is a surrogate *pair* in JSON: it must pass untouched.
VALID_PAIR = HostileCase("emoji-as-surrogate-pair", _user("hi \ud83d\ude00"), None, None)


def _tool(parameters: Any, **function: Any) -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters, **function}}]}


def _schema(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


_STRING_WITH_BYTES_DEFAULT = {"type": "object", "properties": {"x": {"type": "string", "default": b"\x00\xff"}}}
_NAN = math.nan
# Issue 47, row 6: a msgpack `bytes` inside tools[].function.parameters was a TypeError (500) in the tool prompt.
MSGPACK_CASES = [
    HostileCase(
        "bytes-in-tool-parameters",
        _tool(_STRING_WITH_BYTES_DEFAULT),
        "invalid_msgpack",
        "tools[0].function.parameters.properties.x.default",
        message="bytes (a msgpack bin of 2 bytes)",
    ),
    # Neighbours: the same value type elsewhere, and the other values JSON has no type for.
    HostileCase("bytes-as-tool-parameters", _tool(b"{}"), "invalid_msgpack", "tools[0].function.parameters"),
    HostileCase(
        "bytes-key-in-tool-parameters",
        _tool({b"type": "object"}),
        "invalid_msgpack",
        "tools[0].function.parameters",
        message="map key bytes",
    ),
    HostileCase(
        "bytes-tool-name",
        {"tools": [{"type": "function", "function": {"name": b"f"}}]},
        "invalid_msgpack",
        "tools[0].function.name",
    ),
    HostileCase(
        "bytes-tool-choice", {**_tool({"type": "object"}), "tool_choice": b"required"}, "invalid_msgpack", "tool_choice"
    ),
    HostileCase(
        "bytes-in-schema",
        _schema(_STRING_WITH_BYTES_DEFAULT),
        "invalid_msgpack",
        "response_format.json_schema.schema.properties.x.default",
    ),
    HostileCase(
        "nan-in-schema",
        _schema({"type": "number", "maximum": _NAN}),
        "invalid_msgpack",
        "response_format.json_schema.schema.maximum",
        message="NaN",
    ),
    HostileCase("bytes-content", _user(b"Hi"), "invalid_msgpack", "messages[0].content"),
    HostileCase(
        "bytes-content-part", _user([{"type": "text", "text": b"Hi"}]), "invalid_msgpack", "messages[0].content[0].text"
    ),
    HostileCase(
        "bytes-tool-call-arguments",
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": b"{}"}}],
                },
                {"role": "tool", "tool_call_id": "c", "content": "1"},
            ]
        },
        "invalid_msgpack",
        "messages[1].tool_calls[0].function.arguments",
    ),
    HostileCase("bytes-stop", {"stop": ["x", b"y"]}, "invalid_msgpack", "stop[1]"),
    HostileCase("bytes-user", {"user": b"u"}, "invalid_msgpack", "user"),
    HostileCase("bytes-prompt", {"prompt": b"Hi"}, "invalid_msgpack", "prompt", kind="completion"),
    HostileCase(
        "ext-user",
        {"user": msgpack.ExtType(5, b"x")},
        "invalid_msgpack",
        "user",
        message="a msgpack ext value (type 5)",
    ),
    HostileCase("nan-temperature", {"temperature": _NAN}, "invalid_msgpack", "temperature", message="NaN"),
    HostileCase("nan-logit-bias-amount", {"logit_bias": {"12": _NAN}}, "invalid_msgpack", "logit_bias.12"),
    HostileCase(
        "bytes-logit-bias-key", {"logit_bias": {b"12": 1}}, "invalid_msgpack", "logit_bias", message="map key bytes"
    ),
    HostileCase(
        "float-logit-bias-key", {"logit_bias": {1.5: 1}}, "invalid_msgpack", "logit_bias", message="map key a float"
    ),
    HostileCase("bytes-unknown-field", {"extra": b"x"}, "invalid_msgpack", "extra"),
]
