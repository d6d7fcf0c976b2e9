"""The HTTP API against the official `openai` client: shapes, streaming, sampling options and errors."""

from __future__ import annotations

import openai
import pytest

from runtime.engine.request import GenerationRequest, SamplingParams
from tests.server.conftest import API_KEY, MAX_CONTEXT, MAX_PROMPT_TOKENS, RunningServer

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(server: RunningServer) -> str:
    return server.state.policy.model_name


def engine_text(server: RunningServer, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, int]:
    """The engine's own greedy answer, in-process: what the HTTP layer must reproduce exactly."""
    tokenizer = server.engine.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
    request = GenerationRequest("direct", tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))
    (output,) = server.engine.generate(request)
    return output.text, len(prompt)


def test_models_lists_the_function_and_unknown_ids_are_404(client: openai.OpenAI, model: str) -> None:
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).owned_by == "onnxfn"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found"


def test_chat_matches_the_engine_token_for_token(client: openai.OpenAI, server: RunningServer, model: str) -> None:
    expected, prompt_tokens = engine_text(server, QUESTION, max_tokens=12)
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12)
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert reply.system_fingerprint == "fp_test"
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == prompt_tokens
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == prompt_tokens + reply.usage.completion_tokens


def test_streamed_chat_equals_the_non_streamed_reply(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=10)
    chunks = list(
        client.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=10, stream=True, stream_options={"include_usage": True}
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_with_logprobs_account_for_every_token(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=True, top_logprobs=2
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    counted = 0
    for choice in reply.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        counted += len(choice.logprobs.content)
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0.0
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert entry.bytes == list(entry.token.encode())
    assert reply.usage is not None
    assert counted == reply.usage.completion_tokens


def test_greedy_logprobs_pick_the_top_token(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content
    for entry in content:
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_stop_string_cuts_the_reply_before_it(client: openai.OpenAI, model: str) -> None:
    full = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24).choices[0].message.content
    assert full is not None
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]


def test_completions_text_tokens_echo_and_several_prompts(
    client: openai.OpenAI, server: RunningServer, model: str
) -> None:
    text = client.completions.create(model=model, prompt="The sky is", max_tokens=6)
    assert text.object == "text_completion"
    ids = server.engine.tokenizer.encode("The sky is")
    by_tokens = client.completions.create(model=model, prompt=ids, max_tokens=6)
    assert by_tokens.choices[0].text == text.choices[0].text
    echoed = client.completions.create(model=model, prompt="The sky is", max_tokens=6, echo=True)
    assert echoed.choices[0].text == "The sky is" + text.choices[0].text
    many = client.completions.create(model=model, prompt=["The sky is", "1, 2, 3,"], n=2, max_tokens=4)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == text.choices[0].text[: len(many.choices[0].text)]
    assert many.usage is not None
    assert many.usage.prompt_tokens == len(ids) + len(server.engine.tokenizer.encode("1, 2, 3,"))


def test_streamed_completion_with_logprobs_equals_the_whole(client: openai.OpenAI, model: str) -> None:
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, logprobs=2)
    chunks = list(
        client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, logprobs=2, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.text_offset is not None
    streamed_tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []]
    assert streamed_tokens == logprobs.tokens
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]


@pytest.mark.parametrize(
    ("kwargs", "param", "code"),
    [
        ({"max_tokens": 65}, "max_tokens", None),
        ({"temperature": 3}, "temperature", None),
        ({"n": 5}, "n", None),
        ({"top_logprobs": 2}, "top_logprobs", None),
        ({"stream_options": {"include_usage": True}}, "stream_options", None),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", None),
        ({"extra_body": {"max_token": 3}}, "max_token", "unknown_parameter"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "missing_required_parameter"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
            "unsupported_parameter",
        ),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(
    client: openai.OpenAI, model: str, kwargs: dict[str, object], param: str, code: str | None
) -> None:
    request: dict[str, object] = {"model": model, "messages": QUESTION, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)  # type: ignore[call-overload]
    assert caught.value.param == param
    assert caught.value.code == code
    assert caught.value.type == "invalid_request_error"


def test_prompt_over_the_endpoint_limit_is_context_length_exceeded(client: openai.OpenAI, model: str) -> None:
    long_text = "word " * (MAX_PROMPT_TOKENS + 20)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": long_text}])
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "messages")


def test_prompt_plus_max_tokens_over_the_context_is_context_length_exceeded(
    client: openai.OpenAI, server: RunningServer, model: str
) -> None:
    # Within the endpoint's prompt limit, but 200 + 64 tokens do not fit a 256-token context.
    tokens = server.engine.tokenizer.encode("word " * MAX_PROMPT_TOKENS)[:MAX_PROMPT_TOKENS]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=tokens, max_tokens=64)
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "prompt")
    assert f"maximum context length is {MAX_CONTEXT}" in caught.value.message


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert (caught.value.code, caught.value.param) == ("model_not_found", "model")


def test_wrong_api_key_is_401(server: RunningServer, model: str) -> None:
    intruder = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        intruder.chat.completions.create(model=model, messages=QUESTION)
    assert caught.value.code == "invalid_api_key"
