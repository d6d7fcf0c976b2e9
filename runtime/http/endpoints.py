"""The POST endpoints over the OpenAI layer, and which of them a bundle's task serves.

Every handler has one shape, `Handler`: the server's state, the request and its wire format in, a response
out; the app wraps each (auth, errors, metrics) before mounting it. A handler reads and decodes the body,
hands it to `runtime.api`, and writes the answer: one body, or a stream framed for the wire (SSE or
msgpack), cancelled the moment the client goes away. A bundle's task picks its routes; the other tasks'
routes answer 400 naming the right endpoint.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from runtime.api.chat import chat_chunks, collect_chat, submit_chat
from runtime.api.classify import classification_body
from runtime.api.completions import collect_completion, completion_chunks, submit_completion
from runtime.api.embeddings import embedding_body
from runtime.api.encoding import decode_body
from runtime.api.errors import APIError
from runtime.api.generation import Generation
from runtime.api.grammar_compile import resolve_grammar
from runtime.api.protocol import parse_chat, parse_completion
from runtime.bundle import CLASSIFICATION_TASK, EMBEDDING_TASK
from runtime.http.disconnect import CancellableStream, unless_disconnected
from runtime.http.state import ServerState, read_body
from runtime.http.wire import WireFormat

CLIENT_CLOSED = 499  # nginx's status for "the client went away first"; only ever seen in metrics and logs

Handler = Callable[[ServerState, Request, WireFormat], Awaitable[Response]]


async def _decoded_body(state: ServerState, request: Request) -> Any:
    raw = await read_body(request, state.settings.max_body_bytes)
    return decode_body(raw, request.headers.get("content-type"))


async def create_chat_completion(state: ServerState, request: Request, wire: WireFormat) -> Response:
    parsed = parse_chat(await _decoded_body(state, request), state.policy)
    parsed = await resolve_grammar(state, parsed)
    generation, meta = submit_chat(state, parsed)
    if parsed.stream:
        chunks = framed_stream(generation, wire, chat_chunks(generation, meta, parsed))
        return CancellableStream(chunks, media_type=wire.stream_media_type)
    finished, body = await unless_disconnected(request.receive, lambda: collect_chat(generation, meta, parsed))
    return wire.response(body) if finished else Response(status_code=CLIENT_CLOSED)


async def create_completion(state: ServerState, request: Request, wire: WireFormat) -> Response:
    parsed = parse_completion(await _decoded_body(state, request), state.policy)
    generation, meta, echoes = submit_completion(state, parsed)
    if parsed.stream:
        chunks = framed_stream(generation, wire, completion_chunks(generation, meta, parsed, echoes))
        return CancellableStream(chunks, media_type=wire.stream_media_type)
    finished, body = await unless_disconnected(
        request.receive, lambda: collect_completion(generation, meta, parsed, echoes)
    )
    return wire.response(body) if finished else Response(status_code=CLIENT_CLOSED)


async def create_embeddings(state: ServerState, request: Request, wire: WireFormat) -> Response:
    return wire.response(await embedding_body(state, await _decoded_body(state, request)))


async def create_classification(state: ServerState, request: Request, wire: WireFormat) -> Response:
    return wire.response(await classification_body(state, await _decoded_body(state, request)))


async def framed_stream(
    generation: Generation, wire: WireFormat, chunks: AsyncIterator[dict[str, Any]]
) -> AsyncGenerator[bytes, None]:
    """`chunks` framed for the wire, then the end marker.

    An error mid-stream becomes an error frame (the status line is already sent), and the generation
    is cancelled however the stream ends, so a client that goes away frees its slot.
    """
    try:
        async for chunk in chunks:
            yield wire.frame(chunk)
        if end := wire.end_of_stream():
            yield end
    except APIError as err:
        yield wire.frame(err.body())
    finally:
        generation.cancel()


def task_routes(task: str, api: Callable[[str, Handler], Callable[[Request], Awaitable[Response]]]) -> list[Route]:
    """The POST routes for a bundle of `task`; the other tasks' routes answer 400 naming the right endpoint."""
    generation: dict[str, tuple[str, Handler]] = {
        "chat": ("/v1/chat/completions", create_chat_completion),
        "completions": ("/v1/completions", create_completion),
    }
    by_task: dict[str, tuple[str, dict[str, tuple[str, Handler]]]] = {
        EMBEDDING_TASK: (
            "an embedding model: use POST /v1/embeddings",
            {"embeddings": ("/v1/embeddings", create_embeddings)},
        ),
        CLASSIFICATION_TASK: (
            "a classification model: use POST /v1/classify",
            {"classify": ("/v1/classify", create_classification)},
        ),
    }
    what, served = by_task.get(
        task, ("a generation model: use POST /v1/chat/completions or /v1/completions", generation)
    )
    refused = {
        label: route for routes in (generation, *(r for _, r in by_task.values())) for label, route in routes.items()
    }
    refuse = _wrong_task(what)
    return [Route(path, api(label, handler), methods=["POST"]) for label, (path, handler) in served.items()] + [
        Route(path, api(label, refuse), methods=["POST"]) for label, (path, _) in refused.items() if label not in served
    ]


def _wrong_task(what: str) -> Handler:
    async def refuse(state: ServerState, request: Request, wire: WireFormat) -> Response:
        raise APIError(
            400,
            f"{state.policy.model_name} is {what}; {request.url.path} is not served",
            param="model",
            code="unsupported_endpoint",
        )

    return refuse
