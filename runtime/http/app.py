"""The ASGI app: routes, auth, error shapes and the engine's lifecycle.

The engine loads on a background thread after the server starts listening, so `/health` answers at once
and `/ready` turns 200 when requests can be served; `/v1/*` answer 503 until then.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio.lowlevel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runtime.api.errors import APIError
from runtime.api.metrics import PROMETHEUS_TYPE
from runtime.bundle import CLASSIFICATION_TASK, EMBEDDING_TASK
from runtime.http.adapters import adapter_card, adapter_cards, adapter_routes
from runtime.http.endpoints import CLIENT_CLOSED, Handler, task_routes
from runtime.http.openapi import document
from runtime.http.openapi_routes import core_pieces
from runtime.http.state import ServerSettings, ServerState, log
from runtime.http.wire import WireFormat, http_error_handler

if TYPE_CHECKING:
    from runtime.engine.engine import Engine


def create_app(
    settings: ServerSettings,
    load_engine: Callable[[], Engine],
    *,
    on_load_failure: Callable[[], None] | None = None,
    sagemaker: bool = False,
    task: str = "chat",
) -> Starlette:
    """An app serving `settings.policy.model_name`; `load_engine` returns a started engine.

    `on_load_failure` runs (on the loader thread) if loading raises, e.g. to stop the server process.
    `sagemaker` adds SageMaker's `/ping` and `/invocations` on top of the same handlers.
    """
    state = ServerState(settings)

    def load() -> None:
        if not state.load(load_engine) and on_load_failure is not None:
            on_load_failure()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loader = threading.Thread(target=load, name="onnxfn-engine-loader", daemon=True)
        loader.start()
        # anyio loads its asyncio backend on first use: ~30 ms of imports that would otherwise run beside
        # the first request's prefill (the streaming response's task group needs it).
        await anyio.lowlevel.checkpoint()
        yield
        loader.join()
        state.shutdown()

    def api(route: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            wire = WireFormat.for_accept(request.headers.get("accept"))
            try:
                state.auth.check(request.headers.get("authorization"))
                response = await handler(state, request, wire)
            except APIError as err:
                response = wire.error_response(err)
            except ClientDisconnect:
                response = Response(status_code=CLIENT_CLOSED)
            state.metrics.requests.labels(route, str(response.status_code)).inc()
            return response

        return endpoint

    def guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """A non-API route that needs the key too (auth.py says which routes stay open and why)."""

        async def endpoint(request: Request) -> Response:
            try:
                state.auth.check(request.headers.get("authorization"))
            except APIError as err:
                return WireFormat.for_accept(request.headers.get("accept")).error_response(err)
            return await handler(request)

        return endpoint

    async def ready(request: Request) -> Response:
        return _ready(state, detailed=state.auth.allows(request.headers.get("authorization")))

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=PROMETHEUS_TYPE)

    # Each route's owner adds its `RoutePiece` here along with its `Route` (see runtime/http/openapi.py).
    openapi = document(state.policy, core_pieces(state.policy, task), auth=state.auth.enabled)

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(openapi)

    routes = [
        Route("/health", _health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/openapi.json", guarded(openapi_json), methods=["GET"]),
        Route("/v1/models", api("models", _list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", api("model", _get_model), methods=["GET"]),
        *task_routes(task, api),  # chat and completions, or embeddings, as the bundle's task says
    ]
    if task not in (EMBEDDING_TASK, CLASSIFICATION_TASK):
        routes += adapter_routes(api)  # LoRA adapters: listed, added and removed while serving
    if sagemaker:
        from runtime.http.sagemaker import sagemaker_routes

        routes += sagemaker_routes(state, api)
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            HTTPException: http_error_handler(where="", see="/v1/models, /v1/chat/completions"),
            Exception: _internal_error,
        },
    )
    app.state.server = state
    return app


async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def _ready(state: ServerState, *, detailed: bool) -> Response:
    """Probes need only the status; the model name and a load error (paths, versions) need the key."""
    if state.engine is not None:
        if not detailed:
            return JSONResponse({"status": "ready"})
        # What prompts run through: "loading" while a bundle's prefill graph is still being built.
        graph = getattr(state.engine, "prefill_graph", None)  # encoders have a single graph
        warm = getattr(state.engine, "warm", True)  # false while background start-up work goes on
        return JSONResponse(
            {
                "status": "ready",
                "model": state.policy.model_name,
                "warm": warm,
                **({"prompt_graph": graph} if graph else {}),
            }
        )
    if state.load_error is not None:
        return JSONResponse({"status": "failed", **({"error": state.load_error} if detailed else {})}, status_code=503)
    return JSONResponse({"status": "loading"}, status_code=503)


def _model_card(state: ServerState) -> dict[str, object]:
    return {"id": state.policy.model_name, "object": "model", "created": state.created, "owned_by": "onnxfn"}


async def _list_models(state: ServerState, request: Request, wire: WireFormat) -> Response:
    """The function's model and, `FUNCTION:NAME`, each LoRA adapter it serves (runtime/http/adapters.py)."""
    return wire.response({"object": "list", "data": [_model_card(state), *adapter_cards(state)]})


async def _get_model(state: ServerState, request: Request, wire: WireFormat) -> Response:
    model_id = request.path_params["model_id"]
    if model_id == state.policy.model_name:
        return wire.response(_model_card(state))
    card = adapter_card(state, model_id)
    if card is None:
        raise APIError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")
    return wire.response(card)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    error = APIError(500, "the server failed to handle this request", error_type="server_error")
    return WireFormat.for_accept(request.headers.get("accept")).error_response(error)
