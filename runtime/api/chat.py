"""Chat completions: messages through the chat template into the engine, OpenAI's shapes out (whole or chunked)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from runtime.api.errors import from_engine_error, unknown_adapter
from runtime.api.formatting import ResponseMeta, chat_logprob, check_prompt_length
from runtime.api.generation import Generation
from runtime.api.protocol import ChatRequest, check_adapter
from runtime.api.service import ModelService
from runtime.api.tools import ToolCall, ToolCallParser, split_output
from runtime.engine.request import GenerationRequest, InvalidRequestError, SequenceOutput, UnknownAdapterError


def submit_chat(state: ModelService, parsed: ChatRequest) -> tuple[Generation, ResponseMeta]:
    """Render the chat through the template and queue it; shared by HTTP and the queue frontends.

    A request with a grammar must have been through `resolve_grammar` (compiling it here would hold the
    event loop).
    """
    if parsed.grammar_source is not None:
        raise RuntimeError("the request's grammar is not compiled yet: await resolve_grammar(state, parsed) first")
    engine = state.require_engine()
    check_adapter(engine.adapters, state.policy, parsed.adapter)
    try:
        text = engine.tokenizer.apply_chat_template(list(parsed.messages), add_generation_prompt=True)
    except InvalidRequestError as exc:
        raise from_engine_error(exc) from exc
    prompt = engine.tokenizer.encode(text)
    check_prompt_length(len(prompt), state.policy.max_prompt_tokens, engine.max_context, "messages")
    meta = ResponseMeta.new("chatcmpl", parsed.model, state.settings.fingerprint)
    request_for_engine = GenerationRequest(meta.id, tuple(prompt), parsed.sampling, adapter=parsed.adapter)
    try:
        generation = Generation(
            engine, [request_for_engine], state.metrics.timer(), prompt_param="messages", grammar=parsed.grammar
        )
    except UnknownAdapterError as exc:  # removed since `check_adapter`
        raise unknown_adapter(state.policy.model_name, parsed.adapter or "", exc.available) from exc
    return generation, meta


def _delta_choice(output: SequenceOutput, parsed: ChatRequest, delta: dict[str, Any]) -> dict[str, Any]:
    logprobs = {"content": [chat_logprob(e) for e in output.logprobs]} if parsed.sampling.logprobs else None
    return {"index": output.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}


def _tool_deltas(parser: ToolCallParser, text: str, calls_so_far: int, final: bool) -> list[dict[str, Any]]:
    """The content and `tool_calls` deltas `text` completes; calls are numbered on from `calls_so_far`."""
    deltas: list[dict[str, Any]] = []
    pieces = [*parser.push(text), *(parser.finish() if final else ())]
    for piece in pieces:
        if isinstance(piece, ToolCall):
            deltas.append({"tool_calls": [piece.to_json(calls_so_far)]})
            calls_so_far += 1
        elif deltas and "content" in deltas[-1]:
            deltas[-1]["content"] += piece
        else:
            deltas.append({"content": piece})
    return deltas


async def chat_chunks(
    generation: Generation, meta: ResponseMeta, parsed: ChatRequest
) -> AsyncGenerator[dict[str, Any], None]:
    """The `chat.completion.chunk` objects of a streamed reply, ending with the usage chunk when asked for."""

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = meta.envelope("chat.completion.chunk", choices)
        if parsed.include_usage:
            body["usage"] = None
        return body

    tools_active = parsed.tools is not None and parsed.tools.active
    parsers = [ToolCallParser() for _ in range(parsed.sampling.n)]
    calls = [0] * parsed.sampling.n

    for index in range(parsed.sampling.n):
        role = {"role": "assistant", "content": ""}
        yield chunk([{"index": index, "delta": role, "logprobs": None, "finish_reason": None}])
    async for _, output in generation.outputs():
        index, ended = output.index, output.finish_reason is not None
        if not tools_active:
            deltas = [{"content": output.text}] if output.text or output.logprobs else []
        else:
            deltas = _tool_deltas(parsers[index], output.text, calls[index], ended)
            calls[index] += sum(len(d.get("tool_calls", ())) for d in deltas)
            if output.logprobs and not deltas:
                deltas = [{"content": ""}]
        for delta in deltas:
            yield chunk([_delta_choice(output, parsed, delta)])
        if output.finish_reason is not None:
            finish = _finish_reason(output.finish_reason.value, calls[index] > 0)
            yield chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}])
    if parsed.include_usage:
        yield {**meta.envelope("chat.completion.chunk", []), "usage": generation.usage}


async def collect_chat(generation: Generation, meta: ResponseMeta, parsed: ChatRequest) -> dict[str, Any]:
    """The whole `chat.completion` object once every sequence has finished."""
    n = parsed.sampling.n
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    try:
        async for _, output in generation.outputs():
            texts[output.index].append(output.text)
            logprobs[output.index].extend(chat_logprob(e) for e in output.logprobs)
            if output.finish_reason is not None:
                finish[output.index] = output.finish_reason.value
    finally:
        generation.cancel()
    choices: list[dict[str, Any]] = [
        {
            "index": i,
            "message": _message("".join(texts[i]), parsed),
            "logprobs": {"content": logprobs[i]} if parsed.sampling.logprobs else None,
            "finish_reason": finish[i],
        }
        for i in range(n)
    ]
    for choice in choices:
        choice["finish_reason"] = _finish_reason(choice["finish_reason"], "tool_calls" in choice["message"])
    return {**meta.envelope("chat.completion", choices), "usage": generation.usage}


def _message(text: str, parsed: ChatRequest) -> dict[str, Any]:
    if parsed.tools is None or not parsed.tools.active:
        return {"role": "assistant", "content": text}
    content, calls = split_output(text)
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": content, "tool_calls": [c.to_json() for c in calls]}


def _finish_reason(finish: str | None, called_tools: bool) -> str | None:
    """OpenAI reports a reply that ended after calling tools as `tool_calls`."""
    return "tool_calls" if called_tools and finish == "stop" else finish
