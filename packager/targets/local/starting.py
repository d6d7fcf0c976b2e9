"""How a local server starts, for `pkg deploy` and for the gateway's wake of an idle function.

Its process snapshot is resumed where a valid one exists (process_snapshot.py), else a fresh process is
started; either way the record is written as soon as the pid is known (so `pkg status` says `starting`),
then the server is waited on until `/ready`. A snapshot that cannot be used, or whose process does not come
back, is reported in the record's note and the server starts fresh instead; a fresh start that fails raises
`StartFailed` with the server's last words, and leaves no process behind.
"""

from __future__ import annotations

import hashlib
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from packager.runtime_flags import adapter_dir_of
from packager.targets.base import STOP_TIMEOUT
from packager.targets.local import memory_limit, process_snapshot, server_process, store
from packager.targets.local.memory_limit import Cgroup
from packager.targets.local.process_snapshot import Criu, SnapshotKey, SnapshotUnavailable
from packager.targets.local.records import ApiKey, LocalDeployment
from runtime.engine.prepacked import PrepackedGraphs

EXIT_FILE = "server.exit"
# The launchers this process started (a shell that waits for its server): polled by `reap`, so a long-lived
# starter (the gateway, which starts servers again after idle stops and crashes) keeps no zombie of them.
_launchers: list[subprocess.Popen[bytes]] = []

# (port, pid, start: "fresh" | "restored", note, exit file or "") -> the deployment's record, saved.
Record = Callable[[int, int, str, str, str], LocalDeployment]


class StartFailed(Exception):
    """The server did not become ready: why, then the last lines of its log."""


@dataclass(frozen=True)
class Launch:
    directory: Path  # the function's state folder: its process snapshot, where the exit status goes
    command: Callable[[int], tuple[str, ...]]  # the server's command for a port
    log_file: Path
    env: dict[str, str]
    criu: Criu | None  # None: no process snapshot is resumed, and a fresh server needs no pid namespace
    snapshot_key: Callable[[tuple[str, ...]], SnapshotKey]  # what a resumable snapshot of `command` must match
    timeout: float  # for /ready
    cgroup: Cgroup | None = None  # the memory cgroup the server runs in (memory_limit.py), None: no limit
    resume: bool = True  # False: start fresh even where the snapshot is valid (its port is taken)


def start(
    launch: Launch, restore_port: Callable[[], int], fresh_port: Callable[[], int], record: Record, note: str = ""
) -> LocalDeployment:
    """Resume the snapshot on `restore_port()` (its server listens where it was dumped), else start fresh on
    `fresh_port()`; the ready deployment. `note` says why a snapshot was not even tried, if it was wanted."""
    if launch.criu is not None and launch.resume and process_snapshot.exists(launch.directory):
        port = restore_port()
        key = launch.snapshot_key(launch.command(port))
        unusable = process_snapshot.problem(launch.directory, key)
        if unusable is not None:
            note = f"started fresh: the process snapshot was not used ({unusable})"
        else:
            try:
                prefix = memory_limit.join_prefix(launch.cgroup)
                pid = process_snapshot.restore(launch.directory, key, launch.criu, launch.log_file, prefix)
            except SnapshotUnavailable as exc:
                note = f"started fresh: the process snapshot was not used ({exc})"
            else:
                deployment = _recorded(record, pid, port, "restored", "resumed the process snapshot", "")
                # A resumed server is ready within milliseconds: polled 10x as often as a fresh one, since every
                # poll interval lost here is added to a woken function's first token.
                problem = server_process.wait_ready(
                    deployment.url, lambda: None if server_process.alive(pid) else "exited", launch.timeout, 0.01
                )
                if problem is None:
                    return deployment
                _stop(pid)
                note = f"started fresh: the resumed process snapshot {problem}"
            # It matched but did not come back: gone, so the server started now is dumped in its place.
            process_snapshot.discard(launch.directory)
    port = fresh_port()
    exit_file = launch.directory / EXIT_FILE
    # With snapshots, the server runs in a pid namespace of its own (process_snapshot.ISOLATION says why).
    prefix = process_snapshot.PID_NAMESPACE if launch.criu is not None else ()
    with launch.log_file.open("wb") as log:
        process, pid = server_process.launch(
            launch.command(port), log, launch.env, exit_file, (*memory_limit.join_prefix(launch.cgroup), *prefix)
        )
    _launchers.append(process)
    deployment = _recorded(record, pid, port, "fresh", note, str(exit_file))

    def exited() -> str | None:
        code = process.poll()
        return None if code is None else server_process.exit_reason(code)

    problem = server_process.wait_ready(deployment.url, exited, launch.timeout)
    if problem is not None:
        _stop(pid)
        raise StartFailed(f"the server {problem}\n{server_process.log_tail(launch.log_file)}")
    return deployment


def _recorded(record: Record, pid: int, port: int, start: str, note: str, exit_file: str) -> LocalDeployment:
    """The record of the server just started; a server whose record cannot be written (a full disk) is
    stopped, so no server runs that no record knows."""
    try:
        return record(port, pid, start, note, exit_file)
    except BaseException:
        _stop(pid)
        raise


def mark_ready(directory: Path, deployment: LocalDeployment) -> LocalDeployment:
    """Record the started server as ready; one whose record cannot be written (a full disk) is stopped."""
    ready = replace(deployment, ready=True)
    try:
        store.save(directory, ready)
    except BaseException:
        _stop(deployment.pid)
        raise
    return ready


def reap() -> None:
    """Collect the exit status of launchers whose server ended (each `poll` that finds one done reaps it)."""
    _launchers[:] = [process for process in _launchers if process.poll() is None]


def _stop(pid: int) -> None:
    if server_process.alive(pid):
        server_process.terminate(pid, STOP_TIMEOUT)


def snapshot_key(
    bundle_digest: str,
    command: tuple[str, ...],
    criu: Criu,
    api_key: ApiKey,
    prepacked: Path | None,
    environ: Mapping[str, str],
) -> SnapshotKey:
    env_name = api_key.location if api_key.source == "env" else None
    digest = PrepackedGraphs(prepacked).digest() if prepacked is not None else ""
    key = SnapshotKey.current(bundle_digest, command, criu.version, env_name, digest, environ)
    return replace(key, adapters_digest=adapters_digest(command))


def adapters_digest(command: tuple[str, ...]) -> str:
    """What the adapter files in the server's `--adapter-dir` are now (names, sizes, times); "" without one.

    An adapter is written to a temporary name and renamed into place, so any change shows in these."""
    directory = adapter_dir_of(command)
    if directory is None or not directory.is_dir():
        return ""
    files = sorted(p for p in directory.glob("*.safetensors") if not p.name.startswith("."))
    if not files:
        return ""
    listing = "\n".join(f"{p.name} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def server_url(host: str, port: int) -> str:
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


def port_free(host: str, port: int) -> bool:
    """Whether the server could listen on `port` (with SO_REUSEADDR, as it binds: TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
