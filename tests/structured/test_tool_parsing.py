"""Tool-call grammars accept exactly the call format, and the output parser splits text and calls."""

from __future__ import annotations

import json

import pytest

from runtime.api.tools import Function, ToolCall, ToolCallParser, ToolRequest, split_output, tool_grammar

WEATHER = Function(
    "get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, False
)
CALL = '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>'


def accepts(grammar: str, text: str) -> bool:
    from llguidance import LLMatcher, LLTokenizer

    from tests.conftest import REPO

    tokenizer = LLTokenizer((REPO / "build/smollm2-chat/bundle/tokenizer.json").read_text(), eos_token=2)
    matcher = LLMatcher(tokenizer, grammar)
    tokens = tokenizer.tokenize_str(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


@pytest.mark.real_model
def test_forced_and_auto_grammars_accept_exactly_the_call_format(demo_bundle: object) -> None:
    required = tool_grammar(ToolRequest((WEATHER,), "required", parallel=False))
    auto = tool_grammar(ToolRequest((WEATHER,), "auto", parallel=True))
    assert required is not None and auto is not None
    assert accepts(required, CALL)
    assert not accepts(required, "Sure! " + CALL)
    assert not accepts(required, CALL.replace('"Paris"', "3"))  # arguments must match the schema
    assert not accepts(required, CALL.replace(': "', ':"'))  # compact separators only
    assert accepts(auto, "It is sunny.")
    assert accepts(auto, "Let me check. " + CALL)
    assert not accepts(auto, 'Let me check. <tool_call>[\n{"name": "get_time", "arguments": {}}\n]</tool_call>')
    assert tool_grammar(ToolRequest((WEATHER,), "none", parallel=True)) is None


@pytest.mark.parametrize("cut", [1, 3, 7, 12, 40])
def test_the_stream_parser_splits_content_and_calls_at_any_chunk_boundary(cut: int) -> None:
    text = "Checking <tool_ now. " + CALL + " done"
    parser = ToolCallParser()
    pieces = [p for i in range(0, len(text), cut) for p in parser.push(text[i : i + cut])]
    pieces += list(parser.finish())
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    assert content == "Checking <tool_ now.  done"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_a_block_that_does_not_parse_stays_content() -> None:
    content, calls = split_output('<tool_call>[\n{"name": "get_weather", "argu')
    assert (content, calls) == ('<tool_call>[\n{"name": "get_weather", "argu', [])
    content, calls = split_output(CALL)
    assert content is None and len(calls) == 1
