"""Reading a log file once, or following it as it grows: what `pkg logs` prints for a target whose log is a
file on this machine (the local target's server log, a device agent's log)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from packager.errors import UserError
from packager.targets.base import LogLine

POLL_SECONDS = 1.0


def file_lines(path: Path, *, follow: bool, tail: int | None, poll: float = POLL_SECONDS) -> Iterator[LogLine]:
    try:
        handle = path.open("r", errors="replace")
    except FileNotFoundError:
        raise UserError(f"no log at {path}: the deployment's log was removed; redeploy to start a new one") from None
    with handle:
        lines = handle.readlines()
        for line in lines[-tail:] if tail else lines:
            yield LogLine(line.rstrip("\n"))
        while follow:
            line = handle.readline()
            if line:
                yield LogLine(line.rstrip("\n"))
            else:
                time.sleep(poll)
