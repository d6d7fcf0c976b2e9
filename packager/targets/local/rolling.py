"""A rolling redeploy of a local function: the running server keeps serving until its replacement is ready.

`pkg deploy` of a running function starts the new server beside the old one (on another port); its record
says `ready: false` and names the old server as `previous_url`, where the gateway keeps routing. Once the new
one is ready (and dumped, with process snapshots), the record switches and the old server is drained: the
gateway reads records at most every `REFRESH_SECONDS`, so after `SWITCH_SECONDS` nothing new is sent to the
old server; what it is still answering (its `/metrics`: running and queued requests) it finishes, then it gets
SIGTERM. A request that reaches the old server as it closes is sent again by the gateway (it found nothing
listening, so nothing of it was answered), to the new one.

A server on a fixed port (`[targets.local] port`) cannot have a successor beside it: it is drained and stopped
first, and requests wait at the gateway until the new one is ready.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from packager.errors import UserError
from packager.gateway import metrics
from packager.targets.base import STOP_TIMEOUT
from packager.targets.local import server_process, store
from packager.targets.local.records import LocalDeployment

SWITCH_SECONDS = 1.5  # > the gateway's REFRESH_SECONDS (0.5 s) and its monitor's tick (1 s)
DRAIN_TIMEOUT = 30.0  # seconds a replaced server may take to finish what it answers
_POLL = 0.1


@dataclass(frozen=True)
class Serving:
    """The server being replaced."""

    url: str
    port: int
    pid: int
    headers: dict[str, str] = field(default_factory=dict)  # its key, to read its /metrics


def replaced_server(directory: Path, previous: LocalDeployment | None, host: str, port: int) -> Serving | None:
    """The server of `previous` that keeps serving until the new one on `host:port` (0: any port) is ready;
    None when none runs. A leftover of a deploy that ended before its switch is stopped, and so is a server
    that holds the fixed port the new one needs (drained first)."""
    if previous is None:
        return None
    if previous.previous_pid and server_process.serves_bundle(previous.previous_pid, previous.bundle):
        server_process.terminate(previous.previous_pid, STOP_TIMEOUT)
    if previous.idle_since is not None or not server_process.serves_bundle(previous.pid, previous.bundle):
        return None
    try:
        key = previous.api_key.read(environ=store.server_env(directory))
    except UserError:
        key = None  # its /metrics cannot be read: it is drained by its graceful shutdown alone
    serving = Serving(previous.url, previous.port, previous.pid, {"authorization": f"Bearer {key}"} if key else {})
    if not previous.ready or (port and port == previous.port and host == previous.host):
        drain(serving, switched=False)
        return None
    return serving


def drain(server: Serving, *, switched: bool = True) -> None:
    """Let `server` finish what it answers (at most DRAIN_TIMEOUT), then stop it."""
    deadline = time.monotonic() + DRAIN_TIMEOUT
    if switched:
        time.sleep(SWITCH_SECONDS)  # until every request the gateway sends has gone to the new server
    while time.monotonic() < deadline and _busy(server):
        time.sleep(_POLL)
    server_process.terminate(server.pid, STOP_TIMEOUT)  # SIGTERM: uvicorn closes its port, then exits


def _busy(server: Serving) -> bool:
    try:
        response = httpx.get(server.url + "/metrics", headers=server.headers, timeout=2.0)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and metrics.parse(response.text).busy
