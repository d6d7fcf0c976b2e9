"""The start-up timeline: when each phase of a cold start began and ended, on a clock shared with the bench.

Times are `time.monotonic()` (CLOCK_MONOTONIC, one clock for every process on Linux), so a parent that
noted when it exec'd the runtime can place the child's phases on its own timeline, interpreter start
included. The server logs the timeline as one line when the engine is ready and again after the first
prefill; `parse_timeline` reads the last such line back.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

RUNTIME_IMPORTED = time.monotonic()  # the first runtime module the interpreter loaded imports this one
LOG_PREFIX = "startup timeline "


class StartupTimeline:
    """Named spans `(start, end)`; spans on different threads may overlap (session build and tokenizer do)."""

    def __init__(self) -> None:
        self._spans: dict[str, tuple[float, float]] = {}
        self._recorded = threading.Condition()

    def record(self, name: str, start: float, end: float) -> None:
        with self._recorded:
            self._spans.setdefault(name, (start, end))  # the first occurrence is the cold one
            self._recorded.notify_all()

    def wait_for(self, name: str, timeout: float) -> bool:
        """Block until span `name` is recorded (or `timeout` seconds pass); True if it was."""
        with self._recorded:
            return self._recorded.wait_for(lambda: name in self._spans, timeout)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.record(name, start, time.monotonic())

    def has(self, name: str) -> bool:
        return name in self._spans

    def to_json(self) -> dict[str, Any]:
        with self._recorded:
            spans = {name: [start, end] for name, (start, end) in self._spans.items()}
        return {"runtime_imported": RUNTIME_IMPORTED, "spans": spans}

    def log_line(self) -> str:
        return LOG_PREFIX + json.dumps(self.to_json(), sort_keys=True)


def parse_timeline(log_text: str) -> dict[str, Any] | None:
    """The last timeline a server logged in `log_text`, or None if it logged none."""
    found = None
    for line in log_text.splitlines():
        at = line.find(LOG_PREFIX)
        if at >= 0:
            found = json.loads(line[at + len(LOG_PREFIX) :])
    return found


TIMELINE = StartupTimeline()  # one per process: start-up happens once
