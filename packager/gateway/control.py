"""The gateway process's lifecycle: is it running, start it detached, stop it.

`pkg deploy --target local` starts it when it is not running, `pkg gateway start|stop|status` by hand. Its
files are in `$XDG_STATE_HOME/onnxfn/gateway/`: `gateway.json` (pid, host, port, start time), `gateway.log`
and `gateway.lock`, which one start at a time holds, so two deploys never start two gateways.

The port: `--port`, else `$ONNXFN_GATEWAY_PORT`, else 8420. One gateway per user: it serves every function
that user deployed, so a running one is reused whatever port is asked for, unless `--port` names another.
Imports nothing heavy: `pkg deploy` and `pkg status` load this module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from packager.errors import UserError
from packager.paths import state_root
from packager.targets.local import lock, server_process, starting

DEFAULT_PORT = 8420
PORT_ENV = "ONNXFN_GATEWAY_PORT"
SERVICE = "onnxfn-gateway"  # what its /health says, so a port held by something else is told apart
RECORD_FILE = "gateway.json"
LOG_FILE = "gateway.log"
LOCK_FILE = "gateway.lock"
START_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class Gateway:
    pid: int
    host: str
    port: int
    started_at: float
    log_file: str

    @property
    def url(self) -> str:
        return starting.server_url(self.host, self.port)


def directory() -> Path:
    return state_root() / "gateway"


def default_port() -> int:
    configured = os.environ.get(PORT_ENV, "").strip()
    if not configured:
        return DEFAULT_PORT
    if not configured.isdigit() or not 0 < int(configured) < 65536:
        raise UserError(f"${PORT_ENV} is {configured!r}, not a port number; set it to one (1-65535) or unset it")
    return int(configured)


def running() -> Gateway | None:
    """The gateway recorded for this user, if it runs and answers as the gateway."""
    try:
        gateway = Gateway(**json.loads((directory() / RECORD_FILE).read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None
    if not server_process.alive(gateway.pid) or not answers(gateway.url):
        return None
    return gateway


def answers(url: str) -> bool:
    try:
        return bool(httpx.get(url + "/health", timeout=2.0).json().get("service") == SERVICE)
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def ensure(port: int | None = None, host: str = "127.0.0.1") -> Gateway:
    """The running gateway, started first if there is none; on `port` when given (else `default_port()`).

    Raises `UserError` when it cannot start (the port is taken, it fails) or runs on another port than `port`.
    """
    with lock.held(directory(), "the gateway", "gateway start", _say, name=LOCK_FILE):
        gateway = running()
        if gateway is not None:
            if port is not None and port != gateway.port:
                raise UserError(
                    f"the gateway already runs on port {gateway.port} (pid {gateway.pid}); to move it: "
                    f"pkg gateway stop && pkg gateway start --port {port}"
                )
            return gateway
        return _start(port if port is not None else default_port(), host)


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def _start(port: int, host: str) -> Gateway:
    if not starting.port_free(host, port):
        raise UserError(
            f"cannot start the gateway: port {port} on {host} is taken by another program; "
            f"start it on another port: pkg gateway start --port {port + 1} (or set ${PORT_ENV})"
        )
    folder = directory()
    log_file = folder / LOG_FILE
    command = [sys.executable, "-m", "packager.gateway", "--host", host, "--port", str(port)]
    with log_file.open("ab") as log:
        # A session of its own: Ctrl-C in the terminal that ran `pkg deploy` does not reach it.
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=folder, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    gateway = Gateway(process.pid, host, port, time.time(), str(log_file))
    deadline = time.monotonic() + START_TIMEOUT
    while not answers(gateway.url):
        code = process.poll()
        if code is not None or time.monotonic() > deadline:
            if code is None:
                server_process.terminate(process.pid, STOP_TIMEOUT)
            why = server_process.exit_reason(code) if code is not None else f"did not answer in {START_TIMEOUT:.0f} s"
            raise UserError(f"the gateway {why}\n{server_process.log_tail(log_file)}")
        time.sleep(0.05)
    temporary = folder / f"{RECORD_FILE}.tmp"
    temporary.write_text(json.dumps(asdict(gateway), indent=2) + "\n")
    temporary.replace(folder / RECORD_FILE)
    return gateway


def stop() -> Gateway | None:
    """Stop the gateway; what ran, or None when none did. The functions keep running (idle ones stay idle)."""
    with lock.held(directory(), "the gateway", "gateway stop", _say, name=LOCK_FILE):
        gateway = running()
        if gateway is not None:
            server_process.terminate(gateway.pid, STOP_TIMEOUT)
        (directory() / RECORD_FILE).unlink(missing_ok=True)
        return gateway
