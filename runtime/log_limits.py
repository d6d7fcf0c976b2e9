"""Logging that cannot flood the disk: each warning or error cause is written once per interval.

A hostile client can make one error happen thousands of times a second (every refused connection, every
malformed request line; at the descriptor limit asyncio logs a traceback per failed accept). The first
record of a cause is written whole, traceback included; repeats within `interval` seconds are counted,
and the next one written after the interval says how many were left out. A cause is the logger, the
message template (before its arguments are filled in) and the exception type. Records below WARNING
(access lines, progress) pass untouched.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

_MAX_CAUSES = 1024  # causes remembered; the oldest is forgotten first, so memory stays bounded too


class RepeatLimit(logging.Filter):
    def __init__(self, interval: float = 60.0) -> None:
        super().__init__()
        self.interval = interval
        self._causes: OrderedDict[tuple[str, str, str], tuple[float, int]] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        exc_type = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        cause = (record.name, str(record.msg), exc_type)
        now = time.monotonic()
        seen = self._causes.get(cause)
        if seen is not None and now - seen[0] < self.interval:
            self._causes[cause] = (seen[0], seen[1] + 1)
            return False
        self._causes[cause] = (now, 0)
        self._causes.move_to_end(cause)
        if len(self._causes) > _MAX_CAUSES:
            self._causes.popitem(last=False)
        if seen is not None and seen[1]:
            record.msg = f"{record.getMessage()} [{seen[1]} more like this in the last {self.interval:g} s not logged]"
            record.args = ()
        return True


def limit_repeats(*logger_names: str, interval: float = 60.0) -> None:
    """Put a `RepeatLimit` on every handler of the root logger and of `logger_names` (uvicorn's own)."""
    for name in ("", *logger_names):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RepeatLimit) for f in handler.filters):
                handler.addFilter(RepeatLimit(interval))
