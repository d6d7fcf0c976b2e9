"""The gateway's HTTP app: one OpenAI endpoint for every function deployed on this machine.

- `POST /v1/...` goes to the function the body's `model` names (JSON or msgpack bodies), through its own
  server: the request and the answer (SSE streams chunk by chunk) are relayed as they are (relay.py), so
  every route, parameter and error of the runtime works here too. An idle function is woken first
  (lifecycle.py).
- `GET /v1/models` lists the functions the presented key opens; `GET /v1/models/NAME` one of them.
- `GET /` is a page of the functions with live figures and a chat (page.py).
- `GET /health` says it is the gateway (`pkg` tells it from another program on the port that way).

Each function keeps its own API key: the gateway checks it before waking or relaying anything (401 in
OpenAI's shape), and the server checks it again. Errors are OpenAI-shaped, in msgpack when `Accept` asks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from packager.gateway.control import SERVICE
from packager.gateway.functions import Function, Registry
from packager.gateway.lifecycle import Lifecycle
from packager.gateway.page import routes as page_routes
from packager.gateway.relay import Disconnected, Receive, Scope, Send, read_body, relay
from runtime.api.encoding import decode_body
from runtime.api.errors import APIError
from runtime.http.auth import BearerAuth
from runtime.http.wire import WireFormat, http_error_handler


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

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`POST /v1/...`: to the function the body's `model` names."""
        headers = Headers(scope=scope)
        try:
            body = await read_body(receive)
            # `FUNCTION:ADAPTER` is the function's own business (its server checks the adapter): route by FUNCTION.
            model = _model(body, headers.get("content-type")).split(":", 1)[0]
            function = await self.route(model, headers.get("authorization"))
            woke = await self.lifecycle.ready(function)
            await relay(function, scope, receive, send, body, woke)
        except APIError as err:
            await WireFormat.for_accept(headers.get("accept")).error_response(err)(scope, receive, send)
        except Disconnected:
            pass  # nobody to answer


def _card(function: Function) -> dict[str, Any]:
    created = int(function.deployment.started_at)
    return {"id": function.name, "object": "model", "created": created, "owned_by": "onnxfn"}


def create_app(registry: Registry) -> Any:
    """The ASGI app: `POST /v1/...` straight to the relay (it runs per token: no framework on that path),
    everything else through Starlette."""
    gateway = Gateway(registry)

    async def list_models(request: Request) -> Response:
        wire = WireFormat.for_accept(request.headers.get("accept"))
        await registry.refresh(force=True)
        try:
            opened = registry.opened(request.headers.get("authorization"))
        except APIError as err:
            return wire.error_response(err)
        return wire.response({"object": "list", "data": [_card(function) for function in opened]})

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

    framework = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
            *page_routes(registry),
        ],
        lifespan=lifespan,
        exception_handlers={
            HTTPException: http_error_handler(where=" on the gateway", see="GET /v1/models, POST /v1/..."),
        },
    )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/v1/"):
            await gateway.forward(scope, receive, send)
        else:
            await framework(scope, receive, send)

    return app


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
            code="missing_required_parameter",  # the runtime's code for it
        )
    return model
