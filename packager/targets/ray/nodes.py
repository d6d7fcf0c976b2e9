"""Ray nodes as processes on this machine: `ray start --block`, each in a session of its own, and how to stop one
so that nothing of it outlives it.

Every process a node starts (GCS, raylet, agents, the workers that run replicas) stays in the session of its
`ray start` and inherits its environment, and Ray renames many of them (`ray::ServeReplica:…`, which also
overwrites what /proc shows of their environment), so a node's processes are found by their session id and by
a marker variable (`ONNXFN_RAY_NODE`), never by a name: stopping one node never touches another's processes,
or another user's Ray. `ray stop` would: it signals every Ray process of the machine.

Loopback only: Ray 2.60 takes `--node-ip-address=127.0.0.1` as "this machine's address" and picks the
interface that routes outside (`services.resolve_ip_for_localhost`), and its servers listen on every interface
unless the node's address is exactly 127.0.0.1. `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` keeps 127.0.0.1 as it is:
a single head bound to loopback, which is what `pkg deploy` starts when `[targets.ray] address` is unset (a
node started so accepts no worker nodes; several nodes on one machine need a network namespace, as the tests
run them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packager.errors import UserError

MARKER_ENV = "ONNXFN_RAY_NODE"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": 127.0.0.1 stays 127.0.0.1 (module docstring)
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "runtime.ray_serve.proxy_errors:middlewares"
# A node's graceful stop drains it first (Serve moves its replicas away), for up to this long by default.
DRAIN_SECONDS = 10.0
STOP_TIMEOUT = DRAIN_SECONDS + 20.0
START_TIMEOUT = 120.0
WORKER_PORTS = range(10002, 20000)  # Ray's default worker ports: a GCS port there refuses to start


def ray_command(*args: str) -> list[str]:
    """The `ray` CLI of this Python (the `ray` extra's), whatever PATH says."""
    return [sys.executable, "-m", "ray.scripts.scripts", *args]


@dataclass(frozen=True)
class NodeProcess:
    pid: int  # `ray start --block`, the leader of the node's session
    marker: str  # the value of `ONNXFN_RAY_NODE` in every process of the node
    log_file: Path


def start_node(
    flags: Sequence[str],
    marker: str,
    log_file: Path,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> tuple[NodeProcess, subprocess.Popen[bytes]]:
    """`ray start --block FLAGS` detached in a session of its own, every process of it marked; returns once the
    node is up (`ray start` says so), or raises with the tail of its log. `prefix` runs it (`ip netns exec NS`:
    it execs, so the pid stays the node's)."""
    environment = {**(os.environ if env is None else env), MARKER_ENV: marker}
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as log:
        process = subprocess.Popen(
            [*prefix, *ray_command("start", "--block", *flags)], stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True, env=environment,
        )  # fmt: skip
    node = NodeProcess(process.pid, marker, log_file)
    deadline = time.monotonic() + START_TIMEOUT
    while "Ray runtime started" not in _read(log_file):
        if process.poll() is not None:
            stop_node(node, graceful=False)  # what it started before it gave up
            raise UserError(f"`ray start` exited with {process.returncode}:\n{_tail(log_file)}")
        if time.monotonic() > deadline:
            stop_node(node)
            raise UserError(f"`ray start` did not finish within {START_TIMEOUT:.0f} s:\n{_tail(log_file)}")
        time.sleep(0.2)
    return node, process


def stop_node(node: NodeProcess, *, graceful: bool = True, timeout: float = STOP_TIMEOUT) -> list[int]:
    """Stop the node: SIGTERM to `ray start --block` (it drains the node and ends its processes), then SIGKILL
    to whatever of the node is left. Returns the pids that had to be killed."""
    if graceful and _alive(node.pid):
        _signal(node.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (_alive(node.pid) or node_processes(node)):
            time.sleep(0.2)
    killed = node_processes(node)
    for pid in killed:
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and node_processes(node):
        time.sleep(0.05)
    return killed


def node_processes(node: NodeProcess) -> list[int]:
    """The node's live processes: in its `ray start`'s session, or carrying its marker (zombies left out)."""
    return marked(node.marker, session=node.pid)


def marked(marker: str, *, session: int | None = None) -> list[int]:
    """The live processes whose environment carries `ONNXFN_RAY_NODE=marker`, or whose session is `session`."""
    wanted = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields(entry)
            if fields[0] == "Z":
                continue
            if (session is not None and int(fields[3]) == session) or wanted in (entry / "environ").read_bytes().split(
                b"\0"
            ):
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def free_port() -> int:
    """A free TCP port on loopback outside Ray's worker-port range."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in WORKER_PORTS:
            return port


def _stat_fields(entry: Path) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, pgrp, session, …"""
    stat = (entry / "stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()


def _zombie(entry: Path) -> bool:
    return _stat_fields(entry)[0] == "Z"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return not _zombie(Path(f"/proc/{pid}"))
    except OSError:
        return False


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _tail(path: Path, lines: int = 25) -> str:
    return "\n".join(_read(path).splitlines()[-lines:])
