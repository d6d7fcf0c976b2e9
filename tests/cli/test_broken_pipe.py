"""`pkg … --json | head`: a reader that goes away early ends pkg quietly, without a BrokenPipeError traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_closed_stdout_ends_pkg_without_a_traceback() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "packager.cli", "validate", "functions/smollm2-chat", "--json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # the reader is gone before pkg writes a byte
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=60) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
