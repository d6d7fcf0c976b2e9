"""Scale to zero: the gateway stops a function nobody asked for in `idle_timeout` seconds and starts it again
when a request comes (packager/targets/local/idle.py does both, under the function's lock, on a thread).

- **Idle**: no request relayed for `idle_timeout` seconds, none in flight, and none sent to the server's own
  port either: its `/metrics` (request counter, running and queued requests) is read every quarter of the
  timeout and once more right before it is stopped.
- **Wake**: the first request for an idle function starts the wake; up to `max_waking_requests` requests
  wait for it (the suspend before it, if one is under way), the next ones get 429 with `Retry-After`. A wake
  that fails answers every waiting request with a 503 saying why: none is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

import httpx

from packager.gateway import metrics
from packager.gateway.functions import Function, Registry
from packager.targets.local import idle
from runtime.api.errors import APIError

log = logging.getLogger("onnxfn.gateway")
TICK_SECONDS = 1.0
MIN_SCRAPE_SECONDS = 1.0


class Lifecycle:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def ready(self, function: Function) -> str:
        """Return once `function` runs, waking it if idle: "" when it ran already, else how it woke."""
        waited = ""
        while True:
            task = function.transition
            if task is not None:
                limit = max(1, function.deployment.max_waking_requests)
                if function.waiting >= limit:
                    raise _too_many_waiting(function, limit)
                function.waiting += 1
                try:
                    await asyncio.shield(task)
                except Exception as exc:  # the wake failed: every waiting request is told why
                    raise APIError(
                        503,
                        f"{function.name} was idle and could not be started again: {str(exc).splitlines()[0]}; "
                        f"the gateway's log and `pkg ps` say more",
                        error_type="server_error",
                        code="wake_failed",
                    ) from exc
                finally:
                    function.waiting -= 1
                if function.transition_kind == "wake":
                    waited = f"{function.deployment.start} in {function.last_wake_seconds:.3f} s"
                continue
            if not function.idle:
                return waited
            self._begin(function, "wake", self._wake)

    def _begin(self, function: Function, kind: str, run: Callable[[Function], Awaitable[None]]) -> None:
        async def transition() -> None:
            try:
                await run(function)
            finally:
                function.transition = None

        function.transition_kind = kind
        function.transition = asyncio.get_running_loop().create_task(transition())

    async def _wake(self, function: Function) -> None:
        started = time.monotonic()
        await function.close()
        try:
            deployment = await asyncio.to_thread(idle.resume, function.directory)
        except Exception:
            log.exception("could not wake %s", function.name)
            await self.registry.refresh(force=True)  # the record says how it ended
            raise
        function.last_wake_seconds = time.monotonic() - started
        await self.registry.update(function.directory, deployment)
        function.last_activity = time.time()
        note = f" ({deployment.start_note})" if deployment.start_note else ""
        log.info("woke %s: %s in %.3f s%s", function.name, deployment.start, function.last_wake_seconds, note)

    async def _suspend(self, function: Function) -> None:
        await function.close()
        deployment = await asyncio.to_thread(idle.suspend, function.directory)
        if deployment is None:
            return  # a pkg is changing it, or it is gone: the next look decides again
        await self.registry.update(function.directory, deployment)
        how = "its process snapshot" if deployment.wake == idle.SNAPSHOT else f"a fresh start ({deployment.wake_note})"
        log.info("%s idle for %.0f s: stopped; the next request wakes it from %s", function.name,
                 deployment.idle_timeout, how)  # fmt: skip

    async def monitor(self) -> None:
        """Every second: stop the functions that have been idle long enough. Runs as long as the gateway."""
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                await self.registry.refresh()
                for function in self.registry.all():
                    await self._check(function)
            except Exception:  # one bad record or server must not stop scale-to-zero for the others
                log.exception("idle check failed")

    async def _check(self, function: Function) -> None:
        timeout = function.deployment.idle_timeout
        if timeout <= 0 or function.idle or function.transition is not None or function.key_problem:
            return
        now = time.time()
        if now >= function.next_scrape:
            function.next_scrape = now + max(MIN_SCRAPE_SECONDS, timeout / 4)
            await self._observe(function, now)
        if function.in_flight or now - function.last_activity < timeout:
            return
        answered = await self._observe(function, now)
        quiet = function.in_flight == 0 and time.time() - function.last_activity >= timeout
        if answered and quiet and function.transition is None and not function.idle:
            self._begin(function, "suspend", self._suspend)

    async def _observe(self, function: Function, now: float) -> bool:
        """Read its /metrics: requests sent straight to its port count as activity. False when it does not
        answer (it is starting, or it ended: not the gateway's to stop)."""
        try:
            response = await function.client().get("/metrics", headers=function.headers, timeout=2.0)
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        figures = metrics.parse(response.text)
        if figures.busy or (function.requests_seen is not None and figures.requests != function.requests_seen):
            function.last_activity = now
        function.requests_seen = figures.requests
        return True


def _too_many_waiting(function: Function, limit: int) -> APIError:
    retry_after = max(1, math.ceil(function.last_wake_seconds))
    return APIError(
        429,
        f"{function.name} is starting again after being idle and {limit} requests already wait for it "
        f"([targets.local] max_waking_requests); retry in {retry_after} s",
        error_type="rate_limit_error",
        code="waking",
        headers={"Retry-After": str(retry_after)},
    )
