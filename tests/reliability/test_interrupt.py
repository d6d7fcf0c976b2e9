"""Ctrl-C on `python -m runtime serve`: a graceful stop and the shell's exit status for SIGINT, no traceback.

uvicorn shuts down, then re-raises the signal; Python turned that into a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from tests.reliability.live import DEMO_BUNDLE, live_server


@pytest.mark.real_model
def test_ctrl_c_stops_the_server_without_a_traceback(demo_bundle: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with live_server(DEMO_BUNDLE, log) as server:
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=30) == 130
    text = log.read_text()
    assert "Finished server process" in text and "Traceback" not in text, text[-2000:]
