"""The agent's history: one JSON line per install, refusal, rollback or recovery, newest last.

Lines are appended with O_APPEND and flushed at once; a SIGKILL mid-write leaves at most a torn last
line, which the reader skips.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class History:
    def __init__(self, path: Path, keep: int = 50) -> None:
        self.path = path
        self.keep = keep

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        entry = {"time": round(time.time(), 3), "event": event, **fields}
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
        finally:
            os.close(fd)
        return entry

    def recent(self) -> list[dict[str, Any]]:
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            return []
        entries = []
        for line in lines[-self.keep :]:
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue  # torn by a crash while it was being written
        return entries
