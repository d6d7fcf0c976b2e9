"""`tools` / `tool_choice` through the official `openai` client against a real server on the demo model."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.real_model

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 24}},
    "required": ["timezone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "description": f"{name} of a place", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def test_required_gives_calls_whose_arguments_validate(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", n=4, temperature=0.9, seed=5, max_tokens=80
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert calls
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# Issue 47, row 10: a valid schema whose `$ref`s point into its own `$defs` (pydantic writes them so) was a 400
# "Pointer '/$defs/n' does not exist" with tool_choice "required": the call's grammar nests the parameters.
WITH_DEFS = {
    "type": "object",
    "$defs": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "city": {"type": "string", "maxLength": 20}},
    "properties": {"nights": {"$ref": "#/$defs/n"}, "city": {"$ref": "#/$defs/city"}},
    "required": ["nights", "city"],
    "additionalProperties": False,
}
WITH_DEFINITIONS = {  # draft 7's name for them, and a ref to a ref
    "type": "object",
    "definitions": {"zone": {"$ref": "#/definitions/name"}, "name": {"type": "string", "maxLength": 20}},
    "properties": {"timezone": {"$ref": "#/definitions/zone"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
DEFS_SCHEMAS = {"book_hotel": WITH_DEFS, "get_time": WITH_DEFINITIONS}
DEFS_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in DEFS_SCHEMAS.items()
]


@pytest.mark.parametrize(
    "tool_choice", ["required", "auto", {"type": "function", "function": {"name": "book_hotel"}}], ids=str
)
def test_schemas_with_defs_and_refs_are_enforced(client: openai.OpenAI, model: str, tool_choice: Any) -> None:
    ask = [{"role": "user", "content": "Book a hotel in Rome for three nights."}]
    reply = client.chat.completions.create(
        model=model, messages=ask, tools=DEFS_TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=80
    )
    (choice,) = reply.choices
    for call in choice.message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), DEFS_SCHEMAS[call.function.name])
    if tool_choice != "auto":
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls


def test_a_named_function_is_the_one_called(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
    )
    (choice,) = reply.choices
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    assert choice.finish_reason == "tool_calls"


def test_streamed_tool_call_deltas_reassemble(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finishes = []
    for chunk in stream:
        for choice in chunk.choices:
            finishes.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    assert [f for f in finishes if f] == ["tool_calls"]


def test_auto_answers_in_text_or_with_a_valid_call_and_history_round_trips(client: openai.OpenAI, model: str) -> None:
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=60)
    message = first.choices[0].message
    for call in message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert message.tool_calls or message.content
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    answer = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=24
    )
    assert answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nada"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [*TOOLS, TOOLS[0]]}, "tools"),
    ],
)
def test_bad_tool_fields_are_400s_naming_the_field(
    client: openai.OpenAI, model: str, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, **fields)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == param
