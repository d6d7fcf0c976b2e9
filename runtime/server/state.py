"""What the handlers share: settings, the engine once loaded, auth and metrics."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request

from runtime.server.auth import BearerAuth
from runtime.server.errors import APIError, unavailable
from runtime.server.metrics import ServerMetrics
from runtime.server.protocol import RequestPolicy

if TYPE_CHECKING:
    from runtime.engine.engine import Engine

log = logging.getLogger("runtime.server")


@dataclass(frozen=True)
class ServerSettings:
    policy: RequestPolicy
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    # Names the bundle in every response (OpenAI's `system_fingerprint`), so a client can tell builds apart.
    fingerprint: str | None = None
    # Requests allowed to wait for a slot, beyond the engine's `max_batch` running; more get a 429. None
    # leaves it to the engine's queue (`max_queue`). A small value keeps the TTFT of admitted requests near
    # the unloaded TTFT under overload: a queued request waits for a running one to finish.
    max_waiting: int | None = None


class ServerState:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.policy = settings.policy
        self.auth = BearerAuth(settings.api_key)
        self.metrics = ServerMetrics(lambda: self.engine.stats() if self.engine is not None else None)
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self.created = int(time.time())

    def load(self, load_engine: Callable[[], Engine]) -> bool:
        """Load the engine (called on a background thread so `/health` answers meanwhile)."""
        started = time.perf_counter()
        try:
            self.engine = load_engine()
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("the engine failed to load")
            return False
        log.info("engine ready in %.2f s", time.perf_counter() - started)
        return True

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    def require_engine(self) -> Engine:
        """The engine, ready to take one more request: 503 while loading, 429 when `max_waiting` are waiting.

        Handlers call this and submit without awaiting in between, so on the event loop the check is exact.
        """
        if self.engine is not None:
            if self.settings.max_waiting is not None:
                self._admit(self.engine)
            return self.engine
        if self.load_error is not None:
            raise unavailable(f"the model failed to load: {self.load_error}")
        raise unavailable("the model is still loading; retry shortly (GET /ready reports when it is up)")

    def _admit(self, engine: Engine) -> None:
        stats, slots = engine.stats(), engine.config.max_batch
        if stats.queued + stats.running >= slots + (self.settings.max_waiting or 0):
            # Each wave of `slots` requests ahead takes about one request's duration to drain.
            retry_after = 1 + math.ceil(stats.queued / slots)
            raise APIError(
                429,
                f"the server is at capacity ({stats.running} running, {stats.queued} waiting); retry later",
                error_type="rate_limit_error",
                code="engine_overloaded",
                headers={"Retry-After": str(retry_after)},
            )


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over `limit` bytes before reading more than that."""
    declared = request.headers.get("content-length", "")
    # ASCII digits only ("²".isdigit() is true) and few of them: int() refuses over 4,300 digits.
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise _too_large(int(declared[:19]), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413, f"the request body is at least {size} bytes; the limit is {limit} bytes", code="request_too_large"
    )
