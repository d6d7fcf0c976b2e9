"""The gateway's web page: the deployed functions with their state and live figures, and a chat playground.

`/` and `/app.js` are plain files shipped in the package (`page/`, no build step) and hold no data: the page
asks for an API key and sends it, as any client does, to `GET /gateway/functions` and to `/v1/...`. That
lists the functions the key opens (401 when it opens none) with their state and, for those that run, the
figures of their `/metrics`, read by the gateway with each function's own key; the page turns the token
counter into tokens/s between two looks. An idle function is not woken by being looked at.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from packager.gateway import metrics
from packager.gateway.functions import Function, Registry
from runtime.api.errors import APIError
from runtime.bundle import BundleError, read_manifest

SCRAPE_TIMEOUT = 2.0
_FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8")}


def routes(registry: Registry) -> list[Route]:
    tasks: dict[str, str] = {}  # bundle path -> task, read once per bundle

    def task_of(function: Function) -> str:
        bundle = function.deployment.bundle
        if bundle not in tasks:
            try:
                tasks[bundle] = read_manifest(Path(bundle)).task
            except BundleError:
                return "unknown"
        return tasks[bundle]

    async def functions(request: Request) -> Response:
        await registry.refresh(force=True)
        try:
            opened = registry.opened(request.headers.get("authorization"))
        except APIError as err:
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        rows = await asyncio.gather(*(_row(function, task_of(function)) for function in opened))
        return JSONResponse({"functions": rows, "at": time.time()})

    def static(path: str) -> Route:
        name, media_type = _FILES[path]
        body = resources.files("packager.gateway").joinpath("page", name).read_bytes()

        async def serve(request: Request) -> Response:
            return Response(body, media_type=media_type, headers={"cache-control": "no-cache"})

        return Route(path, serve, methods=["GET"])

    return [static("/"), static("/app.js"), Route("/gateway/functions", functions, methods=["GET"])]


async def _row(function: Function, task: str) -> dict[str, Any]:
    deployment = function.deployment
    row: dict[str, Any] = {
        "name": function.name,
        "task": task,
        "state": _state(function),
        "wake": deployment.wake or None,
        "idle_timeout": deployment.idle_timeout,
        "in_flight": function.in_flight,
        "started_at": deployment.started_at,
        "idle_since": deployment.idle_since,
        "requests": None,
        "tokens_out": None,
        "ttft_p50_s": None,
        "tpot_p50_s": None,
    }
    if row["state"] != "ready":
        return row
    try:
        response = await function.client().get("/metrics", headers=function.headers, timeout=SCRAPE_TIMEOUT)
    except httpx.HTTPError:
        return {**row, "state": "unreachable"}
    if response.status_code != 200:
        return {**row, "state": "unreachable"}
    figures = metrics.parse(response.text)
    return {
        **row,
        "requests": figures.requests,
        "tokens_out": figures.tokens_out,
        "ttft_p50_s": figures.ttft_p50_s,
        "tpot_p50_s": figures.tpot_p50_s,
    }


def _state(function: Function) -> str:
    if function.transition is not None:
        return "stopping" if function.transition_kind == "suspend" else "waking"
    return "idle" if function.idle else "ready"
