"""OpenAI chat and completions request bodies, validated into the engine's `SamplingParams`.

Field policy (the same for both endpoints):
- Fields this server does not know are rejected with 400 `unknown_parameter`, as OpenAI does.
- OpenAI fields with no effect here are accepted and ignored: `user`, `metadata`, `store`, `service_tier`,
  `parallel_tool_calls`, `safety_identifier`, `prompt_cache_key`.
- OpenAI features this server cannot honour are rejected with 400 `unsupported_parameter` when they would
  change the result: legacy `functions`, audio, predicted outputs, completion `suffix`, `best_of` above `n`.
- Structured output (docs/structured-output.md): `response_format` `json_object` / `json_schema`, plus the
  extension types `regex` and `grammar` (Lark or GBNF), and vLLM's `guided_json`, `guided_regex`,
  `guided_grammar`, `guided_choice`; `tools` / `tool_choice` / `parallel_tool_calls` (runtime/api/tools.py).
  Here they are only sized (`RequestPolicy.max_grammar_bytes`, `max_tools`, `max_tool_schema_bytes`); the
  grammar is built and compiled off the event loop before the request is queued (api/grammar_compile.py).
- vLLM-style extensions are accepted (the openai client sends them through `extra_body`): `top_k`, `min_p`,
  `repetition_penalty`, `ignore_eos`, `stop_token_ids`.
- Unset sampling fields take the function's defaults (`temperature`, `top_p`, `max_tokens`), not OpenAI's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from runtime.api.errors import APIError, invalid_param, unknown_adapter
from runtime.api.fields import BodyReader, show
from runtime.api.structured_output import GUIDED, GrammarSource, no_grammar, structured_output
from runtime.api.tools import ToolRequest, history_message, parse_tools, tool_grammar, with_tools_prompt
from runtime.engine.request import SamplingParams

if TYPE_CHECKING:
    from runtime.engine.adapters import EngineAdapters
    from runtime.engine.grammar_cache import CompiledGrammar

_IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
_EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")
_COMMON = (
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    *_IGNORED,
    *_EXTENSIONS,
)
_CHAT_FIELDS = frozenset(
    (
        *_COMMON,
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        *GUIDED,
        "functions",
        "function_call",
        "modalities",
        "audio",
        "prediction",
    )
)
_COMPLETION_FIELDS = frozenset((*_COMMON, "prompt", "echo", "suffix", "logprobs", "best_of"))
_MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
# Keys the openai SDK writes into assistant messages a client sends back as history; harmless while empty.
_EMPTY_MESSAGE_FIELDS = ("function_call", "refusal", "audio", "annotations")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
_INT64 = 2**63


@dataclass(frozen=True)
class RequestPolicy:
    """What a request may ask for and what it gets when it does not say; set from the server's flags."""

    model_name: str
    vocab_size: int
    default_temperature: float = 1.0
    default_top_p: float = 1.0
    default_max_tokens: int = 256
    max_tokens_limit: int = 4096
    max_prompt_tokens: int | None = None
    max_n: int = 16
    max_prompts: int = 16
    max_stop: int = 16
    system_prompt: str | None = None
    # What one request may constrain its output with, in bytes of its JSON (a string: its UTF-8 bytes): a
    # schema, regex, grammar or choice list; the functions in `tools`, and their parameter schemas together.
    # Within these a grammar compiles in well under a second (docs/structured-output.md#limits).
    max_grammar_bytes: int = 128 << 10
    max_tools: int = 128
    max_tool_schema_bytes: int = 128 << 10


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict[str, str], ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    model: str  # what the client sent, echoed in the responses' `model`
    adapter: str | None = None  # the LoRA adapter `model` names (`FUNCTION:ADAPTER`); None: the base
    tools: ToolRequest | None = None  # set when the request offers tools (its choice may still be "none")
    # Set by parsing when the request constrains its output; `grammar_compile.resolve_grammar` turns it
    # into `grammar` (and `sampling.grammar`), off the event loop, before the request may be queued.
    grammar_source: GrammarSource | None = None
    grammar: CompiledGrammar | None = None


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    model: str  # what the client sent, echoed in the responses' `model`
    adapter: str | None = None  # the LoRA adapter `model` names (`FUNCTION:ADAPTER`); None: the base


def unsupported(param: str, message: str) -> APIError:
    return invalid_param(param, message, code="unsupported_parameter")


