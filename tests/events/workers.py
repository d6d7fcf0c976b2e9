"""`python -m runtime worker` as a real child process against the moto server, and waiting on its results."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.events.conftest import MAX_BATCH, MAX_CONTEXT, Queues


@dataclass
class WorkerProcess:
    process: subprocess.Popen[bytes]
    log_file: Path

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for(
            lambda: "worker ready" in self.log(), timeout, lambda: f"the worker did not start:\n{self.log()[-3000:]}"
        )

    def wait_warm(self, timeout: float = 60) -> None:
        """Ready, and prompts run through the bundle's prefill graph, which the engine loads after it is ready.

        Until then a prompt is prefilled by the int8 decode graph, whose logits round differently: two greedy
        requests compare equal only when both ran on the same side of that switch.
        """
        self.wait_ready(timeout)
        wait_for(
            lambda: "prefill graph in use" in self.log(),
            timeout,
            lambda: f"the worker never switched to the prefill graph:\n{self.log()[-3000:]}",
        )

    def signal(self, number: int) -> None:
        self.process.send_signal(number)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)


@contextmanager
def worker_process(
    bundle: Path, queues: Queues, env: dict[str, str], log_dir: Path, *flags: str
) -> Iterator[WorkerProcess]:
    command = [
        sys.executable, "-m", "runtime", "worker", str(bundle), "--queue-url", queues.url,
        "--ledger", f"s3://{queues.bucket}/ledger", "--no-verify", "--max-batch", str(MAX_BATCH),
        "--max-context", str(MAX_CONTEXT), "--kv-memory-mb", "200", "--temperature", "0", "--wait-time", "1",
        *flags,
    ]  # fmt: skip
    log_file = log_dir / f"worker-{time.monotonic_ns()}.log"
    with log_file.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    worker = WorkerProcess(process, log_file)
    try:
        yield worker
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()


def wait_for(
    condition: Callable[[], bool], timeout: float, message: str | Callable[[], str], *, every: float = 0.2
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message() if callable(message) else message)
        time.sleep(every)
