"""The agent's own HTTP API under `/agent`, every route behind the agent token.

- `HEAD /agent/uploads/{sha256}`: 200 with `Upload-Offset` (bytes received) and `Upload-Length`, or 404.
- `PUT /agent/uploads/{sha256}` with `Content-Range: bytes START-END/TOTAL`: append a chunk; START must be
  the current offset (416 with `Upload-Offset` otherwise). Answers 204 with the new `Upload-Offset`.
- `POST /agent/uploads/{sha256}/install`: verify, unpack, load, smoke-test and switch (see `install`).
- `POST /agent/rollback`: serve the previous bundle again.
- `GET /agent/status`: agent version, health, current and previous bundles, install phase, history, and memory:
  what the agent may still allocate with the KV and prefix cache budgets it serves with (`pkg push` checks a bundle
  against it before it uploads).
- `GET /agent/adapters`, `PUT /agent/adapters/{name}` (the adapter file's bytes, `X-Onnxfn-Digest: sha256:HEX`),
  `DELETE /agent/adapters/{name}`: LoRA adapters added without a new bundle (`pkg adapter add --device`). The
  agent checks the digest itself, then hands the request to the served bundle's own `/v1/adapters` route:
  its runtime writes the file atomically into the agent's adapter folder (`ROOT/adapters`, every bundle's
  `--adapter-dir`, so added adapters outlive bundle swaps and restarts) and serves it at once.

Errors use the OpenAI shape the rest of the runtime speaks: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import metadata
from pathlib import Path

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runtime.adapters.layout import NAME, NAME_RULE
from runtime.agent.install import Installer, InstallRefused
from runtime.agent.layout import CURRENT, PREVIOUS
from runtime.agent.uploads import ContentRange, UploadError, checked_id
from runtime.api.errors import APIError, unavailable
from runtime.http.auth import BearerAuth
from runtime.memory_need import free_memory

WRITE_BATCH = 1 << 20  # bytes gathered before one write, so the event loop is not stalled per network read
LOCK_WAIT = 30.0  # seconds a chunk waits for the previous chunk of the same upload (a dead client's) to end
MAX_ADAPTER_BYTES = 2 << 30  # an adapter file is a few MB; a rank-256 one on a large base, a few hundred
DIGEST_HEADER = "x-onnxfn-digest"
Endpoint = Callable[[Request], Awaitable[Response]]


def agent_routes(
    installer: Installer,
    auth: BearerAuth,
    drain_timeout: float,
    api_key: str | None = None,
    budgets: tuple[int, int] = (512 << 20, 128 << 20),
) -> list[Route]:
    """`api_key`: the served bundle's /v1 key, which the adapter routes send when they hand a request on.
    `budgets`: the KV pool and prefix cache bytes a bundle is served with, reported in the status's "memory" so a
    client can tell, before it uploads, whether a bundle fits beside what this device already uses."""
    uploads = installer.uploads
    locks: dict[str, asyncio.Lock] = {}
    started = time.time()

    def guarded(handler: Endpoint) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            try:
                auth.check(request.headers.get("authorization"))
                return await handler(request)
            except APIError as err:
                return _error(err)
            except UploadError as exc:
                return _error(_api_error(exc.status, str(exc), exc.code, exc.offset))
            except InstallRefused as exc:
                return _error(_api_error(exc.status, str(exc), exc.code, exc.offset))

        return endpoint

    async def head_upload(request: Request) -> Response:
        state = uploads.state(request.path_params["upload_id"])
        if state is None:
            return Response(status_code=404)
        return Response(headers={"Upload-Offset": str(state.offset), "Upload-Length": str(state.size)})

    async def put_chunk(request: Request) -> Response:
        upload_id = checked_id(request.path_params["upload_id"])  # before it becomes a key of `locks`
        content_range = ContentRange.parse(request.headers.get("content-range"))
        lock = locks.setdefault(upload_id, asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), LOCK_WAIT)
        except TimeoutError:
            raise UploadError(409, "another chunk of this upload is still arriving", code="busy") from None
        try:
            state = uploads.begin(upload_id, content_range)
            received = await _append(request, uploads.open_for_append(upload_id), content_range.length)
        finally:
            lock.release()
        offset = state.offset + received
        if received != content_range.length:
            raise UploadError(
                400,
                f"the body had {received} bytes, Content-Range announced {content_range.length}",
                code="short_body",
                offset=offset,
            )
        return Response(status_code=204, headers={"Upload-Offset": str(offset), "Upload-Length": str(state.size)})

    async def install(request: Request) -> Response:
        report, old = await asyncio.to_thread(installer.install, request.path_params["upload_id"])
        drain = BackgroundTask(installer.slot.drain, old, drain_timeout)
        return JSONResponse(report.to_json(), background=drain)

    async def rollback(request: Request) -> Response:
        report, old = await asyncio.to_thread(installer.rollback)
        return JSONResponse(report.to_json(), background=BackgroundTask(installer.slot.drain, old, drain_timeout))

    async def status(request: Request) -> Response:
        slot = installer.slot
        return JSONResponse(
            {
                "agent": {"version": _version(), "pid": os.getpid(), "uptime_seconds": round(time.time() - started)},
                "health": slot.state,
                "problem": slot.problem,
                "current": installer.describe(CURRENT),
                "previous": installer.describe(PREVIOUS),
                "install": {"running": installer.phase is not None, "phase": installer.phase},
                "history": installer.history.recent(),
                "memory": _memory(budgets),
            }
        )

    async def list_adapters(request: Request) -> Response:
        return await _to_runtime(installer, api_key, "GET", "/v1/adapters")

    async def put_adapter(request: Request) -> Response:
        name = _adapter_name(request)
        digest = request.headers.get(DIGEST_HEADER, "")
        if not digest.startswith("sha256:"):
            raise APIError(400, "send the adapter file's digest as X-Onnxfn-Digest: sha256:HEX", code="invalid_adapter")
        # Spooled to disk as it arrives and handed on from there a chunk at a time: an adapter of hundreds of MB
        # never sits in memory (the runtime's route streams it into the adapter folder in turn).
        fd, spool = tempfile.mkstemp(dir=installer.root.adapters, prefix=".incoming-agent-", suffix=".part")
        try:
            actual = await _spool(request, fd, MAX_ADAPTER_BYTES)
            if actual != digest:
                raise APIError(
                    400,
                    f"the adapter's bytes hash to {actual}, not the {digest} sent with them; resend",
                    code="digest_mismatch",
                )
            headers = {"X-Onnxfn-Digest": digest, "Content-Type": "application/octet-stream"}
            return await _to_runtime(installer, api_key, "PUT", f"/v1/adapters/{name}", _chunks(Path(spool)), headers)
        finally:
            os.unlink(spool)

    async def delete_adapter(request: Request) -> Response:
        return await _to_runtime(installer, api_key, "DELETE", f"/v1/adapters/{_adapter_name(request)}")

    upload_path = "/agent/uploads/{upload_id}"
    adapter_path = "/agent/adapters/{name}"
    return [
        Route("/agent/adapters", guarded(list_adapters), methods=["GET"]),
        Route(adapter_path, guarded(put_adapter), methods=["PUT"]),
        Route(adapter_path, guarded(delete_adapter), methods=["DELETE"]),
        Route(upload_path, guarded(head_upload), methods=["HEAD"]),
        Route(upload_path, guarded(put_chunk), methods=["PUT"]),
        Route(upload_path + "/install", guarded(install), methods=["POST"]),
        Route("/agent/rollback", guarded(rollback), methods=["POST"]),
        Route("/agent/status", guarded(status), methods=["GET"]),
    ]


def _memory(budgets: tuple[int, int]) -> dict[str, int | str] | None:
    """What the agent's process may still allocate (its memory cgroup's limit, or the machine's available memory)
    and the budgets a new bundle would be served with; None where it cannot be read (packager/sizes.py:
    device_refusal reads it)."""
    free = free_memory()
    if free is None:
        return None
    return {**free.to_json(), "kv_pool_bytes": budgets[0], "prefix_cache_bytes": budgets[1]}


def _adapter_name(request: Request) -> str:
    name = str(request.path_params["name"])
    if not NAME.match(name):
        raise APIError(400, f"adapter name {name!r} is not valid: {NAME_RULE}", code="invalid_adapter")
    return name


async def _spool(request: Request, fd: int, limit: int) -> str:
    """Write the body to `fd` (closed after) as it arrives, a batch at a time off the loop; its sha256 digest."""
    digest, size, pending = hashlib.sha256(), 0, bytearray()
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"an adapter file is at most {limit} bytes here", code="too_large")
            digest.update(chunk)
            pending += chunk
            if len(pending) >= WRITE_BATCH:
                await asyncio.to_thread(_write_all, fd, bytes(pending))
                pending.clear()
        if pending:
            await asyncio.to_thread(_write_all, fd, bytes(pending))
    finally:
        os.close(fd)
    return "sha256:" + digest.hexdigest()


async def _chunks(path: Path) -> AsyncIterator[bytes]:
    with path.open("rb") as file:
        while chunk := await asyncio.to_thread(file.read, WRITE_BATCH):
            yield chunk


async def _to_runtime(
    installer: Installer,
    api_key: str | None,
    method: str,
    path: str,
    content: AsyncIterator[bytes] | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """The served bundle's answer to `method path`, asked in-process through its own HTTP app (same checks,
    same atomic write, same errors as a client of `python -m runtime serve` gets)."""
    import httpx  # only the adapter routes need it

    if installer.slot.current is None:
        message = installer.slot.problem or "no bundle is installed on this device yet: push one with `pkg push`"
        raise unavailable(f"no bundle is serving here, so it has no adapters to change or list: {message}")
    sent = dict(headers or {})
    if api_key:
        sent["Authorization"] = f"Bearer {api_key}"
    transport = httpx.ASGITransport(app=installer.slot)
    async with httpx.AsyncClient(transport=transport, base_url="http://agent", timeout=None) as client:
        answer = await client.request(method, path, content=content, headers=sent)
    kept = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "retry-after")}
    return Response(answer.content, status_code=answer.status_code, headers=kept)


def control_app(routes: list[Route], lifespan: Callable[[Starlette], object]) -> Starlette:
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})  # type: ignore[arg-type]


async def _append(request: Request, fd: int, limit: int) -> int:
    """Write the body to `fd` as it arrives; returns the bytes kept (a dropped client keeps what came)."""
    received = 0
    pending = bytearray()
    try:
        async for chunk in request.stream():
            if received + len(pending) + len(chunk) > limit:
                raise UploadError(400, f"the body is longer than Content-Range's {limit} bytes", code="long_body")
            pending += chunk
            if len(pending) >= WRITE_BATCH:
                received += await asyncio.to_thread(_write_all, fd, bytes(pending))
                pending.clear()
    except ClientDisconnect:
        pass  # the bytes that arrived are a valid prefix: keep them, the client resumes from Upload-Offset
    finally:
        if pending:
            received += await asyncio.to_thread(_write_all, fd, bytes(pending))
        os.close(fd)
    return received


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return len(data)


def _api_error(status: int, message: str, code: str, offset: int | None) -> APIError:
    headers = {"Upload-Offset": str(offset)} if offset is not None else None
    error_type = "server_error" if status >= 500 else "invalid_request_error"
    return APIError(status, message, error_type=error_type, code=code, headers=headers)


def _error(err: APIError) -> Response:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: " + (
        "no such agent route" if exc.status_code == 404 else str(exc.detail)
    )
    return _error(APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None))


def _version() -> str:
    try:
        return metadata.version("onnxfn")
    except metadata.PackageNotFoundError:
        return "unknown"