def parse_chat(body: Any, policy: RequestPolicy) -> ChatRequest:
    reader = BodyReader(body, _CHAT_FIELDS)
    model, adapter = _check_model(reader, policy)
    _reject_chat_features(reader)
    tools = parse_tools(reader, max_tools=policy.max_tools, max_schema_bytes=policy.max_tool_schema_bytes)
    source = structured_output(reader, policy.max_grammar_bytes)
    messages = _messages(reader.raw("messages"), policy)
    if tools is not None and tools.active:
        if source is not None:
            raise unsupported(
                "response_format", "'response_format' cannot be combined with tools unless 'tool_choice' is 'none'"
            )
        messages = with_tools_prompt(messages, tools)
        source = GrammarSource("tools", partial(tool_grammar, tools), tools)
    elif tools is not None:  # offered, not used: their schemas are still checked
        source = replace(source, tools=tools) if source is not None else GrammarSource("tools", no_grammar, tools)
    logprobs = reader.boolean("logprobs", False)
    top_logprobs = reader.integer("top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    if reader.has("top_logprobs") and not logprobs:
        raise invalid_param("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
    limit_key = "max_completion_tokens" if reader.has("max_completion_tokens") else "max_tokens"
    sampling = _sampling(reader, policy, limit_key=limit_key, logprobs=logprobs, top_logprobs=top_logprobs)
    stream, include_usage = _stream_mode(reader)
    return ChatRequest(
        messages=messages,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        model=model,
        adapter=adapter,
        tools=tools,
        grammar_source=source,
    )


def parse_completion(body: Any, policy: RequestPolicy) -> CompletionRequest:
    reader = BodyReader(body, _COMPLETION_FIELDS)
    model, adapter = _check_model(reader, policy)
    prompts = _prompts(reader.raw("prompt"), policy)
    if reader.raw("suffix") not in (None, ""):
        raise unsupported("suffix", "'suffix' (text insertion) is not supported by this model")
    top = reader.integer("logprobs", None, lo=0, hi=MAX_COMPLETION_LOGPROBS)
    echo = reader.boolean("echo", False)
    if echo and top is not None:
        raise unsupported("echo", "'echo' with 'logprobs' needs prompt logprobs, which this server does not compute")
    sampling = _sampling(reader, policy, limit_key="max_tokens", logprobs=top is not None, top_logprobs=top or 0)
    best_of = reader.integer("best_of", None, lo=1)
    if best_of is not None and best_of != sampling.n:
        raise unsupported("best_of", f"'best_of' must equal 'n' ({sampling.n}); ranking candidates is not supported")
    stream, include_usage = _stream_mode(reader)
    return CompletionRequest(
        prompts=prompts,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        echo=echo,
        model=model,
        adapter=adapter,
    )


def _check_model(reader: BodyReader, policy: RequestPolicy) -> tuple[str, str | None]:
    """The `model` sent and the adapter it names: `FUNCTION` is the base (None), `FUNCTION:ADAPTER` an adapter
    (whether this server has it is checked against the engine's catalog when the request is submitted)."""
    model = reader.string("model", required=True)
    if model == policy.model_name:
        return model, None
    function, colon, adapter = model.partition(":")
    if colon and function == policy.model_name:
        return model, adapter
    raise APIError(
        404,
        f"The model {model!r} does not exist; this server serves {policy.model_name!r}",
        param="model",
        code="model_not_found",
    )


def check_adapter(adapters: EngineAdapters | None, policy: RequestPolicy, adapter: str | None) -> None:
    """A 404 naming what is served unless the engine has `adapter` (None, the base, it always has)."""
    if adapter is None:
        return
    if adapters is None:
        raise unknown_adapter(policy.model_name, adapter, None)
    if adapters.catalog.get(adapter) is None:
        raise unknown_adapter(policy.model_name, adapter, tuple(adapters.catalog.names()))


def _stream_mode(reader: BodyReader) -> tuple[bool, bool]:
    stream = reader.boolean("stream", False)
    options = reader.nested("stream_options", ("include_usage", "include_obfuscation"))
    if options is None:
        return stream, False
    if not stream:
        raise invalid_param("stream_options", "'stream_options' is only allowed when 'stream' is true")
    return stream, options.boolean("include_usage", False)


def _reject_chat_features(reader: BodyReader) -> None:
    if reader.raw("functions") not in (None, []):
        raise unsupported("functions", "the legacy 'functions' field is not supported; use 'tools'")
    if reader.raw("function_call") not in (None, "none", "auto"):
        raise unsupported("function_call", "the legacy 'function_call' field is not supported; use 'tool_choice'")
    if reader.raw("modalities") not in (None, ["text"]):
        raise unsupported("modalities", "only the 'text' modality is supported")
    for key in ("audio", "prediction"):
        if reader.has(key):
            raise unsupported(key, f"'{key}' is not supported by this model")


def _sampling(
    reader: BodyReader, policy: RequestPolicy, *, limit_key: str, logprobs: bool, top_logprobs: int
) -> SamplingParams:
    limit = policy.max_tokens_limit
    max_tokens = reader.integer(limit_key, min(policy.default_max_tokens, limit), lo=1)
    if max_tokens > limit:
        raise invalid_param(limit_key, f"'{limit_key}' is {max_tokens}, above this endpoint's limit of {limit}")
    top_k = reader.integer("top_k", 0, lo=-1)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=reader.number("temperature", policy.default_temperature, lo=0.0, hi=2.0),
        top_p=reader.number("top_p", policy.default_top_p, lo=0.0, hi=1.0, above=True),
        top_k=max(top_k, 0),  # vLLM spells "off" as -1
        min_p=reader.number("min_p", 0.0, lo=0.0, hi=1.0),
        repetition_penalty=reader.number("repetition_penalty", 1.0, lo=0.0, hi=10.0, above=True),
        presence_penalty=reader.number("presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=reader.number("frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        logit_bias=_logit_bias(reader.raw("logit_bias"), policy.vocab_size),
        seed=reader.integer("seed", None, lo=-_INT64, hi=_INT64 - 1),
        stop=_stop(reader.raw("stop"), policy.max_stop),
        stop_token_ids=_token_ids(reader.raw("stop_token_ids"), "stop_token_ids", policy.vocab_size, allow_empty=True),
        ignore_eos=reader.boolean("ignore_eos", False),
        n=reader.integer("n", 1, lo=1, hi=policy.max_n),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


# OpenAI's own limit; each entry costs work on every decode step of the request.
MAX_LOGIT_BIAS = 300


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_param("logit_bias", f"'logit_bias' must map token ids to numbers, got {show(value)}")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid_param(
            "logit_bias", f"'logit_bias' has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed"
        )
    bias: dict[int, float] = {}
    for key, amount in value.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else _token_id(key)
        if not 0 <= token < vocab_size:
            raise invalid_param("logit_bias", f"logit_bias key {show(key)} is not a token id in [0, {vocab_size})")
        number_ok = isinstance(amount, int | float) and not isinstance(amount, bool)
        if not number_ok or not -100 <= amount <= 100:
            raise invalid_param("logit_bias", f"logit_bias[{key}] = {show(amount)}: expected a number in [-100, 100]")
        bias[token] = float(amount)
    return bias


def _token_id(key: Any) -> int:
    """A JSON key as a token id, -1 unless it is 1-9 ASCII digits ("²".isdigit() is true; int() refuses
    strings of over 4,300 digits)."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9:
        return int(key)
    return -1


def _stop(value: Any, max_stop: int) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid_param("stop", f"'stop' must be a non-empty string or a list of them, got {show(value)}")
    if len(stops) > max_stop:
        raise invalid_param("stop", f"'stop' has {len(stops)} sequences; at most {max_stop} are allowed")
    return tuple(stops)


def _token_ids(value: Any, param: str, vocab_size: int, *, allow_empty: bool) -> tuple[int, ...]:
    if value is None:
        return ()
    valid = isinstance(value, list) and (allow_empty or value)
    if not valid or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value):
        raise invalid_param(param, f"'{param}' must be a list of token ids in [0, {vocab_size}), got {show(value)}")
    return tuple(value)


def _prompts(value: Any, policy: RequestPolicy) -> tuple[str | tuple[int, ...], ...]:
    if value is None:
        raise invalid_param("prompt", "'prompt' is required", code="missing_required_parameter")
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid_param("prompt", f"'prompt' must be a string, a list of strings or token ids, got {show(value)}")
    if len(value) > policy.max_prompts:
        raise invalid_param("prompt", f"'prompt' holds {len(value)} prompts; at most {policy.max_prompts} are allowed")
    prompts: list[str | tuple[int, ...]] = []
    for item in value:
        if isinstance(item, str):
            if not item:
                raise invalid_param("prompt", "'prompt' must not be empty")
            prompts.append(item)
        else:
            prompts.append(_token_ids(item, "prompt", policy.vocab_size, allow_empty=False))
    return tuple(prompts)


def _messages(value: Any, policy: RequestPolicy) -> tuple[dict[str, str], ...]:
    if value is None:
        raise invalid_param("messages", "'messages' is required", code="missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise invalid_param("messages", f"'messages' must be a non-empty list of messages, got {show(value)}")
    messages = [_message(item, f"messages[{i}]") for i, item in enumerate(value)]
    if policy.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": policy.system_prompt})
    return tuple(messages)


def _message(item: Any, path: str) -> dict[str, str]:
    reader = BodyReader(item, (*_MESSAGE_FIELDS, *_EMPTY_MESSAGE_FIELDS), path=path + ".")
    for key in _EMPTY_MESSAGE_FIELDS:
        if reader.raw(key) not in (None, [], ""):
            raise unsupported(reader.name(key), f"'{reader.name(key)}' is not supported by this server")
    role = reader.string("role", required=True)
    if role not in _ROLES:
        allowed = ", ".join(_ROLES)
        raise invalid_param(reader.name("role"), f"role {show(role)} is not supported; use one of {allowed}")
    reader.string("name")
    # An assistant turn that only called tools has no content.
    empty_ok = role == "assistant" and reader.raw("tool_calls") not in (None, [])
    content = (
        "" if empty_ok and reader.raw("content") is None else _content(reader.raw("content"), reader.name("content"))
    )
    return history_message(reader, role, content) or {"role": _ROLES[role], "content": content}


def _content(value: Any, path: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise invalid_param(path, f"'{path}' must be a string or a non-empty list of text parts, got {show(value)}")
    texts = []
    for j, part in enumerate(value):
        part_path = f"{path}[{j}]."
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise unsupported(part_path + "type", f"content part type {show(kind)} is not supported; use text")
        part_reader = BodyReader(part, ("type", "text"), path=part_path)
        part_reader.string("type", required=True)
        texts.append(part_reader.string("text", required=True))
    # vLLM joins text parts with newlines; follow it so the same request renders the same prompt.
    return "\n".join(t for t in texts if t is not None)
