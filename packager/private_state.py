"""The local state is the user's alone: folders 0700, files 0600 (issue 47, row 3).

It holds API keys (`api-key`, `server-env.json`) and, in a process snapshot, the server's whole memory: the key
again and the prompts it served. `$XDG_STATE_HOME` may sit in a folder others can enter, so the state root is
made 0700 whenever it is used, and everything written under it is created private: the processes that write it
(a `pkg` holding a function's lock, the gateway, the servers they start, `criu dump`) run with umask 077, and a
snapshot is chmod-ed once dumped, whatever modes CRIU chose.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PRIVATE_UMASK = 0o077
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def private_dir(path: Path) -> Path:
    """`path` as a folder only its owner can enter: created 0700 (its missing parents too), narrowed if wider."""
    for folder in reversed([path, *(p for p in path.parents if not p.exists())]):
        folder.mkdir(mode=PRIVATE_DIR, exist_ok=True)  # `parents=True` would make the missing parents 0755
    if stat.S_IMODE(path.stat().st_mode) != PRIVATE_DIR:
        path.chmod(PRIVATE_DIR)
    return path


def make_private(tree: Path) -> None:
    """Narrow every folder under `tree` (itself included) to 0700 and every file to 0600; links are left alone."""
    for folder, folders, files in os.walk(tree):
        os.chmod(folder, PRIVATE_DIR)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, PRIVATE_FILE)
        folders[:] = [d for d in folders if not os.path.islink(os.path.join(folder, d))]


@contextmanager
def private_umask() -> Iterator[None]:
    """Files and folders this process (and what it starts) creates in the block are its owner's alone.

    The umask is the process's: another thread creating a file meanwhile gets it private too, never wider."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(previous)
