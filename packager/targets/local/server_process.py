"""A runtime server running as a process of its own: is it alive, is it ready, stop it.

Shared by the targets that run the server on a machine `pkg` can signal (`local`, a Jetson over its
launcher) and by the cold-start measurement.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import httpx

from packager.errors import UserError

LOG_TAIL_LINES = 25
_POLL = 0.1
SERVER_START_TIMEOUT = 5.0  # for the launcher to exec the server: it only forks and execs
# The server outlives `pkg`, so nobody would learn how it ended (init reaps it): a shell waits for it and
# writes its exit status ($0: the file; 128+N when signal N killed it) for `pkg status` and `pkg ps`.
# `setsid`: a session of its own, so Ctrl-C in this terminal does not reach it and `terminate` signals its
# group; `-w`: should setsid have to fork, it still waits, so the shell gets the server's status.
_RECORD_EXIT = '"$@"; code=$?; echo "$code" > "$0"; exit "$code"'


def launch(
    command: Sequence[str], log: IO[bytes], env: dict[str, str], exit_file: Path, prefix: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], int]:
    """Start `command` detached, its exit status recorded in `exit_file`: the launcher and the server's pid.

    `prefix` runs the recording shell (`unshare --pid`: the shell's first child, the server, is then the first
    process of a pid namespace of its own). The launcher's `poll()` is the server's exit status.
    """
    exit_file.unlink(missing_ok=True)
    launcher = subprocess.Popen(
        (*prefix, "sh", "-c", _RECORD_EXIT, str(exit_file), "setsid", "-w", *command), stdin=subprocess.DEVNULL,
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
    )  # fmt: skip
    wanted = [arg.encode() for arg in command]
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while time.monotonic() < deadline and launcher.poll() is None:
        for pid in _descendants(launcher.pid):
            if _cmdline(pid) == wanted:
                return launcher, pid
        time.sleep(0.01)
    return launcher, launcher.pid  # it exited (its status tells why) or never got to exec the server


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            children = [int(c) for c in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        found += children
        pending += children
    return found


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    except (FileNotFoundError, ProcessLookupError):
        return []


def recorded_exit(exit_file: Path, since: float) -> int | None:
    """The exit status the launcher wrote for a server started at `since`; None when there is none (yet)."""
    try:
        if exit_file.stat().st_mtime < since - 1:
            return None  # left by an earlier server
        return int(exit_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def exit_reason(code: int) -> str:
    """`exited with code 1`, `was killed by SIGKILL (...)`, from a shell's status (128+N) or Popen's (-N)."""
    number = code - 128 if code > 128 else -code if code < 0 else 0
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"exited with code {code}"
    hint = " (out of memory? `dmesg` says when the kernel's OOM killer chose it)" if name == "SIGKILL" else ""
    return f"was killed by {name}{hint}"


def rss_bytes(pid: int) -> int | None:
    """The process's resident memory (VmRSS: its heap plus the file pages it maps, e.g. prepacked weights)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None
    return None


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


def wait_ready(url: str, exited: Callable[[], str | None], timeout: float, interval: float = _POLL) -> str | None:
    """None once `url/ready` answers 200; otherwise what went wrong (`exited()` says whether the server died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        problem = exited()
        if problem is not None:
            return problem
        if probe(url) == "ready":
            return None
        time.sleep(interval)
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
    # A zombie (exited, parent has not reaped it yet) still answers signal 0; one reaped since is simply gone.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
