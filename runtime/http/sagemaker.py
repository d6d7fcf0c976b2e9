"""The SageMaker hosting contract on top of the same handlers: `GET /ping` and `POST /invocations`.

SageMaker starts the container with the argument `serve`, expects port 8080, polls `/ping` until it
answers 200, and forwards `InvokeEndpoint` bodies (and `InvokeEndpointWithResponseStream`, which
gets SSE when the body asks for `stream`) to `/invocations`. A body with `messages` is a chat
completion, one with `prompt` a completion: the OpenAI shapes, so one client speaks to every target.
An endpoint serves one model, so `model` may be left out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgpack
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from runtime.api.encoding import decode_body, dump_json, is_msgpack
from runtime.api.errors import APIError
from runtime.http.endpoints import Handler, create_chat_completion, create_completion
from runtime.http.state import ServerState, read_body
from runtime.http.wire import WireFormat

Wrap = Callable[[str, Handler], Callable[[Request], Awaitable[Response]]]


def sagemaker_routes(state: ServerState, wrap: Wrap) -> list[Route]:
    """`/ping` and `/invocations`; `wrap(route, handler)` adds the app's auth, error shapes and metrics."""

    async def ping(request: Request) -> Response:
        if state.engine is not None:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "failed" if state.load_error else "loading"}, status_code=503)

    return [
        Route("/ping", ping, methods=["GET"]),
        Route("/invocations", wrap("invocations", _invoke), methods=["POST"]),
    ]


async def _invoke(state: ServerState, request: Request, wire: WireFormat) -> Response:
    raw = await read_body(request, state.settings.max_body_bytes)
    content_type = request.headers.get("content-type")
    body = decode_body(raw, content_type)
    if isinstance(body, dict) and "model" not in body:
        body["model"] = state.policy.model_name
        raw = msgpack.packb(body) if is_msgpack(content_type) else dump_json(body)
    if isinstance(body, dict) and "messages" in body:
        handler: Handler = create_chat_completion
    elif isinstance(body, dict) and "prompt" in body:
        handler = create_completion
    else:
        raise APIError(
            400,
            "an invocation body is an OpenAI chat request (with `messages`) or completion request (with `prompt`)",
            param="messages",
            code="invalid_invocation",
        )
    return await handler(state, _replayed(request, raw), wire)


def _replayed(request: Request, raw: bytes) -> Request:
    """The same request with its body readable again; later messages (disconnects) still reach the handler."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)
