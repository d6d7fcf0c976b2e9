"""The functions the gateway routes to: every deployment recorded in `$XDG_STATE_HOME/onnxfn/functions/`.

A record is read again when its `state.json` changes (a deploy, a destroy, a wake), at most every
`REFRESH_SECONDS` on the request path and at once when a request names a model the gateway does not know.
What the gateway tracks per function (requests in flight, last activity, a wake or suspend under way, its
connection pool) lives on the `Function` object and survives those re-reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from packager.errors import UserError
from packager.gateway.upstream import Pool
from packager.targets.local import lock, server_process, store
from packager.targets.local.records import LocalDeployment
from runtime.api.errors import APIError
from runtime.http.auth import BearerAuth

log = logging.getLogger("onnxfn.gateway")
REFRESH_SECONDS = 0.5
# No read timeout: a stream is as long as the generation; connecting to a local server is quick or it is down.
UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)


@dataclass(eq=False)
class Function:
    directory: Path
    deployment: LocalDeployment
    stamp: int  # its state.json's mtime when read
    key: str | None  # None: no auth
    key_problem: str = ""  # why the gateway cannot read its key; requests for it are refused until a redeploy
    in_flight: int = 0  # requests the gateway is relaying to it now
    last_activity: float = field(default_factory=time.time)  # the end of the last request, or when first seen
    waiting: int = 0  # requests waiting for a wake (or the suspend before it) to finish
    transition: asyncio.Task[None] | None = None  # the wake or suspend under way
    transition_kind: str = ""  # "wake" or "suspend"
    last_wake_seconds: float = 1.0  # for Retry-After
    requests_seen: float | None = None  # its /metrics request counter at the last look (direct traffic)
    next_scrape: float = 0.0
    _client: httpx.AsyncClient | None = None
    _pool: Pool | None = None

    @property
    def name(self) -> str:
        return self.deployment.function

    @property
    def idle(self) -> bool:
        return self.deployment.idle_since is not None

    @property
    def headers(self) -> dict[str, str]:
        """What the gateway itself sends its server (to read /metrics)."""
        return {"authorization": f"Bearer {self.key}"} if self.key else {}

    def opens(self, authorization: str | None) -> bool:
        return not self.key_problem and BearerAuth(self.key).allows(authorization)

    def serving(self) -> tuple[str, int] | None:
        """(URL, pid) of the server requests go to now: its own once ready; while a deploy starts a new one, the
        one it replaces, as long as that runs (a rolling redeploy); None when neither serves yet."""
        deployment = self.deployment
        if deployment.ready:
            return deployment.url, deployment.pid
        if deployment.previous_url and server_process.alive(deployment.previous_pid):
            return deployment.previous_url, deployment.previous_pid
        return None

    def pool(self, serving: tuple[str, int]) -> Pool:
        """The relay's connections to the server at `serving` (upstream.py). Like `client`, closed before the
        server is stopped, so no connection of the gateway's is in its process snapshot."""
        url = serving[0]
        if self._pool is not None and self._pool.url != url:
            self._pool.close()  # a rolling redeploy switched servers: connections out now finish on the old one
            self._pool = None
        if self._pool is None:
            parsed = httpx.URL(url)
            self._pool = Pool(url, parsed.host, parsed.port or 80)
        return self._pool

    def client(self) -> httpx.AsyncClient:
        """httpx to its server, for the gateway's own requests (its /metrics)."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.deployment.url,
                timeout=UPSTREAM_TIMEOUT,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
        return self._client

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def finished(self) -> None:
        self.in_flight -= 1
        self.last_activity = time.time()


def _key(directory: Path, deployment: LocalDeployment) -> tuple[str | None, str]:
    try:
        return deployment.api_key.read(environ=store.server_env(directory)), ""
    except UserError as exc:
        return None, str(exc)


class Registry:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._functions: dict[Path, Function] = {}
        self._refreshed = 0.0

    def all(self) -> list[Function]:
        return sorted(self._functions.values(), key=lambda f: (f.name, str(f.directory)))

    def named(self, model: str) -> list[Function]:
        return [function for function in self.all() if function.name == model]

    def opened(self, authorization: str | None) -> list[Function]:
        """The functions `authorization` opens; a 401 when it opens none of those deployed."""
        found = [function for function in self.all() if function.opens(authorization)]
        if not found and self._functions:
            given = "incorrect API key provided" if authorization else "missing bearer token"
            raise APIError(
                401,
                f"{given}: it opens none of the functions deployed here; send 'Authorization: Bearer <API key>' "
                "with a function's key (pkg status functions/NAME --api-key prints it)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return found

    async def refresh(self, *, force: bool = False) -> None:
        """Read the records that changed since the last look; forget the destroyed ones."""
        now = time.monotonic()
        if not force and now - self._refreshed < REFRESH_SECONDS:
            return
        self._refreshed = now
        seen: set[Path] = set()
        for state_file in (self.root / "functions").glob(f"*/{store.STATE_FILE}"):
            directory = state_file.parent
            known = self._functions.get(directory)
            try:
                stamp = state_file.stat().st_mtime_ns
                if known is not None and known.stamp == stamp:
                    seen.add(directory)
                    continue
                deployment = store.load(directory)
            except FileNotFoundError:
                continue  # removed meanwhile
            except UserError as exc:
                if known is not None:  # its server still runs: keep routing to it, and put its record back
                    seen.add(directory)
                    _repair(directory, known, str(exc))
                continue  # a record never read: `pkg ps` reports it
            if deployment is None:
                continue
            seen.add(directory)
            await self.update(directory, deployment, stamp)
        for directory in set(self._functions) - seen:
            await self._functions.pop(directory).close()

    async def update(self, directory: Path, deployment: LocalDeployment, stamp: int | None = None) -> Function:
        """Take a record the gateway read or wrote (a wake, a suspend); the function's tracking is kept."""
        if stamp is None:
            stamp = (directory / store.STATE_FILE).stat().st_mtime_ns
        key, problem = _key(directory, deployment)
        function = self._functions.get(directory)
        if function is None:
            function = self._functions[directory] = Function(directory, deployment, stamp, key, problem)
            return function
        if function.deployment.url != deployment.url:
            await function.close()  # its server moved (a redeploy, a wake on another port)
        function.deployment, function.stamp, function.key, function.key_problem = deployment, stamp, key, problem
        function.last_activity = max(function.last_activity, deployment.started_at)
        return function


def _repair(directory: Path, known: Function, problem: str) -> None:
    """Write the last record read back over a corrupt `state.json` (atomically, as every writer does), unless a
    `pkg` holds the function's lock: it writes its own."""
    try:
        with lock.held(directory, known.name, "gateway: repair", _quiet, wait=0):
            store.save(directory, known.deployment)
    except (lock.Busy, OSError) as exc:
        log.warning("%s: %s; not repaired now (%s)", known.name, problem, exc)
        return
    known.stamp = (directory / store.STATE_FILE).stat().st_mtime_ns
    log.warning("%s: %s; wrote back the record the gateway read last", known.name, problem)


def _quiet(message: str) -> None:
    """A repair gives way to a `pkg` at once: nothing to wait for or say."""
