"""`POST /v1/chat/completions`: messages through the chat template into the engine, OpenAI shapes out."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from runtime.engine.request import GenerationRequest, InvalidRequestError, SequenceOutput
from runtime.server.disconnect import CancellableStream, unless_disconnected
from runtime.server.encoding import WireFormat, decode_body
from runtime.server.errors import from_engine_error
from runtime.server.formatting import ResponseMeta, chat_logprob, check_prompt_length
from runtime.server.generation import Generation, framed_stream
from runtime.server.grammar_compile import resolve_grammar
from runtime.server.protocol import ChatRequest, parse_chat
from runtime.server.state import ServerState, read_body
from runtime.server.tools import ToolCall, ToolCallParser, split_output

CLIENT_CLOSED = 499  # nginx's status for "the client went away first"; only ever seen in metrics and logs


async def create_chat_completion(state: ServerState, request: Request, wire: WireFormat) -> Response:
    raw = await read_body(request, state.settings.max_body_bytes)
    parsed = parse_chat(decode_body(raw, request.headers.get("content-type")), state.policy)
    parsed = await resolve_grammar(state, parsed)
    generation, meta = submit_chat(state, parsed)
    if parsed.stream:
        chunks = _stream(generation, meta, parsed, wire)
        return CancellableStream(chunks, media_type=wire.stream_media_type)
    finished, body = await unless_disconnected(request.receive, lambda: collect_chat(generation, meta, parsed))
    return wire.response(body) if finished else Response(status_code=CLIENT_CLOSED)


def submit_chat(state: ServerState, parsed: ChatRequest) -> tuple[Generation, ResponseMeta]:
    """Render the chat through the template and queue it; shared by HTTP and the queue frontends.

    A request with a grammar must have been through `resolve_grammar` (compiling it here would hold the
    event loop).
    """
    if parsed.grammar_source is not None:
        raise RuntimeError("the request's grammar is not compiled yet: await resolve_grammar(state, parsed) first")
    engine = state.require_engine()
    try:
        text = engine.tokenizer.apply_chat_template(list(parsed.messages), add_generation_prompt=True)
    except InvalidRequestError as exc:
        raise from_engine_error(exc) from exc
    prompt = engine.tokenizer.encode(text)
    check_prompt_length(len(prompt), state.policy.max_prompt_tokens, "messages")
    meta = ResponseMeta.new("chatcmpl", state.policy.model_name, state.settings.fingerprint)
    request_for_engine = GenerationRequest(meta.id, tuple(prompt), parsed.sampling)
    generation = Generation(
        engine, [request_for_engine], state.metrics.timer(), prompt_param="messages", grammar=parsed.grammar
    )
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


def _stream(
    generation: Generation, meta: ResponseMeta, parsed: ChatRequest, wire: WireFormat
) -> AsyncGenerator[bytes, None]:
    def chunk(choices: list[dict[str, Any]]) -> bytes:
        body = meta.envelope("chat.completion.chunk", choices)
        if parsed.include_usage:
            body["usage"] = None
        return wire.frame(body)

    tools_active = parsed.tools is not None and parsed.tools.active
    parsers = [ToolCallParser() for _ in range(parsed.sampling.n)]
    calls = [0] * parsed.sampling.n

    async def chunks() -> AsyncGenerator[bytes, None]:
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

    usage = meta.envelope("chat.completion.chunk", []) if parsed.include_usage else None
    return framed_stream(generation, wire, chunks(), usage)


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
    choices = [
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
