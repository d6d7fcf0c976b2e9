"""Stopping child processes the same way everywhere: SIGTERM, a grace period, then SIGKILL."""

from __future__ import annotations

import subprocess


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
