"""LoRA adapters over HTTP: their model cards, and the admin routes that list, add and remove them while serving.

Clients pick an adapter as a model, `model: "FUNCTION:ADAPTER"` (vLLM names LoRA adapters as models the same
way), so `/v1/models` lists one card per adapter, its `parent` the function. The admin routes, behind the same
API key as every `/v1/*` route:

- `GET /v1/adapters`: every adapter the server may serve, with its digest, size, whether the bundle ships it
  and whether it is resident in a slot now.
- `PUT /v1/adapters/{name}`: the body is an onnxfn adapter file (`pkg adapter add` converts PEFT and GGUF
  LoRA into one), optionally with `X-Onnxfn-Digest: sha256:<hex>` to check the transfer; it is verified
  against the bundle's adapter layout and stored in the server's adapter directory (`--adapter-dir`), so it
  survives a restart. Adding a name again replaces that adapter; requests running with the old one finish
  with it.
- `DELETE /v1/adapters/{name}`: an added adapter is gone for new requests at once; the bundle's own stay.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from anyio import to_thread
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from runtime.adapters.files import AdapterFileError
from runtime.api.errors import APIError, unavailable
from runtime.http.state import ServerState, refuse_declared_length, too_large
from runtime.http.wire import WireFormat

if TYPE_CHECKING:
    from runtime.adapters.catalog import CatalogEntry, IncomingAdapter
    from runtime.engine.adapters import EngineAdapters
    from runtime.http.endpoints import Handler

MAX_ADAPTER_BYTES = 256 << 20
WRITE_BATCH = 1 << 20  # bytes gathered before one write to the file, so the loop is not stalled per network read
DIGEST_HEADER = "x-onnxfn-digest"


def adapter_id(state: ServerState, name: str) -> str:
    return f"{state.policy.model_name}:{name}"


def served_adapters(state: ServerState) -> EngineAdapters | None:
    """The engine's adapters; None while it loads, for an encoder, or for a graph that takes none."""
    return getattr(state.engine, "adapters", None)


def adapter_cards(state: ServerState) -> list[dict[str, Any]]:
    """One `/v1/models` card per adapter in the catalog (none while the engine loads)."""
    adapters = served_adapters(state)
    if adapters is None:
        return []
    return [_card(state, entry.name) for entry in adapters.catalog.entries()]


def adapter_card(state: ServerState, model_id: str) -> dict[str, Any] | None:
    """The card of `FUNCTION:NAME` when the catalog has NAME."""
    function, colon, name = model_id.partition(":")
    adapters = served_adapters(state)
    if not colon or function != state.policy.model_name or adapters is None or adapters.catalog.get(name) is None:
        return None
    return _card(state, name)


def _card(state: ServerState, name: str) -> dict[str, Any]:
    function = state.policy.model_name
    return {
        "id": f"{function}:{name}",
        "object": "model",
        "created": state.created,
        "owned_by": "onnxfn",
        "parent": function,
    }


def adapter_routes(api: Callable[[str, Handler], Callable[[Request], Awaitable[Response]]]) -> list[Route]:
    return [
        Route("/v1/adapters", api("adapters", list_adapters), methods=["GET"]),
        Route("/v1/adapters/{name:path}", api("adapter_put", put_adapter), methods=["PUT"]),
        Route("/v1/adapters/{name:path}", api("adapter_delete", delete_adapter), methods=["DELETE"]),
    ]


async def list_adapters(state: ServerState, request: Request, wire: WireFormat) -> Response:
    _require_loaded(state)
    adapters = served_adapters(state)
    if adapters is None:
        return wire.response({"object": "list", "data": []})
    resident = set(adapters.slots.resident())
    data = [
        {**_description(state, e), "bundled": e.bundled, "resident": e.digest in resident}
        for e in adapters.catalog.entries()
    ]
    return wire.response({"object": "list", "data": data})


