"""The OpenAPI 3.1 document served at `GET /openapi.json`, assembled from one `RoutePiece` per route.

Each piece holds its paths and the component schemas they reference; `document` merges the pieces the
app serves. A new route's owner writes a function returning its piece (bounds taken from the
`RequestPolicy`, so the document states this server's real limits) and the app adds it to the list.

Shapes follow OpenAI's API. Bodies are `application/json` or `application/msgpack`; responses are the
same object in the format `Accept` names, or a stream (SSE for JSON, back-to-back maps for msgpack) when
the body sets `stream`. Every error is the `Error` schema.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from runtime.api.encoding import EVENT_STREAM_TYPE, JSON_TYPE, MSGPACK_TYPE
from runtime.api.protocol import RequestPolicy

Schema = dict[str, Any]
OPENAPI_VERSION = "3.1.0"


@dataclass(frozen=True)
class RoutePiece:
    """One route's share of the document: `paths` entries and the `components.schemas` they use."""

    paths: dict[str, dict[str, Any]]
    schemas: dict[str, Schema] = field(default_factory=dict)


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


_ERRORS = {
    "400": "The body or a parameter is invalid; `error.param` names it",
    "401": "Missing or wrong bearer API key",
    "403": "`Host` or `Origin` names another site: a request a web page made (see `host_not_allowed`)",
    "404": "Unknown model",
    "409": "The adapter is one of the bundle's own: a rebuild changes it",
    "413": "The body is larger than the server's limit",
    "415": "A body type browsers send across sites unasked (`text/plain`, forms): send JSON or msgpack",
    "429": "The request queue is full; retry after `Retry-After` seconds",
    "503": "The model is still loading or failed to load",
}
# What a request with a body may get: 403 and 415 from the servers bound to the user's machine (host_guard.py).
REQUEST_ERRORS = ("400", "401", "403", "404", "413", "415", "429", "503")
_ERROR_SCHEMAS: dict[str, Schema] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }
}


def error_responses(*statuses: str) -> dict[str, Any]:
    """The error responses of `statuses`, in both wire formats; 429 carries `Retry-After`."""
    out: dict[str, Any] = {}
    for status in statuses:
        response: dict[str, Any] = {"description": _ERRORS[status], "content": both(ref("Error"))}
        if status == "429":
            response["headers"] = {
                "Retry-After": {"required": True, "schema": {"type": "string", "pattern": "^[0-9]+$"}}
            }
        if status == "401":
            response["headers"] = {"WWW-Authenticate": {"required": True, "schema": {"const": "Bearer"}}}
        out[status] = response
    return out


def both(schema: Schema) -> dict[str, Any]:
    return {JSON_TYPE: {"schema": schema}, MSGPACK_TYPE: {"schema": schema}}


_SSE_EVENT: Schema = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
}


def generation_operation(summary: str, body: str, result: str, chunk: str) -> dict[str, Any]:
    """A POST that generates: `body` in either format; `result`, or a stream of `chunk`s, out."""
    stream_of_maps = {"type": "array", "items": ref(chunk), "minItems": 2}
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": both(ref(body))},
        "responses": {
            "200": {
                "description": f"A `{result}` object, or with `stream` a stream of `{chunk}` objects",
                "content": {
                    JSON_TYPE: {"schema": ref(result)},
                    # SSE frames `data: {chunk}` … `data: [DONE]`; msgpack writes the chunk maps back to back.
                    # Described per event, as SSE tooling (schemathesis among it) reads it: `data` is a chunk
                    # as JSON text, or `[DONE]`.
                    EVENT_STREAM_TYPE: {"schema": _SSE_EVENT},
                    MSGPACK_TYPE: {"schema": {"anyOf": [ref(result), stream_of_maps]}},
                },
            },
            **error_responses(*REQUEST_ERRORS),
        },
    }


# Models and probes.
def models_piece(policy: RequestPolicy) -> RoutePiece:
    card = {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "parent": {"type": "string", "description": "an adapter's (`FUNCTION:NAME`): the function it adapts"},
        },
    }
    listing = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}},
    }
    model_id = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    return RoutePiece(
        {
            "/v1/models": {
                "get": {
                    "summary": "List the model this server serves and its LoRA adapters (`FUNCTION:NAME`)",
                    "responses": {"200": ok(ref("ModelList")), **error_responses("401")},
                }
            },
            "/v1/models/{model_id}": {
                "get": {
                    "summary": "Describe one model",
                    "parameters": [model_id],
                    "responses": {"200": ok(ref("Model")), **error_responses("401", "404")},
                }
            },
        },
        {"Model": card, "ModelList": listing},
    )


