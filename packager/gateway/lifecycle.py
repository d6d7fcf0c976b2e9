"""Scale to zero: the gateway stops a function nobody asked for in `idle_timeout` seconds and starts it again
when a request comes (packager/targets/local/idle.py does both, under the function's lock, on a thread).

- **Idle**: no request relayed for `idle_timeout` seconds, none in flight, and none sent to the server's own
  port either: its `/metrics` (request counter, running and queued requests) is read every quarter of the
  timeout and once more right before it is stopped.
- **Wake**: the first request for an idle function starts the wake; up to `max_waking_requests` requests
  wait for it (the suspend before it, if one is under way), the next ones get 429 with `Retry-After`. A wake
  that fails answers every waiting request with a 503 saying why: none is dropped.
- **Supervision** (packager/targets/local/supervise.py): a request that reaches no server finds out why
  (`recover`): a redeploy moved it (the record says where), a deploy is starting it (the request waits), or
  its server ended: it is started again (from its snapshot where valid; the second and later restarts in a
  minute after a growing pause) while requests wait as for a wake; after too many ends in a minute the
  function is in `crashloop` and requests get a 503 saying why until a redeploy or the minute has passed.
  A stream that broke off starts the restart at once, so the next request finds it under way.
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
from packager.targets.base import READY_TIMEOUT
from packager.targets.local import crashes, idle, lock, server_process, starting, supervise
from runtime.api.errors import APIError

log = logging.getLogger("onnxfn.gateway")
TICK_SECONDS = 1.0
MIN_SCRAPE_SECONDS = 1.0
RECORD_POLL = 0.05  # while a deploy starts a function's new server, how often its record is read again
CLOSING_WAIT = 15.0  # the longest a server that no longer takes connections is expected to take to exit


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
                kind = function.transition_kind
                try:
                    await asyncio.shield(task)
                except Exception as exc:  # the wake or restart failed: every waiting request is told why
                    raise _start_failed(function, kind, exc) from exc
                finally:
                    function.waiting -= 1
                if kind in ("wake", "restart"):
                    waited = f"{function.deployment.start} in {function.last_wake_seconds:.3f} s"
                continue
            left = crashes.crashloop_left(function.deployment, time.time())
            if left > 0:
                # A redeploy starts over: its record may be newer than the last look (the registry reads the records
                # at most every REFRESH_SECONDS; a fresh clone's run refused the first request after a redeploy).
                looping = function.deployment
                await self.registry.refresh(force=True)
                if function.deployment is looping:
                    raise _crashloop(function, left)
                continue
            if not function.idle:
                return waited
            self._begin(function, "wake", self._wake)

    async def recover(self, function: Function, problem: str) -> None:
        """Nothing reached `function`'s server (`problem`): return once another attempt may succeed, or raise
        the 503 that says why none will."""
        before = function.serving()
        await self.registry.refresh(force=True)
        if function not in self.registry.all():
            raise _unavailable(function, f"it was destroyed meanwhile ({problem})")
        if function.transition is not None or function.idle or function.serving() != before:
            return  # under way, idle (a request wakes it), or moved by a redeploy
        if before is None:  # a deploy is starting its new server and the old one is gone: wait for the new one
            await self._until_ready(function, problem)
            return
        if server_process.alive(before[1]):
            await self._while_closing(function, before)
            return
        self.crashed(function)

    def crashed(self, function: Function) -> None:
        """Its server ended on its own: start it again now (with backoff), unless that is under way."""
        if function.transition is None:
            self._begin(function, "restart", self._restart)

    async def _while_closing(self, function: Function, serving: tuple[str, int]) -> None:
        """Its server runs but takes no connection: it is shutting down (a redeploy drains it, a destroy stops
        it). Until it is gone or the record names another server; then the caller looks again."""
        deadline = time.monotonic() + CLOSING_WAIT
        while server_process.alive(serving[1]) and time.monotonic() < deadline:
            await asyncio.sleep(RECORD_POLL)
            await self.registry.refresh(force=True)
            if function.serving() != serving:
                return

    async def _until_ready(self, function: Function, problem: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while function.serving() is None and function in self.registry.all():
            if time.monotonic() > deadline or not lock.busy(function.directory):
                if function.serving() is None and not function.deployment.ready:
                    # no deploy holds it: the one that started this server ended; supervision takes it over
                    self.crashed(function)
                return
            await asyncio.sleep(RECORD_POLL)
            await self.registry.refresh(force=True)

    def _begin(self, function: Function, kind: str, run: Callable[[Function], Awaitable[None]]) -> None:
        async def transition() -> None:
            try:
                await run(function)
            finally:
                function.transition = None

        function.transition_kind = kind
        function.transition = asyncio.get_running_loop().create_task(transition())
        # A restart nobody waits for (a stream broke off) fails in the log, not as an unretrieved exception.
        function.transition.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _wake(self, function: Function) -> None:
        started = time.monotonic()
        await function.close()
        await self.registry.refresh(force=True)  # a corrupt record is written back before the wake reads it
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

    async def _restart(self, function: Function) -> None:
        await function.close()
        await self.registry.refresh(force=True)  # as for a wake
        started = time.monotonic()
        try:
            noted = await asyncio.to_thread(supervise.record_crash, function.directory)
            if noted is None:
                raise idle.NotIdle(f"{function.name} is no longer deployed")
            await self.registry.update(function.directory, noted)
            pause = crashes.backoff(noted, time.time())
            ended = not server_process.serves_bundle(noted.pid, noted.bundle)
            if ended and pause > 0 and crashes.crashloop_left(noted, time.time()) <= 0:
                log.info("%s ended again (%s): starting it in %.1f s", function.name, noted.crash_reason, pause)
                await asyncio.sleep(pause)
            started = time.monotonic()
            deployment = await asyncio.to_thread(supervise.restart, function.directory)
        except Exception as exc:
            log.error("could not start %s again: %s", function.name, str(exc).splitlines()[0] if str(exc) else exc)
            await self.registry.refresh(force=True)  # the record says how it ended
            raise
        function.last_wake_seconds = time.monotonic() - started
        await self.registry.update(function.directory, deployment)
        function.last_activity = time.time()
        log.info("%s ended (%s); started again: %s in %.3f s", function.name, noted.crash_reason or "gone",
                 deployment.start, function.last_wake_seconds)  # fmt: skip

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
            starting.reap()
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
        if not function.deployment.ready:
            return  # a deploy is starting its new server
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


def _start_failed(function: Function, kind: str, exc: Exception) -> APIError:
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, supervise.CrashLoop):
        return _crashloop(function, crashes.crashloop_left(function.deployment, time.time()))
    if kind == "restart":
        return APIError(
            503,
            f"the server of {function.name} ended and could not be started again: {first}; `pkg status "
            f"{function.deployment.function_dir}` and its log ({function.deployment.log_file}) say more",
            error_type="server_error",
            code="restart_failed",
        )
    what = "was idle and could not be started again" if kind == "wake" else "could not be stopped as idle"
    return APIError(
        503,
        f"{function.name} {what}: {first}; the gateway's log and `pkg ps` say more",
        error_type="server_error",
        code="wake_failed",
    )


def _crashloop(function: Function, left: float) -> APIError:
    retry_after = max(1, math.ceil(left))
    return APIError(
        503,
        f"{function.name} is in a crash loop: {crashes.describe(function.deployment, time.time())}",
        error_type="server_error",
        code="crashloop",
        headers={"Retry-After": str(retry_after)},
    )


def _unavailable(function: Function, why: str) -> APIError:
    return APIError(
        503,
        f"the server of {function.name} does not answer: {why}; `pkg status {function.deployment.function_dir}` "
        "says why, and `pkg deploy` starts it again",
        error_type="server_error",
        code="function_unavailable",
    )
