"""A stand-in for a function's server, for the gateway's tests that need no model: deployment records written
by hand, and a small real server (uvicorn) that answers like a function's server would. It runs in a test's own
thread, or as a process of its own (`python -m tests.deploy_local.standin PORT`) where a test must be able to
kill it or measure the gateway apart from it."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from packager.targets.local.records import LocalDeployment

EVENT_GAP = 0.3
ABANDONED: list[int] = []  # streams whose client went away, by how many events were sent (in-thread use)


def record(root: Path, name: str, url: str, key: str | None, folder: str | None = None, pid: int = 2**22 + 1) -> Path:
    """Write a deployment record for `name` served at `url` (by `pid`); its state folder."""
    directory = root / "functions" / f"{folder or name}-0123456789ab"
    directory.mkdir(parents=True)
    if key is not None:
        (directory / "api-key").write_text(key)
    deployment = LocalDeployment(
        function=name, url=url, host="127.0.0.1", port=int(url.rsplit(":", 1)[1]), pid=pid,
        bundle="/nowhere", bundle_digest="sha256:" + "ab" * 32, started_at=time.time(),
        log_file=str(directory / "server.log"), api_key_source="file" if key else "none",
        api_key_location=str(directory / "api-key") if key else "", command=("python", "-m", "runtime"),
        function_dir=f"/project/functions/{folder or name}",
    )  # fmt: skip
    (directory / "state.json").write_text(json.dumps(asdict(deployment)))
    return directory


def stand_in() -> Starlette:
    """Echoes what it got, or streams SSE events (`n` of them, default 3, `gap` seconds apart, default
    EVENT_GAP), noting a stream whose client went away before its end."""

    async def endpoint(request: Request) -> Response:
        body = await request.body()
        if b'"stream": true' in body or b'"stream":true' in body:
            asked = json.loads(body)
            count, gap = int(asked.get("n", 3)), float(asked.get("gap", EVENT_GAP))

            async def events() -> AsyncIterator[bytes]:
                sent = 0
                try:
                    for index in range(count):
                        yield f'data: {{"index": {index}}}\n\n'.encode()
                        sent += 1
                        await asyncio.sleep(gap)
                    yield b"data: [DONE]\n\n"
                except BaseException:
                    ABANDONED.append(sent)
                    raise

            return StreamingResponse(events(), media_type="text/event-stream")
        echoed = {"path": request.url.path, "auth": request.headers.get("authorization"), "bytes": len(body)}
        return Response(json.dumps(echoed), media_type="application/json", headers={"x-upstream": "yes"})

    async def ready(request: Request) -> Response:
        return JSONResponse({"status": "ready"})

    return Starlette(
        routes=[Route("/v1/{rest:path}", endpoint, methods=["POST"]), Route("/ready", ready, methods=["GET"])]
    )


def config(port: int) -> uvicorn.Config:
    # asyncio's loop, as the gateway and the servers run (uvloop's transports are not asyncio.Transport).
    return uvicorn.Config(stand_in(), host="127.0.0.1", port=port, log_level="warning", loop="asyncio")


if __name__ == "__main__":
    uvicorn.Server(config(int(sys.argv[1]))).run()
