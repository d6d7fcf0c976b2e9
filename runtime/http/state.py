"""The HTTP app's state: the model service every frontend shares, plus what only HTTP has (auth, a body limit)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from starlette.requests import Request

from runtime.api.errors import APIError
from runtime.api.service import ModelService, ServiceSettings
from runtime.http.auth import BearerAuth

log = logging.getLogger("runtime.http")


@dataclass(frozen=True)
class ServerSettings(ServiceSettings):
    api_key: str | None = None
    max_body_bytes: int = 1 << 20


class ServerState(ModelService):
    settings: ServerSettings

    def __init__(self, settings: ServerSettings) -> None:
        super().__init__(settings)
        self.auth = BearerAuth(settings.api_key)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over `limit` bytes before reading more than that."""
    refuse_declared_length(request, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def refuse_declared_length(request: Request, limit: int) -> None:
    """413 when `Content-Length` already says the body is over `limit`, before a byte of it is read."""
    declared = request.headers.get("content-length", "")
    # ASCII digits only ("²".isdigit() is true) and few of them: int() refuses over 4,300 digits.
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise too_large(int(declared[:19]), limit)


def too_large(size: int, limit: int) -> APIError:
    return APIError(
        413, f"the request body is at least {size} bytes; the limit is {limit} bytes", code="request_too_large"
    )
