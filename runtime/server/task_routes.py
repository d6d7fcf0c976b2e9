"""The POST routes a bundle serves for its task, and the other tasks' routes answering 400 with the right one.

Every API handler has one shape, `Handler`: the server's state, the request and its wire format in, a response
out; the HTTP app wraps each (auth, errors, metrics) before mounting it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from runtime.bundle import CLASSIFICATION_TASK, EMBEDDING_TASK
from runtime.server.chat import create_chat_completion
from runtime.server.classify import create_classification
from runtime.server.completions import create_completion
from runtime.server.embeddings import create_embeddings
from runtime.server.encoding import WireFormat
from runtime.server.errors import APIError
from runtime.server.state import ServerState

Handler = Callable[[ServerState, Request, WireFormat], Awaitable[Response]]


def task_routes(task: str, api: Callable[[str, Handler], Callable[[Request], Awaitable[Response]]]) -> list[Route]:
    """The POST routes for a bundle of `task`; the other tasks' routes answer 400 naming the right endpoint."""
    generation: dict[str, tuple[str, Handler]] = {
        "chat": ("/v1/chat/completions", create_chat_completion),
        "completions": ("/v1/completions", create_completion),
    }
    by_task: dict[str, tuple[str, dict[str, tuple[str, Handler]]]] = {
        EMBEDDING_TASK: (
            "an embedding model: use POST /v1/embeddings",
            {"embeddings": ("/v1/embeddings", create_embeddings)},
        ),
        CLASSIFICATION_TASK: (
            "a classification model: use POST /v1/classify",
            {"classify": ("/v1/classify", create_classification)},
        ),
    }
    what, served = by_task.get(
        task, ("a generation model: use POST /v1/chat/completions or /v1/completions", generation)
    )
    refused = {
        label: route for routes in (generation, *(r for _, r in by_task.values())) for label, route in routes.items()
    }
    refuse = _wrong_task(what)
    return [Route(path, api(label, handler), methods=["POST"]) for label, (path, handler) in served.items()] + [
        Route(path, api(label, refuse), methods=["POST"]) for label, (path, _) in refused.items() if label not in served
    ]


def _wrong_task(what: str) -> Handler:
    async def refuse(state: ServerState, request: Request, wire: WireFormat) -> Response:
        raise APIError(
            400,
            f"{state.policy.model_name} is {what}; {request.url.path} is not served",
            param="model",
            code="unsupported_endpoint",
        )

    return refuse
