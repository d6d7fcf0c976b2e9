"""The model one process serves, as every frontend sees it: its request policy, its engine once loaded, and
admission (503 while loading, 429 when `max_waiting` requests already wait).

The HTTP server's state adds auth and a body limit on top (`runtime.http.state`); the queue handler and
Lambda use a service as it is.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.api.errors import APIError, unavailable
from runtime.api.metrics import ServerMetrics
from runtime.api.protocol import RequestPolicy

if TYPE_CHECKING:
    from runtime.engine.engine import Engine

log = logging.getLogger("runtime.api")


@dataclass(frozen=True)
class ServiceSettings:
    policy: RequestPolicy
    # Names the bundle in every response (OpenAI's `system_fingerprint`), so a client can tell builds apart.
    fingerprint: str | None = None
    # Requests allowed to wait for a slot, beyond the engine's `max_batch` running; more get a 429. None
    # leaves it to the engine's queue (`max_queue`). A small value keeps the TTFT of admitted requests near
    # the unloaded TTFT under overload: a queued request waits for a running one to finish.
    max_waiting: int | None = None


class ModelService:
    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.policy = settings.policy
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
