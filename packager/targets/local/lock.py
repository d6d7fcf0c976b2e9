"""One `pkg` at a time changes a function's local deployment: an flock on `STATE_DIR/deploy.lock`.

Two `pkg deploy` of one function used to race (each stopped "the previous" server, then both started one:
two servers, one of them unknown to `pkg status`). Now `deploy` and `destroy` hold this lock from the first
thing they look at until the last record they write; a second caller waits for the first, then sees its
result (a deploy replaces the server the first one started). The wait is bounded: a `pkg` stuck for longer
than a deploy can take is named with its pid, and the caller fails with what to do.

flock, not a pid file: the kernel drops the lock when its holder exits, however it exits, so a killed
`pkg` never leaves a stale lock behind. The file itself is never removed (a waiter would lock an unlinked
inode while a newcomer locks a new file). Its content says who holds it, for the waiting message only.
The descriptor is not inheritable (PEP 446), so a server started under the lock does not keep it held.

The gateway takes the same lock to stop an idle server (giving way at once to a `pkg` that holds it: `Busy`)
and to start it again (waiting, as a `pkg` would); the gateway's own start uses one in its folder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from packager.errors import UserError
from packager.private_state import PRIVATE_FILE, PRIVATE_UMASK, private_dir

LOCK_FILE = "deploy.lock"
# Longer than a deploy takes (a first start waits up to 120 s for /ready, then up to 60 s to warm up, then
# dumps the process), so a waiter gives up only on a `pkg` that is stuck.
WAIT_SECONDS = 300.0
_POLL = 0.1
# How long a waiter gives a holder that has just taken the lock to write its name there.
_NAMING = 2.0
_NAME_BYTES = 128
_UNKNOWN = "pid unknown"


class Busy(UserError):
    """Another process holds the lock, and the caller asked not to wait (`wait=0`)."""


@contextmanager
def held(
    directory: Path,
    function: str,
    action: str,
    say: Callable[[str], None],
    *,
    wait: float = WAIT_SECONDS,
    name: str = LOCK_FILE,
) -> Iterator[None]:
    """Hold the function's lock for the block; `say` tells the user when another `pkg` makes this one wait.

    Every change to a deployment's state happens under its lock: what the block creates (and what it starts) is
    created private (packager/private_state.py)."""
    private_dir(directory)
    descriptor = os.open(directory / name, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
    umask = os.umask(PRIVATE_UMASK)
    try:
        if not _try_lock(descriptor):
            if wait <= 0:
                raise Busy(f"another process ({_holder(descriptor)}) is changing {function}")
            _wait_for(descriptor, directory / name, function, wait, say)
        with contextlib.suppress(OSError):  # who holds it is for a waiter's message only (a full disk: unsaid)
            # One write, padded over what a previous holder wrote (no truncate: a waiter never reads it empty).
            os.pwrite(descriptor, json.dumps({"pid": os.getpid(), "action": action}).encode().ljust(_NAME_BYTES), 0)
        yield
    finally:
        os.umask(umask)
        os.close(descriptor)  # releases the lock


def _wait_for(descriptor: int, path: Path, function: str, wait: float, say: Callable[[str], None]) -> None:
    """Wait up to `wait` seconds for the lock, telling the user once whom they wait for.

    A holder writes its name just after it takes the lock: a waiter that finds the file not yet named gives it
    a moment (`_NAMING`) before it says "pid unknown", so a busy machine does not make the message vaguer."""
    started = time.monotonic()
    told = False
    while not _try_lock(descriptor):
        waited = time.monotonic() - started
        if not told:
            holder = _holder(descriptor)
            if holder != _UNKNOWN or waited > _NAMING:
                say(f"waiting for another pkg ({holder}) to finish with {function} (at most {wait:.0f} s)")
                told = True
        if waited > wait:
            raise UserError(
                f"another pkg ({_holder(descriptor)}) has been changing {function}'s local deployment for "
                f"more than {wait:.0f} s; wait for it to finish, or stop it and run this again (lock: {path})"
            )
        time.sleep(_POLL)


def busy(directory: Path, name: str = LOCK_FILE) -> bool:
    """Whether a process holds the lock now (a probe: a shared lock taken and dropped at once)."""
    try:
        descriptor = os.open(directory / name, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(descriptor)
    return False


def _try_lock(descriptor: int) -> bool:
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def _holder(descriptor: int) -> str:
    """ "pid 123, deploy" from the lock file, as far as the holder has written it yet."""
    try:
        data = json.loads(os.pread(descriptor, _NAME_BYTES, 0))
        return f"pid {int(data['pid'])}, {data['action']}"
    except (ValueError, KeyError, TypeError):
        return _UNKNOWN
