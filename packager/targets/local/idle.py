"""Scale to zero on one machine: the gateway stops a server that had no request for `idle_timeout` seconds
and starts it again on the next request (packager/gateway/).

`suspend` keeps a process snapshot of the server (the deploy's while it still matches, else a dump of the
idle server taken now), stops the server and marks the record idle: `idle_since`, and how the next start
will go (`wake`: `snapshot`, or `fresh` with the reason in `wake_note`). `resume` starts it again: the
snapshot resumed (about 0.2 s to the first token for the demo), else, or when the restore fails, a fresh
process. Both hold the function's lock, so neither races a `pkg deploy` or `pkg destroy`: a suspend gives
way to them (the gateway tries again later), a resume waits for them.

The server is started again with the command it was deployed with and the gateway's environment plus what
the deploy kept for it (`store.server_env`: its key, when that comes from a variable).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from packager.errors import UserError
from packager.targets.base import READY_TIMEOUT, STOP_TIMEOUT
from packager.targets.local import lock, memory_limit, process_snapshot, server_process, starting, store
from packager.targets.local.process_snapshot import Criu, SnapshotKey, SnapshotUnavailable
from packager.targets.local.records import LocalDeployment
from packager.targets.local.starting import Launch

SNAPSHOT = "snapshot"
FRESH = "fresh"


class NotIdle(UserError):
    """The function cannot be started again by the gateway: destroyed, or its server ended on its own."""


def _quiet(message: str) -> None:
    """Lock waits are not reported: the gateway's requests wait, and its log says why when it matters."""


def suspend(directory: Path) -> LocalDeployment | None:
    """Stop the idle server in `directory`; its record, now idle. None when there was nothing to stop (not
    deployed, already idle, gone) or a `pkg` is changing the function right now."""
    found = store.load(directory)
    if found is None:
        return None
    try:
        with lock.held(directory, found.function, "gateway: idle", _quiet, wait=0):
            deployment = store.load(directory)
            if deployment is None or deployment.idle_since is not None:
                return None
            if not server_process.serves_bundle(deployment.pid, deployment.bundle):
                return None
            wake, note = _keep_snapshot(directory, deployment)
            idle = replace(deployment, idle_since=time.time(), wake=wake, wake_note=note)
            store.save(directory, idle)  # first: a record that cannot be written (a full disk) leaves it running
            server_process.terminate(deployment.pid, STOP_TIMEOUT)
            return idle
    except lock.Busy:
        return None


def _keep_snapshot(directory: Path, deployment: LocalDeployment) -> tuple[str, str]:
    """(`snapshot`, "") when a snapshot that resumes this server is on disk (taken now if need be), else
    (`fresh`, why not)."""
    if not deployment.process_snapshot:
        return FRESH, "process_snapshot is off in its [targets.local]"
    try:
        criu = Criu.find()
        key = _snapshot_key(directory, deployment, deployment.command, criu)
        if process_snapshot.problem(directory, key) is not None:
            process_snapshot.capture(directory, deployment.pid, key, criu)
    except SnapshotUnavailable as exc:
        return FRESH, str(exc)
    return SNAPSHOT, ""


def resume(directory: Path, *, timeout: float = READY_TIMEOUT) -> LocalDeployment:
    """Start the idle server in `directory` again and wait until it is ready; its record.

    A server that runs already (a `pkg deploy` started it meanwhile) is returned as it is. Raises `NotIdle`
    when there is nothing to start, `starting.StartFailed` when the server does not come up.
    """
    found = store.load(directory)
    if found is None:
        raise NotIdle(f"the function in {directory} is no longer deployed")
    with lock.held(directory, found.function, "gateway: wake", _quiet):
        deployment = store.load(directory)
        if deployment is None:
            raise NotIdle(f"{found.function} was destroyed; deploy it again: pkg deploy {found.function_dir}")
        if deployment.idle_since is None:
            if server_process.serves_bundle(deployment.pid, deployment.bundle):
                return deployment
            raise NotIdle(
                f"the server of {deployment.function} (pid {deployment.pid}) is not running and was not stopped "
                f"as idle: `pkg status {deployment.function_dir}` says why; redeploy it: "
                f"pkg deploy {deployment.function_dir}"
            )
        return start_again(directory, deployment, timeout, snapshot=deployment.wake == SNAPSHOT)


def start_again(directory: Path, deployment: LocalDeployment, timeout: float, *, snapshot: bool) -> LocalDeployment:
    """Start a stopped server of `deployment` again (an idle one, or one that crashed) and wait until it is
    ready; with `snapshot`, its process snapshot is resumed where it is valid. Its record, ready."""
    env = {**os.environ, "ORT_DISABLE_TELEMETRY": "1", **store.server_env(directory)}
    criu, note = None, ""
    if snapshot:
        try:
            criu = Criu.find()
        except SnapshotUnavailable as exc:
            note = f"started fresh: no process snapshot ({exc})"
    elif deployment.process_snapshot:
        note = f"started fresh: {deployment.wake_note or 'no process snapshot'}"
    cgroup, _ = memory_limit.prepare(directory.name, deployment.memory_mb) if deployment.memory_mb else (None, "")
    launch = Launch(
        directory=directory,
        command=lambda port: _with_port(deployment.command, port),
        log_file=Path(deployment.log_file),
        env=env,
        criu=criu,
        snapshot_key=lambda command: _snapshot_key(directory, deployment, command, criu, env),
        timeout=timeout,
        cgroup=cgroup,
    )

    def fresh_port() -> int:
        free = starting.port_free(deployment.host, deployment.port)
        return deployment.port if free else server_process.free_port(deployment.host)

    def record(port: int, pid: int, start: str, note: str, exit_file: str) -> LocalDeployment:
        started = replace(
            deployment,
            url=starting.server_url(deployment.host, port),
            port=port,
            pid=pid,
            command=_with_port(deployment.command, port),
            started_at=time.time(),
            start=start,
            start_note=note,
            exit_file=exit_file,
            idle_since=None,
            wake="",
            wake_note="",
            ready=False,
            previous_url="",
            previous_pid=0,
            cgroup=str(cgroup.path) if cgroup is not None else "",
        )
        store.save(directory, started)
        return started

    def restore_port() -> int:
        return process_snapshot.recorded_port(directory) or deployment.port

    return starting.mark_ready(directory, starting.start(launch, restore_port, fresh_port, record, note))


def _snapshot_key(
    directory: Path,
    deployment: LocalDeployment,
    command: tuple[str, ...],
    criu: Criu | None,
    env: dict[str, str] | None = None,
) -> SnapshotKey:
    assert criu is not None  # only asked for when a snapshot is resumed or taken
    environ = env if env is not None else {**os.environ, **store.server_env(directory)}
    prepacked = Path(deployment.prepacked) if deployment.prepacked else None
    return starting.snapshot_key(deployment.bundle_digest, command, criu, deployment.api_key, prepacked, environ)


def _with_port(command: tuple[str, ...], port: int) -> tuple[str, ...]:
    at = command.index("--port") + 1
    return (*command[:at], str(port), *command[at + 1 :])