async def put_adapter(state: ServerState, request: Request, wire: WireFormat) -> Response:
    adapters = _require_adapters(state)
    name = request.path_params["name"]
    _refuse_bundled(adapters, name, "replace")
    digest = request.headers.get(DIGEST_HEADER)
    refuse_declared_length(request, MAX_ADAPTER_BYTES)
    try:
        # Streamed into the adapter folder and verified a tensor at a time: a large adapter is never held in
        # memory whole (it took 2.8x its size in RSS when read into one buffer). Writes and checks run off the loop.
        with adapters.catalog.incoming() as incoming:
            await _receive(request, incoming, MAX_ADAPTER_BYTES)
            await to_thread.run_sync(_check_framing, incoming)
            add = adapters.catalog.add_file
            entry = await to_thread.run_sync(add, name, incoming, digest.strip() if digest else None)
    except AdapterFileError as exc:
        raise APIError(400, str(exc), param="body", code="invalid_adapter") from exc
    return wire.response(_description(state, entry), status=201)


async def _receive(request: Request, incoming: IncomingAdapter, limit: int) -> None:
    """Write the body into `incoming` as it arrives, a batch at a time; 413 past `limit` bytes."""
    pending = bytearray()
    async for chunk in request.stream():
        if incoming.size + len(pending) + len(chunk) > limit:
            raise too_large(incoming.size + len(pending) + len(chunk), limit)
        pending += chunk
        if len(pending) >= WRITE_BATCH:
            await to_thread.run_sync(incoming.write, bytes(pending))
            pending.clear()
    if pending:
        await to_thread.run_sync(incoming.write, bytes(pending))


async def delete_adapter(state: ServerState, request: Request, wire: WireFormat) -> Response:
    adapters = _require_adapters(state)
    name = request.path_params["name"]
    _refuse_bundled(adapters, name, "remove")
    engine = state.engine
    assert engine is not None  # `_require_adapters` saw it
    try:
        await to_thread.run_sync(engine.remove_adapter, name)
    except KeyError:
        raise _no_such_adapter(state, adapters, name) from None
    except AdapterFileError as exc:  # a bundled one (checked above; kept for the catalog's own word)
        raise APIError(409, str(exc), param="name", code="adapter_conflict") from exc
    return wire.response({"id": adapter_id(state, name), "name": name, "deleted": True})


def _check_framing(incoming: IncomingAdapter) -> None:
    """Refuse bytes that cannot be a safetensors file before anything reads the header length they claim."""
    incoming.file.flush()
    with incoming.path.open("rb") as file:
        head = file.read(8)
    header = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < header <= incoming.size - 8:
        raise APIError(
            400,
            f"the body ({incoming.size} bytes) is not an onnxfn adapter file (a safetensors file); convert a PEFT "
            "folder or GGUF LoRA with `pkg adapter add`",
            param="body",
            code="invalid_adapter",
        )


def _description(state: ServerState, entry: CatalogEntry) -> dict[str, Any]:
    return {"id": adapter_id(state, entry.name), "name": entry.name, "digest": entry.digest, "bytes": entry.size}


def _require_loaded(state: ServerState) -> None:
    if state.engine is None:
        if state.load_error is not None:
            raise unavailable(f"the model failed to load: {state.load_error}")
        raise unavailable("the model is still loading; retry shortly (GET /ready reports when it is up)")


def _require_adapters(state: ServerState) -> EngineAdapters:
    _require_loaded(state)
    adapters = served_adapters(state)
    if adapters is None:
        raise APIError(
            404,
            f"{state.policy.model_name!r} takes no adapters: its graph has no adapter inputs; declare [[adapters]] "
            "or [export] adapter_modules in function.toml and rebuild",
            param="name",
            code="adapters_not_supported",
        )
    return adapters


def _refuse_bundled(adapters: EngineAdapters, name: str, action: str) -> None:
    entry = adapters.catalog.get(name)
    if entry is not None and entry.bundled:
        raise APIError(
            409,
            f"{name!r} is one of the bundle's own adapters, which a running server cannot {action}: change "
            "[[adapters]] in function.toml and rebuild"
            + (", or add this one under another name" if action == "replace" else ""),
            param="name",
            code="adapter_conflict",
        )


def _no_such_adapter(state: ServerState, adapters: EngineAdapters, name: str) -> APIError:
    names = ", ".join(adapter_id(state, n) for n in adapters.catalog.names()) or "none"
    return APIError(
        404, f"this server has no adapter {name!r}; it has: {names}", param="name", code="adapter_not_found"
    )
