"""`pkg serve` and `pkg chat` run in the local target's test workspace (a folder holding `functions/NAME` and
`build/NAME/bundle`), without deploying anything; the helpers here watch the processes they start."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path

from tests.deploy_local.conftest import workspace  # noqa: F401  (the fixture, for this folder's tests)


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return int(sock.getsockname()[1])


def session_processes(session: int) -> list[int]:
    """The live processes of a session (`start_new_session=True` makes the started pid its id): whatever a `pkg`
    started stays in its session, so an empty list means nothing outlived it."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[3]) == session and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            found.append(int(stat.parent.name))
    return found


def kill_session(session: int) -> None:
    """Whatever a test did, leave no process of it behind."""
    for pid in session_processes(session):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
