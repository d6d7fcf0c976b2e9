"""The gateway's HTTP app: one OpenAI endpoint for every function deployed on this machine.

- `POST /v1/...` goes to the function the body's `model` names (JSON or msgpack bodies, read within the
  servers' limit: body.py), through its own server: the request and the answer (SSE streams chunk by chunk)
  are relayed as they are (relay.py), so every route, parameter and error of the runtime works here too. An
  idle function is woken first, a crashed one started again (lifecycle.py).
- `GET /v1/models` lists the functions the presented key opens and their adapters (models.py);
  `GET /v1/models/NAME` one of them.
- `GET /` is a page of the functions with live figures and a chat (page.py).
- `GET /health` says it is the gateway (`pkg` tells it from another program on the port that way).

Each function keeps its own API key: the gateway checks it before waking or relaying anything (401 in
OpenAI's shape), and the server checks it again. A key that opens none of the functions is refused before
the body is read. Errors are OpenAI-shaped, in msgpack when `Accept` asks.
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

from packager.gateway import models
from packager.gateway.body import Disconnected, model_of, read_body, refuse_declared
from packager.gateway.control import SERVICE
from packager.gateway.functions import Function, Registry
from packager.gateway.lifecycle import Lifecycle
from packager.gateway.page import routes as page_routes
from packager.gateway.relay import Receive, Scope, Send, relay
from packager.gateway.upstream import Unreachable
from runtime.api.errors import APIError
from runtime.http.auth import BearerAuth
from runtime.http.host_guard import HostGuard
from runtime.http.wire import WireFormat, http_error_handler

# Attempts to reach a function's server for one request: each failed one first finds out why (lifecycle.recover)
# and waits for what it found (a wake, a restart, a deploy), so this bounds only servers that keep refusing.
ATTEMPTS = 8


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

    async def admit(self, authorization: str | None) -> None:
        """A 401 unless the key opens a function deployed here (or one needs no key): before any body is read."""
        await self.registry.refresh()
        if any(function.opens(authorization) for function in self.registry.all()):
            return
        await self.registry.refresh(force=True)  # a function deployed since the last look
        self.registry.opened(authorization)

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`POST /v1/...`: to the function the body's `model` names."""
        headers = Headers(scope=scope)
        try:
            authorization = headers.get("authorization")
            await self.admit(authorization)
            refuse_declared(scope["headers"])
            body = await read_body(receive)
            # `FUNCTION:ADAPTER` is the function's own business (its server checks the adapter): route by FUNCTION.
            model = (await model_of(body, headers.get("content-type"))).split(":", 1)[0]
            function = await self.route(model, authorization)
            await self.deliver(function, scope, receive, send, body)
        except APIError as err:
            await WireFormat.for_accept(headers.get("accept")).error_response(err)(scope, receive, send)
        except Disconnected:
            pass  # nobody to answer

    async def deliver(self, function: Function, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        """Relay to the function's server once it runs; a request that reached no server is sent again once the
        reason is dealt with (a wake, a restart, a redeploy's switch), so none of those costs a client an error."""
        problem = ""
        for _ in range(ATTEMPTS):
            woke = await self.lifecycle.ready(function)
            try:
                broke = await relay(function, scope, receive, send, body, woke)
            except Unreachable as exc:
                problem = str(exc)
                await self.lifecycle.recover(function, problem)
                continue
            except APIError as err:
                self._after(function, err)
                raise
            self._after(function, broke)
            return
        raise APIError(
            503,
            f"the server of {function.name} does not answer ({problem}); `pkg status "
            f"{function.deployment.function_dir}` says why, and `pkg deploy` starts it again",
            error_type="server_error",
            code="function_unavailable",
        )

    def _after(self, function: Function, failure: APIError | None) -> None:
        """A server that ended mid-answer is started again now: the next request finds it under way."""
        if failure is not None and failure.code == "function_crashed":
            self.lifecycle.crashed(function)


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
        return wire.response({"object": "list", "data": [card for f in opened for card in models.cards(f)]})

    async def get_model(request: Request) -> Response:
        wire = WireFormat.for_accept(request.headers.get("accept"))
        model_id = request.path_params["model_id"]
        name, colon, adapter = model_id.partition(":")
        try:
            function = await gateway.route(name, request.headers.get("authorization"))
            if colon and adapter not in models.adapters(function):
                raise _no_adapter(function, model_id)
        except APIError as err:
            return wire.error_response(err)
        return wire.response(models.card(function, adapter if colon else None))

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

    return HostGuard(app)  # Host, Origin and body types a web page could send: refused (host_guard.py)


def _no_adapter(function: Function, model_id: str) -> APIError:
    served = ", ".join(f"{function.name}:{name}" for name in models.adapters(function)) or "none"
    return APIError(
        404,
        f"The model {model_id!r} does not exist; {function.name} serves these adapters: {served}",
        param="model",
        code="model_not_found",
    )
