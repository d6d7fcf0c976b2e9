"""Tool calling in chat completions: `tools` / `tool_choice` in, `tool_calls` out.

Prompt format. ChatML templates such as SmolLM2's have no `tools` variable (the template would drop
them silently), so the tools are written into the system message in the convention SmolLM2 was
trained on, and calls and results in the history are rendered as text:

    system:    ...You have access to the following tools:\n<tools>[{"name", "description", "parameters"}]</tools>...
    assistant: <tool_call>[\n{"name": "f", "arguments": {...}}\n]</tool_call>
    user:      <tool_response>{"tool_call_id": "...", "content": "..."}</tool_response>   (a `tool` message)

Enforcement goes through constrained decoding: `required` and a named function force one (or, with
`parallel_tool_calls`, several) `<tool_call>` blocks whose calls match a function's parameter schema;
`auto` lets the model write text but, once it writes `<tool_call>`, holds it to the same grammar
(a lazy trigger, so plain answers cost one cheap lexer state); `none` renders no tools at all.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from runtime.api.errors import invalid_param
from runtime.api.fields import BodyReader, show
from runtime.engine.constraints import JSON_OPTIONS, grammar_problem, json_schema_grammar, lark_grammar

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_BLOCK_START = OPEN + "[\n"
_BLOCK_END = "\n]" + CLOSE
_CHOICES = ("none", "auto", "required")
# Per request: OpenAI's own cap on functions, and room for their schemas that keeps the compile of the
# request's grammar well under a second (3,000 functions held the event loop 2 s before these limits).
MAX_TOOLS = 128
MAX_TOOL_SCHEMA_BYTES = 128 << 10
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_INSTRUCTIONS = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, answer in plain text.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "To call tools, reply with exactly this format and no other text:\n"
    '<tool_call>[\n{{"name": "func_name1", "arguments": {{"argument1": "value1"}}}}\n]</tool_call>'
)


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool


@dataclass(frozen=True)
class ToolRequest:
    functions: tuple[Function, ...]
    choice: str  # "none", "auto", "required", or the name of the function that must be called
    parallel: bool

    @property
    def active(self) -> bool:
        return self.choice != "none"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parse_tools(
    reader: BodyReader, *, max_tools: int = MAX_TOOLS, max_schema_bytes: int = MAX_TOOL_SCHEMA_BYTES
) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked; None when the request has no tools.

    The parameter schemas are only sized here: they compile into the request's grammar off the event loop
    (api/grammar_compile.py), where `check_schemas` names one that cannot be used.
    """
    raw_tools = reader.raw("tools")
    choice = reader.raw("tool_choice")
    if raw_tools in (None, []):
        if choice not in (None, "none"):
            raise invalid_param("tool_choice", f"'tool_choice' = {show(choice)} needs 'tools'")
        return None
    if not isinstance(raw_tools, list):
        raise invalid_param("tools", f"'tools' must be a list of function tools, got {show(raw_tools)}")
    if len(raw_tools) > max_tools:
        raise invalid_param("tools", f"'tools' has {len(raw_tools)} functions; at most {max_tools} are allowed")
    functions = tuple(_function(item, f"tools[{i}]") for i, item in enumerate(raw_tools))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise invalid_param("tools", f"tool names must be unique, got {names}")
    schema_bytes = sum(json_size(f.parameters) for f in functions)
    if schema_bytes > max_schema_bytes:
        raise invalid_param(
            "tools",
            f"the parameter schemas in 'tools' take {schema_bytes} bytes; at most {max_schema_bytes} are allowed",
        )
    return ToolRequest(functions, _choice(choice, names), reader.boolean("parallel_tool_calls", True))


