"""One process that imports the builder once and forks a fresh child for each structure export.

The structure step runs the builder in a process of its own (builder.py); ~7 s of its ~9 s of CPU on a tiny
model are imports (torch, transformers, the builder). A session that exports many models (the architecture
tests build one tiny model per published config) enters `shared_structure_process()`: a worker imports them
once, then forks a child per export, which runs exactly what the subprocess would (the same arguments,
environment, working directory and log) and patches the builder in its own memory only. `pkg build` exports
one model per run and never starts one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # the builder reads the local folder, never a hub


class _Worker:
    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the caller's state
        self._connection, theirs = context.Pipe()
        self._process = context.Process(target=_serve, args=(theirs,), name="onnxfn-structure", daemon=True)
        self._process.start()
        theirs.close()

    def run(self, arguments: list[str], env: dict[str, str], log: Path) -> int:
        self._connection.send((arguments, env, os.getcwd(), str(log)))
        code: int = self._connection.recv()
        return code

    def stop(self) -> None:
        self._connection.send(None)
        self._connection.close()
        self._process.join()


_shared: _Worker | None = None


@contextlib.contextmanager
def shared_structure_process() -> Iterator[None]:
    """Within this block every structure export of this process runs in one shared, pre-imported worker."""
    global _shared
    if _shared is not None:
        yield
        return
    _shared = _Worker()
    try:
        yield
    finally:
        worker, _shared = _shared, None
        worker.stop()


def run_shared(arguments: list[str], env: dict[str, str], log: Path) -> int | None:
    """`python -m packager.export.structure ARGUMENTS`'s exit status, run in the shared worker with its output
    appended to `log`; None outside `shared_structure_process()`."""
    return None if _shared is None else _shared.run(arguments, env, log)


def _serve(connection: Connection) -> None:
    os.environ.update(OFFLINE)
    from packager.export import structure  # noqa: F401 (what every child would import: imported once, here)

    while (job := connection.recv()) is not None:
        pid = os.fork()
        if pid == 0:
            connection.close()
            _export(*job)
        _, status = os.waitpid(pid, 0)
        connection.send(os.waitstatus_to_exitcode(status))


def _export(arguments: list[str], env: dict[str, str], cwd: str, log: str) -> Any:
    code = 1
    try:
        output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = ["packager.export.structure", *arguments]
        from packager.export import structure

        structure.main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