def ok(schema: Schema, description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": both(schema)}


def probes_piece(policy: RequestPolicy) -> RoutePiece:
    status = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    json_only = {JSON_TYPE: {"schema": status}}
    open_access: list[dict[str, list[str]]] = [{}]  # no key needed, with or without auth configured
    return RoutePiece(
        {
            "/health": {
                "get": {
                    "summary": "Liveness: the process answers",
                    "security": open_access,
                    "responses": {"200": {"description": "alive", "content": json_only}},
                }
            },
            "/ready": {
                "get": {
                    "summary": "Readiness: 200 once requests can be served (with the key: `model`, `prompt_graph`)",
                    "security": open_access,
                    "responses": {
                        "200": {"description": "serving", "content": json_only},
                        "503": {"description": "loading, or the model failed to load", "content": json_only},
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": {
                        "200": {"description": "OpenAPI 3.1", "content": {JSON_TYPE: {"schema": {"type": "object"}}}},
                        **error_responses("401"),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {"description": "text exposition format", "content": {"text/plain": {"schema": {}}}},
                        **error_responses("401"),
                    },
                }
            },
        }
    )


def _encoder_request(policy: RequestPolicy, **extra: Schema) -> Schema:
    """The request fields /v1/embeddings and /v1/classify share (runtime/api/embeddings.py reads both)."""
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": policy.vocab_size - 1}}
    text = {"type": "string", "minLength": 1}
    return {
        "type": "object",
        "required": ["model", "input"],
        "additionalProperties": False,
        "properties": {
            "model": {"type": "string", "enum": [policy.model_name]},
            "input": {
                "anyOf": [
                    text,
                    {"type": "array", "items": text, "minItems": 1, "maxItems": 2048},
                    {**token_ids, "minItems": 1},
                    {"type": "array", "items": {**token_ids, "minItems": 1}, "minItems": 1, "maxItems": 2048},
                ]
            },
            **extra,
            "user": nullable({"type": "string"}),
            "truncate_prompt_tokens": nullable({"type": "integer", "minimum": -1}),
        },
    }


_USAGE = {"type": "object", "required": ["prompt_tokens", "total_tokens"]}


def embeddings_piece(policy: RequestPolicy) -> RoutePiece:
    """`/v1/embeddings` (runtime/api/embeddings.py)."""
    request = _encoder_request(
        policy,
        encoding_format=nullable({"enum": ["float", "base64"]}),
        dimensions=nullable({"type": "integer", "minimum": 1}),
    )
    embedding = {
        "type": "object",
        "required": ["object", "index", "embedding"],
        "properties": {
            "object": {"const": "embedding"},
            "index": {"type": "integer"},
            "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]},
        },
    }
    response = {
        "type": "object",
        "required": ["object", "data", "model", "usage"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": embedding},
            "model": {"type": "string"},
            "usage": _USAGE,
        },
    }
    operation = {
        "summary": "Create embeddings",
        "requestBody": {"required": True, "content": both(ref("EmbeddingRequest"))},
        "responses": {"200": ok(ref("EmbeddingList")), **error_responses(*REQUEST_ERRORS)},
    }
    return RoutePiece({"/v1/embeddings": {"post": operation}}, {"EmbeddingRequest": request, "EmbeddingList": response})


def classify_piece(policy: RequestPolicy) -> RoutePiece:
    """`/v1/classify` (runtime/api/classify.py)."""
    probability = {"type": "number", "minimum": 0, "maximum": 1}
    result = {
        "type": "object",
        "required": ["index", "label", "score", "probs"],
        "properties": {
            "index": {"type": "integer"},
            "label": {"type": "string"},
            "score": {**probability, "description": "the probability of `label`, the most probable one"},
            "probs": {"type": "array", "items": probability, "description": "every label's, in `labels` order"},
        },
    }
    response = {
        "type": "object",
        "required": ["object", "model", "labels", "data", "usage"],
        "properties": {
            "object": {"const": "list"},
            "model": {"type": "string"},
            "labels": {"type": "array", "items": {"type": "string"}},
            "data": {"type": "array", "items": result},
            "usage": _USAGE,
        },
    }
    operation = {
        "summary": "Classify texts",
        "requestBody": {"required": True, "content": both(ref("ClassificationRequest"))},
        "responses": {
            "200": ok(ref("ClassificationList")),
            **error_responses(*REQUEST_ERRORS),
        },
    }
    schemas = {"ClassificationRequest": _encoder_request(policy), "ClassificationList": response}
    return RoutePiece({"/v1/classify": {"post": operation}}, schemas)


def document(policy: RequestPolicy, pieces: Iterable[RoutePiece], *, auth: bool) -> dict[str, Any]:
    """The whole OpenAPI document; with `auth`, every operation not marked otherwise needs the bearer key."""
    paths: dict[str, dict[str, Any]] = {}
    schemas: dict[str, Schema] = dict(_ERROR_SCHEMAS)
    for piece in pieces:
        for path, operations in piece.paths.items():
            paths.setdefault(path, {}).update(operations)
        schemas.update(piece.schemas)
    components: dict[str, Any] = {"schemas": dict(sorted(schemas.items()))}
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": f"onnxfn: {policy.model_name}", "version": "1", "description": __doc__.split("\n\n")[0]},
        "paths": dict(sorted(paths.items())),
        "components": components,
    }
    if auth:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