def json_size(value: Any) -> int:
    """The UTF-8 bytes of `value` as compact JSON (a string: its own bytes), as the grammar compiler gets it."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    # msgpack bodies can hold bytes, which no schema may: sized by their repr, refused when compiled.
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=repr, skipkeys=True)
    return len(text.encode("utf-8", "surrogatepass"))


def check_schemas(request: ToolRequest) -> None:
    """A 400 naming the first function whose parameter schema llguidance cannot use (slow: not on the event loop)."""
    for i, function in enumerate(request.functions):
        path = f"tools[{i}].function.parameters"
        try:
            problem = grammar_problem(json_schema_grammar(function.parameters, strict=function.strict))
        except ValueError as exc:  # llguidance refuses some schemas outright, e.g. integers beyond 64 bits
            problem = str(exc)
        if problem is not None:
            raise invalid_param(path, f"invalid JSON schema in '{path}': {problem}")


def _function(item: Any, path: str) -> Function:
    tool = BodyReader(item, ("type", "function"), path=path + ".")
    if tool.string("type", required=True) != "function":
        raise invalid_param(tool.name("type"), f"tool type {show(tool.raw('type'))} is not supported; use 'function'")
    spec = tool.nested("function", ("name", "description", "parameters", "strict"))
    if spec is None:
        raise invalid_param(tool.name("function"), f"'{tool.name('function')}' is required")
    name = spec.string("name", required=True) or ""
    if not 0 < len(name) <= 64 or not set(name) <= _NAME_CHARS:
        raise invalid_param(spec.name("name"), f"function name {show(name)} must be 1-64 of a-z, A-Z, 0-9, _ and -")
    parameters = spec.raw("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid_param(spec.name("parameters"), f"'{spec.name('parameters')}' must be a JSON schema object")
    return Function(name, spec.string("description"), parameters, spec.boolean("strict", False))


def _choice(value: Any, names: list[str]) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in _CHOICES:
            raise invalid_param("tool_choice", f"'tool_choice' = {show(value)}; use one of {list(_CHOICES)}")
        return value
    named = BodyReader(value, ("type", "function"), path="tool_choice.")
    if named.string("type", required=True) != "function":
        raise invalid_param("tool_choice.type", "'tool_choice.type' must be 'function'")
    function = named.nested("function", ("name",))
    name = function.string("name", required=True) if function is not None else None
    if name not in names:
        raise invalid_param("tool_choice", f"'tool_choice' names {show(name)}, which is not in 'tools' ({names})")
    return name


# The prompt.
def with_tools_prompt(messages: tuple[dict[str, str], ...], request: ToolRequest) -> tuple[dict[str, str], ...]:
    """`messages` with the tool instructions appended to the system message (one is added if there is none)."""
    tools = [
        {"name": f.name, "description": f.description or "", "parameters": f.parameters} for f in request.functions
    ]
    text = _INSTRUCTIONS.format(tools=json.dumps(tools, ensure_ascii=False))
    if messages and messages[0]["role"] == "system":
        first = {"role": "system", "content": messages[0]["content"] + "\n\n" + text}
        return (first, *messages[1:])
    return ({"role": "system", "content": text}, *messages)


def history_message(reader: BodyReader, role: str, content: str) -> dict[str, str] | None:
    """An assistant message with `tool_calls` or a `tool` result as template text; None for other messages."""
    calls = reader.raw("tool_calls")
    if calls not in (None, []) and role != "assistant":
        raise invalid_param(
            reader.name("tool_calls"), f"'{reader.name('tool_calls')}' is only allowed on assistant messages"
        )
    if role == "tool":
        result = {"tool_call_id": reader.string("tool_call_id", required=True), "content": content}
        return {"role": "user", "content": f"<tool_response>{json.dumps(result, ensure_ascii=False)}</tool_response>"}
    if calls in (None, []):
        return None
    if not isinstance(calls, list):
        raise invalid_param(reader.name("tool_calls"), f"'{reader.name('tool_calls')}' must be a list")
    rendered = []
    for i, item in enumerate(calls):
        call = BodyReader(item, ("id", "type", "function"), path=f"{reader.name('tool_calls')}[{i}].")
        function = call.nested("function", ("name", "arguments"))
        if function is None:
            raise invalid_param(call.name("function"), f"'{call.name('function')}' is required")
        name = function.string("name", required=True)
        arguments = function.string("arguments", required=True) or "{}"
        try:
            rendered.append({"name": name, "arguments": json.loads(arguments)})
        except json.JSONDecodeError as exc:
            raise invalid_param(
                function.name("arguments"), f"'{function.name('arguments')}' is not JSON: {exc}"
            ) from exc
    block = _BLOCK_START + ",\n".join(json.dumps(c, ensure_ascii=False) for c in rendered) + _BLOCK_END
    return {"role": "assistant", "content": (content + "\n" if content else "") + block}


# The grammar.
def tool_grammar(request: ToolRequest) -> str | None:
    """The llguidance grammar enforcing `tool_choice`; None for `none`."""
    if request.choice == "none":
        return None
    named = request.choice not in _CHOICES
    functions = [f for f in request.functions if f.name == request.choice] if named else list(request.functions)
    rules = [f"call_{i}: %json {json.dumps(_call_schema(f))}" for i, f in enumerate(functions)]
    calls = 'call ("," "\\n" call)*' if request.parallel and not named else "call"
    body = f"{json.dumps(_BLOCK_START[len(OPEN) :])} {calls} {json.dumps(_BLOCK_END)}"
    if request.choice == "auto":
        # llguidance's tool-calling pattern: free text until the lazy trigger, then the call grammar.
        head = [
            "start: block* TEXT",
            "TEXT: /(.|\\n)*/",
            f"trigger[lazy]: TEXT {json.dumps(OPEN)}",
            f"block: trigger {body}",
        ]
    else:
        head = [f"start: {json.dumps(OPEN)} {body}"]
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))
    return lark_grammar("\n".join(("%llguidance {}", *head, call, *rules)))


def _call_schema(function: Function) -> dict[str, Any]:
    arguments = _rebased(function.parameters, ARGUMENTS_POINTER)
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": {**JSON_OPTIONS, "lenient": not function.strict},
    }


ARGUMENTS_POINTER = "/properties/arguments"  # where a function's parameter schema sits in its call's schema


def _rebased(schema: Any, pointer: str) -> Any:
    """`schema` as a subschema at `pointer`: its document-relative `$ref`s (`#/$defs/x`, `#/definitions/x`, `#`)
    point into it there, where they pointed into it as a document of its own."""
    if isinstance(schema, list):
        return [_rebased(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {key: _rebased(value, pointer) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        rebased["$ref"] = "#" + pointer + ref[1:]
    return rebased


# The output.
def split_output(text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished reply as (content, tool calls); a block that does not parse stays in the content."""
    parser = ToolCallParser()
    pieces = [*parser.push(text), *parser.finish()]
    content = "".join(p for p in pieces if isinstance(p, str)).strip()
    return content or None, [p for p in pieces if isinstance(p, ToolCall)]


