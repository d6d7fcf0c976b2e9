"""Structured output in a chat request: `response_format` or vLLM's `guided_*` fields, checked and sized.

Parsing stops at a `GrammarSource`: the shape of the field is checked and its size held to
`RequestPolicy.max_grammar_bytes` here, on the event loop, where both are cheap; building the llguidance
grammar (GBNF conversion is pure Python), validating and compiling it run on the grammar thread
(api/grammar_compile.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from runtime.api.errors import APIError, invalid_param
from runtime.api.fields import BodyReader, show
from runtime.api.tools import ToolRequest, json_size
from runtime.engine import constraints

GUIDED = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")  # vLLM's spelling, via extra_body
_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")


@dataclass(frozen=True)
class GrammarSource:
    """What a request constrains its output with, as parsed: its grammar text is built on the grammar thread."""

    param: str  # the field a refusal names: `response_format`, a `guided_*` key, or `tools`
    build: Callable[[], str | None]  # the llguidance grammar; ValueError when the text cannot be read at all
    # Checked function by function when unused (tool_choice "none": nothing compiles them) or to name the
    # function at fault when the grammar fails.
    tools: ToolRequest | None = None


def structured_output(reader: BodyReader, max_bytes: int) -> GrammarSource | None:
    """The grammar `response_format` or a `guided_*` field asks for, sized but not built; None for free text."""
    asked = [key for key in ("response_format", *GUIDED) if reader.has(key)]
    if len(asked) > 1:
        raise invalid_param(asked[1], f"'{asked[0]}' and '{asked[1]}' both constrain the output; give one")
    if not asked:
        return None
    key = asked[0]
    value = reader.raw(key)
    if key == "response_format":
        fmt = reader.nested(key, ("type", "json_schema", "regex", "grammar"))
        assert fmt is not None
        kind = fmt.string("type", required=True)
        value = None if kind in ("text", "json_object") else fmt.raw(kind)
        if kind not in _FORMAT_TYPES:
            raise _unsupported("response_format.type", f"response_format type {show(kind)}; use one of {_FORMAT_TYPES}")
        if kind not in ("text", "json_object") and value is None:
            raise invalid_param(f"response_format.{kind}", f"'response_format.{kind}' is required for type {kind!r}")
    else:
        kind = key.removeprefix("guided_")
    if value is not None:
        field = f"response_format.{kind}" if key == "response_format" else key
        size = json_size(value)
        if size > max_bytes:
            raise invalid_param(field, f"'{field}' takes {size} bytes; at most {max_bytes} are allowed")
    build = _grammar(kind, value, key)
    return GrammarSource(key, build) if build is not None else None


def no_grammar() -> None:
    """The build of a request whose tools are offered but not used: nothing to compile."""
    return None


def _grammar(kind: str, value: Any, key: str) -> Callable[[], str] | None:
    """How to build the grammar, its shape checked; the build runs on the grammar thread."""
    if kind == "text":
        return None
    if kind == "json_object":
        return constraints.json_object_grammar
    if kind == "json_schema":  # OpenAI's {"name", "description", "schema", "strict"}
        spec = BodyReader(value, ("name", "description", "schema", "strict"), path="response_format.json_schema.")
        spec.string("name", required=True)
        schema = spec.raw("schema") or {}
        if not isinstance(schema, dict):
            raise invalid_param(key, f"'response_format.json_schema.schema' must be an object, got {show(schema)}")
        return partial(constraints.json_schema_grammar, schema, strict=spec.boolean("strict", False))
    if kind == "json":  # vLLM's guided_json: the schema itself
        if not isinstance(value, dict):
            raise invalid_param(key, f"'{key}' must be a JSON schema object, got {show(value)}")
        return partial(constraints.json_schema_grammar, value, strict=False)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise invalid_param(key, f"'{key}' must be a non-empty list of strings, got {show(value)}")
        return partial(constraints.choice_grammar, value)
    if not isinstance(value, str):
        raise invalid_param(key, f"'{key}' must be a string, got {show(value)}")
    return partial(constraints.regex_grammar if kind == "regex" else constraints.lark_grammar, value)


def _unsupported(param: str, message: str) -> APIError:
    return invalid_param(param, message, code="unsupported_parameter")
