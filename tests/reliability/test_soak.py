"""The soak script for 60 seconds: 64 streaming clients with disconnects and cancellations, checked by the
script itself (0 errors but 429, well-formed streams, RSS flat within 5 % after warm-up, no leaked slot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.live import REPO

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(bool(os.environ.get("ONNXFN_FAST_TESTS")), reason="ONNXFN_FAST_TESTS skips the 60 s soak"),
]


def test_one_minute_soak(demo_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    command = [sys.executable, str(REPO / "scripts" / "soak.py"), "--seconds", "60", "--bundle", str(demo_bundle)]
    done = subprocess.run([*command, "--json", str(out)], capture_output=True, text=True, timeout=400)
    report = json.loads(out.read_text())
    assert report["problems"] == [], done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    outcomes = report["outcomes"]
    assert outcomes["completed"] > 0 and outcomes.get("disconnected", 0) + report["cancelled"] > 0
    assert (report["final_running"], report["final_queued"]) == (0, 0)
    assert report["rss_spread"] <= 0.05
