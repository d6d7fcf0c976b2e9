"""The OpenAPI piece of the LoRA adapter admin routes (runtime/http/adapters.py): list, add, remove."""

from __future__ import annotations

from typing import Any

from runtime.adapters.layout import NAME, NAME_RULE
from runtime.http.adapters import DIGEST_HEADER, MAX_ADAPTER_BYTES
from runtime.http.openapi import RoutePiece, Schema, error_responses, ok, ref


def adapters_piece() -> RoutePiece:
    described: dict[str, Schema] = {
        "id": {"type": "string", "description": "`FUNCTION:NAME`: what requests send as `model`"},
        "name": {"type": "string"},
        "digest": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
        "bytes": {"type": "integer", "minimum": 0},
    }
    adapter = {
        "type": "object",
        "required": [*described, "bundled", "resident"],
        "properties": {
            **described,
            "bundled": {"type": "boolean", "description": "shipped in the bundle: only a rebuild changes it"},
            "resident": {"type": "boolean", "description": "loaded in one of the graph's adapter slots now"},
        },
    }
    listing = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": ref("Adapter")}},
    }
    added = {"type": "object", "required": list(described), "properties": described}
    deleted = {
        "type": "object",
        "required": ["id", "name", "deleted"],
        "properties": {"id": {"type": "string"}, "name": {"type": "string"}, "deleted": {"const": True}},
    }
    name = {
        "name": "name",
        "in": "path",
        "required": True,
        "description": NAME_RULE,
        "schema": {"type": "string", "pattern": NAME.pattern},
    }
    digest = {
        "name": DIGEST_HEADER,
        "in": "header",
        "required": False,
        "description": "the sha256 of the body; a mismatch stores nothing (400)",
        "schema": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
    }
    missing = "No such adapter, or the bundle's graph takes no adapters"
    put_operation: dict[str, Any] = {
        "summary": "Add (or replace) an adapter: the body is an onnxfn adapter file (`pkg adapter add` converts one)",
        "parameters": [name, digest],
        "requestBody": {
            "required": True,
            "description": f"at most {MAX_ADAPTER_BYTES} bytes",
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        },
        "responses": {
            "201": ok(ref("AdapterAdded"), "Verified and stored; requests may name it at once"),
            **_described(error_responses("400", "401", "404", "409", "413", "503"), "404", missing),
        },
    }
    return RoutePiece(
        {
            "/v1/adapters": {
                "get": {
                    "summary": "List the LoRA adapters this server may serve",
                    "responses": {"200": ok(ref("AdapterList")), **error_responses("401", "503")},
                }
            },
            "/v1/adapters/{name}": {
                "put": put_operation,
                "delete": {
                    "summary": "Remove an added adapter; requests running with it finish with it",
                    "parameters": [name],
                    "responses": {
                        "200": ok(ref("AdapterDeleted")),
                        **_described(error_responses("401", "404", "409", "503"), "404", missing),
                    },
                },
            },
        },
        {"Adapter": adapter, "AdapterList": listing, "AdapterAdded": added, "AdapterDeleted": deleted},
    )


def _described(responses: dict[str, Any], status: str, description: str) -> dict[str, Any]:
    return {**responses, status: {**responses[status], "description": description}}
