"""Runtime child processes: bytecode compiled before they start, and stopped the same way everywhere."""

from __future__ import annotations

import compileall
import subprocess
from pathlib import Path


def precompile_runtime() -> None:
    """Write `.pyc` files for the runtime package, so a server's imports do not compile its source.

    Python never writes them where PYTHONDONTWRITEBYTECODE is set (and cannot in a read-only install);
    compiling the runtime's modules on every start costs ~90 ms of a cold start. Up-to-date files are
    only stat'ed, so a second call is cheap; an unwritable tree is left as it is.
    """
    import runtime

    compileall.compile_dir(Path(runtime.__file__).parent, quiet=2, workers=1)


def stop_process(process: subprocess.Popen[bytes], *, grace: float = 10.0) -> None:
    """Ask `process` to exit; kill it if it is still running after `grace` seconds. Always reaps it."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