class ToolCallParser:
    """Splits streamed text into content and complete tool calls.

    Text that might be the start of `<tool_call>` is held back until it is clear; a block is parsed
    once its `</tool_call>` arrives, and its calls come out whole (arguments are not split further).
    """

    def __init__(self) -> None:
        self._pending = ""
        self._in_block = False

    def push(self, text: str) -> Iterator[str | ToolCall]:
        self._pending += text
        while True:
            if self._in_block:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return
                block, self._pending = self._pending[: end + len(CLOSE)], self._pending[end + len(CLOSE) :]
                self._in_block = False
                calls = _parse_block(block)
                yield from calls if calls is not None else [block]
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                if start:
                    yield self._pending[:start]
                self._pending, self._in_block = self._pending[start:], True
                continue
            keep = _partial_open(self._pending)
            if len(self._pending) > keep:
                yield self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
            return

    def finish(self) -> Iterator[str]:
        """What is left at the end: an unterminated block or held-back text is plain content."""
        if self._pending:
            yield self._pending
        self._pending = ""


def _parse_block(block: str) -> list[ToolCall] | None:
    body = block[len(OPEN) : -len(CLOSE)].strip()
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and "arguments" in item):
            return None
        arguments = item["arguments"]
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", item["name"], text))
    return calls


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for length in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:length]):
            return length
    return 0
