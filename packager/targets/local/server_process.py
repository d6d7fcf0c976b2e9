"""A runtime server running as a process of its own: is it alive, is it ready, stop it.

Shared by the targets that run the server on a machine `pkg` can signal (`local`, a Jetson over its
launcher) and by the cold-start measurement.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from packager.errors import UserError

LOG_TAIL_LINES = 25
_POLL = 0.1


def log_tail(log_file: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        tail = log_file.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return f"(no log at {log_file})"
    return f"last {len(tail)} lines of {log_file}:\n" + "\n".join("  " + line for line in tail)


def terminate(pid: int, timeout: float) -> None:
    """SIGTERM the server's process group (graceful: in-flight requests end), SIGKILL it after `timeout`."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not alive(pid):
                return
            time.sleep(_POLL / 2)
    raise UserError(f"process {pid} survived SIGKILL; stop it by hand")


def wait_ready(url: str, exited: Callable[[], str | None], timeout: float) -> str | None:
    """None once `url/ready` answers 200; otherwise what went wrong (`exited()` says whether the server died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        problem = exited()
        if problem is not None:
            return problem
        if probe(url) == "ready":
            return None
        time.sleep(_POLL)
    return f"was not ready after {timeout:.0f} s"


def probe(url: str) -> str:
    """`ready`, `starting`, `failed` (the server says its start failed) or `unresponsive`."""
    try:
        response = httpx.get(url + "/ready", timeout=2.0)
    except httpx.HTTPError:
        return "unresponsive"
    if response.status_code == 200:
        return "ready"
    try:
        failed = response.json().get("status") == "failed"
    except ValueError:
        return "unresponsive"  # something else answers on that port
    return "failed" if failed else "starting"


def serves_bundle(pid: int, bundle: str) -> bool:
    """`pid` is alive and still a server of `bundle` (pids are reused once a process is gone)."""
    if not alive(pid):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.exists():
        return True  # no procfs to check against: trust the pid
    return cmdline.read_bytes().split(b"\0")[1:5] == [b"-m", b"runtime", b"serve", bundle.encode()]


def alive(pid: int) -> bool:
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)  # when it is our own child, collect its exit status
        if reaped == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    # A zombie (exited, parent has not reaped it yet) still answers signal 0.
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
