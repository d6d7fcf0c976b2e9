"""A real `python -m runtime serve` process on a free 127.0.0.1 port, its output captured to a file.

Shared by the reliability tests and the bounded load scripts (scripts/soak.py, overload.py, fuzz_api.py).
A separate process, not a thread, so its RSS is its own and its log can be grepped for secrets.
"""

from __future__ import annotations

import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
DEMO_BUNDLE = REPO / "build" / "smollm2-chat" / "bundle"
KEY_ENV = "ONNXFN_RELIABILITY_KEY"


@dataclass(frozen=True)
class LiveServer:
    url: str
    key: str
    process: subprocess.Popen[bytes]
    log: Path
    model: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {self.process.pid}")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def running_and_queued(self) -> tuple[float, float]:
        """`onnxfn_running_requests` and `onnxfn_queue_depth` from `/metrics`."""
        values = {}
        for line in httpx.get(self.url + "/metrics", headers=self.auth, timeout=10).text.splitlines():
            name, _, value = line.partition(" ")
            values[name] = value
        return float(values["onnxfn_running_requests"]), float(values["onnxfn_queue_depth"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def live_server(
    bundle: Path,
    log: Path,
    flags: Sequence[str] = (),
    *,
    key: str | None = None,
    max_fds: int | None = None,
    auth: bool = True,
) -> Iterator[LiveServer]:
    """Serve `bundle` with `flags` and a bearer key (random unless given) until the block ends.

    `max_fds` sets the server's descriptor limit (soft and hard), so an attack can reach it cheaply. Without
    `auth` the server has no key (the documented default of a function without `[endpoint] api_key_env`).
    """
    key = key or "sk-onnxfn-" + secrets.token_hex(16)
    port = free_port()
    command = [sys.executable, "-m", "runtime", "serve", str(bundle), "--port", str(port)]
    command += ["--api-key-env", KEY_ENV] if auth else []
    env = {**os.environ, KEY_ENV: key, "PYTHONUNBUFFERED": "1"}

    def in_child() -> None:
        # SIGINT as a terminal's shell leaves it: a suite started in the background (`cmd &`) ignores it, and an
        # ignored signal stays ignored across exec (Python then never turns it into KeyboardInterrupt).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if max_fds is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max_fds, max_fds))

    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, *flags], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, preexec_fn=in_child
        )
    url = f"http://127.0.0.1:{port}"
    try:
        model = _wait_ready(url, key, process, log)
        yield LiveServer(url=url, key=key, process=process, log=log, model=model)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(url: str, key: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            ready = httpx.get(url + "/ready", headers={"Authorization": f"Bearer {key}"}, timeout=2)
            if ready.status_code == 200:
                return str(ready.json()["model"])
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} was not ready after {timeout} s:\n{log.read_text()[-3000:]}")
