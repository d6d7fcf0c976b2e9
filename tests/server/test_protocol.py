"""Request bodies to SamplingParams: defaults, limits, and a 400 naming the field for every bad value."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.api.errors import APIError
from runtime.api.protocol import RequestPolicy, parse_chat, parse_completion

POLICY = RequestPolicy(
    model_name="fn",
    vocab_size=1000,
    default_temperature=0.0,
    default_top_p=0.9,
    default_max_tokens=100,
    max_tokens_limit=50,
    max_n=4,
)
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "fn", "messages": USER, **fields}


def rejected(body: Any, *, completion: bool = False, policy: RequestPolicy = POLICY) -> APIError:
    with pytest.raises(APIError) as caught:
        (parse_completion if completion else parse_chat)(body, policy)
    return caught.value


def test_unset_fields_take_the_function_defaults_and_max_tokens_is_capped() -> None:
    parsed = parse_chat(chat(), POLICY)
    assert parsed.sampling.temperature == 0.0
    assert parsed.sampling.top_p == 0.9
    assert parsed.sampling.max_tokens == 50  # the default (100) is above the endpoint's limit (50)
    assert (parsed.stream, parsed.include_usage, parsed.sampling.n) == (False, False, 1)


def test_null_means_absent_like_openai() -> None:
    parsed = parse_chat(chat(temperature=None, stop=None, n=None, stream_options=None), POLICY)
    assert (parsed.sampling.temperature, parsed.sampling.stop, parsed.sampling.n) == (0.0, (), 1)


def test_every_sampling_field_reaches_the_engine() -> None:
    parsed = parse_chat(
        chat(
            max_completion_tokens=7,
            temperature=0.5,
            top_p=0.5,
            top_k=-1,
            min_p=0.1,
            repetition_penalty=1.2,
            presence_penalty=-1,
            frequency_penalty=1.5,
            logit_bias={"5": -100, "7": 2.5},
            seed=-3,
            stop="END",
            stop_token_ids=[2],
            ignore_eos=True,
            n=2,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            stream_options={"include_usage": True},
            user="someone",
        ),
        POLICY,
    )
    s = parsed.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (7, 0.5, 0.5, 0, 0.1)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.2, -1.0, 1.5)
    assert s.logit_bias == {5: -100.0, 7: 2.5}
    assert (s.seed, s.stop, s.stop_token_ids, s.ignore_eos, s.n) == (-3, ("END",), (2,), True, 2)
    assert (s.logprobs, s.top_logprobs, parsed.stream, parsed.include_usage) == (True, 3, True, True)


def test_messages_are_normalised_for_the_template() -> None:
    parsed = parse_chat(
        chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": None, "name": "bot"},
            ]
        ),
        POLICY,
    )
    assert parsed.messages == (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
    )


def test_the_function_system_prompt_fills_in_only_when_the_chat_has_none() -> None:
    policy = RequestPolicy(model_name="fn", vocab_size=10, system_prompt="You are SmolLM.")
    assert parse_chat(chat(), policy).messages[0] == {"role": "system", "content": "You are SmolLM."}
    own = [{"role": "system", "content": "Mine."}, *USER]
    assert parse_chat(chat(messages=own), policy).messages[0] == {"role": "system", "content": "Mine."}


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"max_token": 5}, "max_token", "unknown_parameter"),
        ({"model": None}, "model", "missing_required_parameter"),
        ({"messages": []}, "messages", None),
        ({"messages": "hi"}, "messages", None),
        ({"messages": [{"role": "user"}]}, "messages[0].content", None),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", None),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra", "unknown_parameter"),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{}]}]},
            "messages[0].tool_calls[0].function",
            None,
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
            "missing_required_parameter",
        ),
        ({"max_tokens": 51}, "max_tokens", None),
        ({"max_tokens": 0}, "max_tokens", None),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens", None),
        ({"temperature": True}, "temperature", None),
        ({"temperature": "0.5"}, "temperature", None),
        ({"temperature": 2.5}, "temperature", None),
        ({"top_p": 0}, "top_p", None),
        ({"n": 5}, "n", None),
        ({"n": True}, "n", None),
        ({"stop": ["ok", ""]}, "stop", None),
        ({"stop": 3}, "stop", None),
        ({"stop": ["s"] * 17}, "stop", None),
        ({"logit_bias": {"1000": 1}}, "logit_bias", None),
        ({"logit_bias": {"x": 1}}, "logit_bias", None),
        ({"logit_bias": {"3": 101}}, "logit_bias", None),
        ({"seed": 2**63}, "seed", None),
        ({"stop_token_ids": [1000]}, "stop_token_ids", None),
        ({"logprobs": 1}, "logprobs", None),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", None),
        ({"stream_options": {"include_usage": True}}, "stream_options", None),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", None),
        ({"stream": True, "stream_options": {"usage": True}}, "stream_options.usage", "unknown_parameter"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "unsupported_parameter"),
        ({"tool_choice": "required"}, "tool_choice", None),  # no tools to require
        ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
    ],
)
def test_bad_chat_fields_name_themselves(fields: dict[str, Any], param: str, code: str | None) -> None:
    error = rejected(chat(**fields))
    assert (error.status, error.param, error.code) == (400, param, code)
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_a_body_that_is_not_an_object_is_400() -> None:
    error = rejected(["model", "fn"])
    assert (error.status, error.param) == (400, None)
    assert "must be an object" in error.message


def test_another_model_is_404() -> None:
    error = rejected(chat(model="gpt-4o"))
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")


def test_completion_prompts_in_every_openai_form() -> None:
    def prompts(value: Any) -> tuple[Any, ...]:
        return parse_completion({"model": "fn", "prompt": value}, POLICY).prompts

    assert prompts("hi") == ("hi",)
    assert prompts(["a", "b"]) == ("a", "b")
    assert prompts([1, 2, 3]) == ((1, 2, 3),)
    assert prompts([[1, 2], [3]]) == ((1, 2), (3,))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, 1000]}, "prompt"),
        ({"prompt": ["a"] * 17}, "prompt"),
        ({"prompt": "a", "suffix": "b"}, "suffix"),
        ({"prompt": "a", "logprobs": 6}, "logprobs"),
        ({"prompt": "a", "logprobs": 1, "echo": True}, "echo"),
        ({"prompt": "a", "best_of": 2}, "best_of"),
        ({"prompt": "a", "messages": USER}, "messages"),
    ],
)
def test_bad_completion_fields_name_themselves(fields: dict[str, Any], param: str) -> None:
    error = rejected({"model": "fn", **fields}, completion=True)
    assert (error.status, error.param) == (400, param)


def test_completion_logprobs_count_becomes_top_logprobs() -> None:
    parsed = parse_completion({"model": "fn", "prompt": "a", "logprobs": 0, "best_of": 1, "echo": False}, POLICY)
    assert (parsed.sampling.logprobs, parsed.sampling.top_logprobs) == (True, 0)
    parsed = parse_completion({"model": "fn", "prompt": "a", "logprobs": 5}, POLICY)
    assert (parsed.sampling.logprobs, parsed.sampling.top_logprobs) == (True, 5)
