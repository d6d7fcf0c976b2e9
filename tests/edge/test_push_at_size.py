"""`pkg push` streams a multi-GB bundle to a device: its memory does not grow with the bundle, and the device serves it.

The bundle is the demo's with its weights file grown by a 1.5 GB hole (tests/fixtures/large_bundle.py); the
archive, its digest and the upload go through those bytes. `pkg push` runs as its own process, the resident memory
of its process tree sampled from outside. Before the upload read each chunk in pieces, a 758 MB push held 200 MiB of
sent chunks (httpx's request/response cycles wait for a full garbage collection).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from packager.memory import run_sampled
from tests.edge.test_push import fingerprint, served, token_file
from tests.fixtures.large_bundle import padded_function

REPO = Path(__file__).resolve().parents[2]
NAME = "push-at-size"
PADDING = 1_500_000_000
BOUND = 256 << 20


def test_pkg_push_of_a_multi_gb_bundle_stays_in_bounded_memory(devices, demo_bundle: Path, tmp_path: Path) -> None:
    (device,) = devices(1)
    padded_function(tmp_path, NAME, demo_bundle, PADDING)
    bundle = tmp_path / "build" / NAME / "bundle"
    command = [sys.executable, "-m", "packager.cli", "push", f"functions/{NAME}", "--device", device.url,
               "--token-file", token_file(tmp_path)]  # fmt: skip
    with (tmp_path / "push.log").open("w+") as log:
        run = run_sampled(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log)
        log.seek(0)
        output = log.read()
    assert run.returncode == 0, output[-3000:]
    size = sum(path.stat().st_size for path in bundle.iterdir())
    print(f"\npkg push of a {size / 1e9:.2f} GB bundle: {run.seconds:.1f} s, peak RSS {run.peak_rss / 2**20:.0f} MiB")
    assert "peak RSS of this push" in output
    assert run.peak_rss < BOUND, f"pkg push peaked at {run.peak_rss / 2**20:.0f} MiB"
    assert served(device) == fingerprint(bundle)
