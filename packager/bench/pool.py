"""The parent's side of a worker process: spawn it, send commands, read replies, record its stderr."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from packager.bench.prompts import Prompt
from packager.bench.systems.base import SystemConfig

WORKER = ("-m", "packager.bench.worker")  # by module name: from a checkout or an installed wheel alike


class WorkerError(RuntimeError):
    pass


class Worker:
    def __init__(self, config: SystemConfig, log_dir: Path) -> None:
        self.name = config.system
        self.log_path = log_dir / f"{config.system}.log"
        self._log = self.log_path.open("ab")
        self._process = subprocess.Popen(
            [config.python, *WORKER, json.dumps(asdict(config))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=worker_env(config.threads),
        )
        hello = self._read()
        self.load_s: float = hello["load_s"]
        self.max_streams: int = hello["max_streams"]

    def _read(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            self._process.wait()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise WorkerError(f"{self.name} worker exited with {self._process.returncode}:\n{tail}")
        message = json.loads(line)
        if not message.get("ok"):
            raise WorkerError(f"{self.name}: {message.get('error')}")
        return message

    def _call(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(command) + "\n")
        self._process.stdin.flush()
        return self._read()

    def run(self, prompts: list[Prompt], max_tokens: int) -> list[dict[str, Any]]:
        return self._call({"op": "run", "prompts": [p.to_json() for p in prompts], "max_tokens": max_tokens})["streams"]

    def memory(self) -> dict[str, float]:
        return self._call({"op": "memory"})

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._call({"op": "quit"})
                self._process.wait(timeout=30)
            except (WorkerError, BrokenPipeError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
        self._log.close()


def worker_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
