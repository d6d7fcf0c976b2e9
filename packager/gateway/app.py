"""The gateway's HTTP app: one OpenAI endpoint for every function deployed on this machine.

- `POST /v1/...` goes to the function the body's `model` names (JSON or msgpack bodies), through its own
  server: the request and the response (SSE streams chunk by chunk) are relayed as they are, so every
  route, parameter and error of the runtime works here too. An idle function is woken first
  (lifecycle.py).
- `GET /v1/models` lists the functions the presented key opens; `GET /v1/models/NAME` one of them.
- `GET /health` says it is the gateway (`pkg` tells it from another program on the port that way).

Each function keeps its own API key: the gateway checks it before waking or relaying anything (401 in
OpenAI's shape), and the server checks it again. Errors are OpenAI-shaped, in msgpack when `Accept` asks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from packager.gateway.control import SERVICE
from packager.gateway.functions import Function, Registry
from packager.gateway.lifecycle import Lifecycle
from runtime.api.encoding import decode_body
from runtime.api.errors import APIError
from runtime.http.auth import BearerAuth
from runtime.http.wire import WireFormat

log = logging.getLogger("onnxfn.gateway")
MAX_BODY_BYTES = 32 << 20  # well above any server's own limit, which answers 413 itself
# Per connection, not per message: never relayed (RFC 9110 7.6.1); `host` and `content-length` are set anew.
_HOP_BY_HOP = frozenset(
    ("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length")
)  # fmt: skip
_NOT_RELAYED_BACK = (_HOP_BY_HOP - {"content-length"}) | {"date", "server"}  # uvicorn writes its own
WOKE_HEADER = "x-onnxfn-woke"  # on a response that waited for its function to start again: how, how long


class Gateway:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.lifecycle = Lifecycle(registry)

    async def route(self, model: str, authorization: str | None) -> Function:
        """The function `model` names, if the key opens it; else the 4xx that says what is wrong."""
        await self.registry.refresh()
        found = self.registry.named(model)
        if not found:
            await self.registry.refresh(force=True)
            found = self.registry.named(model)
        if not found:
            raise self._not_deployed(model, authorization)
        if len(found) > 1:
            folders = ", ".join(f.deployment.function_dir or str(f.directory) for f in found)
            raise APIError(
                409,
                f"{len(found)} deployed functions are named {model!r} ({folders}); the gateway routes by name: "
                "destroy all but one (pkg destroy FOLDER)",
                param="model",
                code="ambiguous_model",
            )
        function = found[0]
        if function.key_problem:
            raise APIError(
                503,
                f"the gateway cannot check keys for {model}: {function.key_problem}",
                error_type="server_error",
                code="key_unavailable",
            )
        BearerAuth(function.key).check(authorization)  # 401 in OpenAI's shape
        return function

    def _not_deployed(self, model: str, authorization: str | None) -> APIError:
        opened = sorted({f.name for f in self.registry.all() if f.opens(authorization)})
        where = f"deployed: {', '.join(opened)} (GET /v1/models lists them)" if opened else (
            f"deploy it: pkg deploy functions/{model} --target local"
        )  # fmt: skip
        return APIError(
            404, f"the model {model!r} is not deployed on this machine; {where}", param="model", code="model_not_found"
        )

    def models(self, authorization: str | None) -> list[dict[str, Any]]:
        cards = [_card(f) for f in self.registry.all() if f.opens(authorization)]
        if not cards and self.registry.all():
            given = "incorrect API key provided" if authorization else "missing bearer token"
            raise APIError(
                401,
                f"{given}: it opens none of the functions deployed here; send 'Authorization: Bearer <API key>' "
                "with a function's key (pkg status functions/NAME --api-key prints it)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return cards


def _card(function: Function) -> dict[str, Any]:
    return {
        "id": function.name,
        "object": "model",
        "created": int(function.deployment.started_at),
        "owned_by": "onnxfn",
    }


async def _relay(function: Function, request: Request, body: bytes, woke: str) -> Response:
    """Send the request to the function's server and stream its answer back as it comes."""
    client = function.client()
    headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _HOP_BY_HOP]
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    outgoing = client.build_request(request.method, path, headers=headers, content=body)
    function.in_flight += 1  # before any await: the idle check must see it at once
    try:
        upstream = await client.send(outgoing, stream=True)
    except httpx.TransportError as exc:
        function.finished()
        raise APIError(
            503,
            f"the server of {function.name} does not answer at {function.deployment.url} ({type(exc).__name__}); "
            f"`pkg status {function.deployment.function_dir}` says why, and `pkg deploy` starts it again",
            error_type="server_error",
            code="function_unavailable",
        ) from exc
    response_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_RELAYED_BACK}
    if woke:
        response_headers[WOKE_HEADER] = woke
    return StreamingResponse(_chunks(upstream, function), status_code=upstream.status_code, headers=response_headers)


async def _chunks(upstream: httpx.Response, function: Function) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        function.finished()
        # Closing an unfinished response drops its connection: the server sees the client go and frees the slot.
        with anyio.CancelScope(shield=True):
            await upstream.aclose()


def create_app(registry: Registry) -> Starlette:
    gateway = Gateway(registry)

    async def forward(request: Request) -> Response:
        wire = WireFormat.for_accept(request.headers.get("accept"))
        try:
            body = await _read_body(request)
            model = _model(body, request.headers.get("content-type"))
            function = await gateway.route(model, request.headers.get("authorization"))
            woke = await gateway.lifecycle.ready(function)
            return await _relay(function, request, body, woke)
        except APIError as err:
            return wire.error_response(err)

    async def list_models(request: Request) -> Response:
        wire = WireFormat.for_accept(request.headers.get("accept"))
        await registry.refresh(force=True)
        try:
            return wire.response({"object": "list", "data": gateway.models(request.headers.get("authorization"))})
        except APIError as err:
            return wire.error_response(err)

    async def get_model(request: Request) -> Response:
        wire = WireFormat.for_accept(request.headers.get("accept"))
        try:
            function = await gateway.route(request.path_params["model_id"], request.headers.get("authorization"))
        except APIError as err:
            return wire.error_response(err)
        return wire.response(_card(function))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "service": SERVICE, "functions": len(registry.all())})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await registry.refresh(force=True)
        monitor = asyncio.get_running_loop().create_task(gateway.lifecycle.monitor())
        yield
        monitor.cancel()
        for function in registry.all():
            await function.close()

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
            Route("/v1/{rest:path}", forward, methods=["POST"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )


async def _read_body(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _model(body: bytes, content_type: str | None) -> str:
    """The body's `model`: which function the request is for."""
    data = decode_body(body, content_type, text=False)  # a 400 naming the format when it does not parse
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, str) or not model:
        raise APIError(
            400,
            "the request has no `model`: the gateway routes by it; give a deployed function's name "
            "(GET /v1/models lists them)",
            param="model",
            code="missing_model",
        )
    return model


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    wire = WireFormat.for_accept(request.headers.get("accept"))
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path} on the gateway; see GET /v1/models, POST /v1/..."
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return wire.error_response(APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None))
