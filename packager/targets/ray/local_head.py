"""The Ray head `pkg deploy --target ray` starts when `[targets.ray] address` is unset: one per user and machine,
shared by every function deployed without an address, bound to loopback (nodes.py), recorded in
`$XDG_STATE_HOME/onnxfn/ray/head.json` with its log beside it. `pkg destroy` stops it once no Serve
application is left on it; `pkg status` names it. Its processes carry `ONNXFN_RAY_NODE=local-head-…`.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from packager.paths import state_root
from packager.targets.ray import nodes

RECORD = "head.json"
OBJECT_STORE_BYTES = 200 * 1000 * 1000  # Serve moves requests, not tensors: Ray's default takes 30 % of memory


def head_dir() -> Path:
    return state_root() / "ray"


@dataclass(frozen=True)
class LocalHead:
    pid: int
    marker: str
    address: str  # 127.0.0.1:PORT, the GCS
    log_file: str
    temp_dir: str
    started_at: float

    def node(self) -> nodes.NodeProcess:
        return nodes.NodeProcess(self.pid, self.marker, Path(self.log_file))


def running() -> LocalHead | None:
    """The recorded head, if its `ray start` still runs."""
    try:
        head = LocalHead(**json.loads((head_dir() / RECORD).read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None
    return head if head.pid in nodes.node_processes(head.node()) else None


@contextmanager
def _held() -> Iterator[None]:
    """One start or stop of the head at a time (two deploys at once start one head)."""
    directory = head_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "head.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure() -> tuple[LocalHead, bool]:
    """The running head, started now if there is none; whether it was started."""
    with _held():
        head = running()
        if head is not None:
            return head, False
        port = nodes.free_port()
        marker = f"local-head-{os.getuid()}-{port}"
        temp_dir = f"/tmp/onnxfn-ray-{os.getuid()}"  # short: Ray's socket paths live under it
        log_file = head_dir() / "head.log"
        flags = [
            "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--include-dashboard=false",
            "--disable-usage-stats", f"--temp-dir={temp_dir}", f"--object-store-memory={OBJECT_STORE_BYTES}",
        ]  # fmt: skip
        env = {**os.environ, nodes.LOOPBACK_ENV: "0", nodes.PROXY_CALLBACK_ENV: nodes.PROXY_CALLBACK}
        node, _ = nodes.start_node(flags, marker, log_file, env)
        head = LocalHead(node.pid, marker, f"127.0.0.1:{port}", str(log_file), temp_dir, time.time())
        (head_dir() / RECORD).write_text(json.dumps(asdict(head), indent=2) + "\n")
        return head, True


def stop(head: LocalHead) -> list[int]:
    """Stop the head and everything it started; the pids that had to be killed."""
    with _held():
        killed = nodes.stop_node(head.node())
        (head_dir() / RECORD).unlink(missing_ok=True)
        return killed
