"""Supervision: a server that ended on its own (a crash, the kernel's OOM killer, a kill) is started again by
the gateway on the next request, from its process snapshot where there is a valid one, with backoff; after
`CRASHLOOP_CRASHES` ends within `CRASH_WINDOW` seconds it is left stopped and marked `crashloop` (`pkg ps`
shows why and the log's last lines) until a redeploy, or until the window has passed (one more try then).

Each end is recorded in `state.json` (`crashes`, `crash_reason`), so the count survives a gateway restart and
`pkg ps` reads it. The restart holds the function's lock, as a wake does: it never races a deploy or destroy.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from packager.errors import UserError
from packager.targets.base import READY_TIMEOUT
from packager.targets.local import idle, inventory, lock, server_process, store
from packager.targets.local.crashes import CRASHLOOP_CRASHES, crashloop_left, describe, recent
from packager.targets.local.records import LocalDeployment
from packager.targets.local.starting import StartFailed


class CrashLoop(UserError):
    """The function crashed too often in the window; the gateway does not start it again yet."""


def record_crash(directory: Path) -> LocalDeployment | None:
    """Note that the server in `directory` ended on its own, once per server; its record (None: not deployed)."""
    with lock.held(directory, directory.name, "gateway: crash", _quiet):
        deployment = store.load(directory)
        if deployment is None or not _crashed(deployment):
            return deployment
        return _noted(directory, deployment, inventory.how_it_ended(deployment))


def restart(directory: Path, *, timeout: float = READY_TIMEOUT) -> LocalDeployment:
    """Start the crashed server in `directory` again and wait until it is ready; its record.

    A server that runs (someone started it meanwhile) or an idle one is returned as it is. Raises `CrashLoop`
    when it ended too often, `idle.NotIdle` when it was destroyed, `StartFailed` when the new one failed too.
    """
    with lock.held(directory, directory.name, "gateway: restart", _quiet):
        deployment = store.load(directory)
        if deployment is None:
            raise idle.NotIdle(f"the function in {directory} is no longer deployed")
        if deployment.idle_since is not None:
            return deployment
        if server_process.serves_bundle(deployment.pid, deployment.bundle):
            return _adopted(directory, deployment, timeout)
        now = time.time()
        if _crashed(deployment):
            deployment = _noted(directory, deployment, inventory.how_it_ended(deployment))
        if crashloop_left(deployment, now) > 0:
            raise CrashLoop(describe(deployment, now))
        again = replace(deployment, crashloop_since=None)  # recorded once it is ready
        try:
            started = idle.start_again(directory, again, timeout, snapshot=deployment.process_snapshot)
        except StartFailed as exc:
            failed = _noted(directory, deployment, f"its start failed: {str(exc).splitlines()[0]}", at=time.time())
            if failed.crashloop_since is not None:
                raise CrashLoop(describe(failed, time.time())) from None
            raise
        return started


def _adopted(directory: Path, deployment: LocalDeployment, timeout: float) -> LocalDeployment:
    """A running server: as it is when it was ready; else whoever started it ended before it was (a gateway
    killed during a wake): it is waited for here and marked ready."""
    if deployment.ready:
        return deployment
    problem = server_process.wait_ready(deployment.url, lambda: None, timeout)
    if problem is not None:
        raise StartFailed(f"the server (pid {deployment.pid}) {problem}")
    adopted = replace(deployment, ready=True, previous_url="", previous_pid=0)
    store.save(directory, adopted)
    return adopted


def _crashed(deployment: LocalDeployment) -> bool:
    """Its server is gone, it was not stopped on purpose, and this end is not noted yet."""
    if deployment.idle_since is not None:
        return False
    if server_process.serves_bundle(deployment.pid, deployment.bundle):
        return False
    return not deployment.crashes or deployment.crashes[-1] < deployment.started_at


def _noted(directory: Path, deployment: LocalDeployment, reason: str, at: float | None = None) -> LocalDeployment:
    now = time.time() if at is None else at
    crashes = (*recent(deployment, now), now)
    looping = len(crashes) >= CRASHLOOP_CRASHES
    noted = replace(
        deployment,
        crashes=crashes,
        crash_reason=reason,
        crashloop_since=(deployment.crashloop_since or now) if looping else None,
    )
    store.save(directory, noted)
    return noted


def _quiet(message: str) -> None:
    """The gateway's requests wait; its log says why when it matters."""
