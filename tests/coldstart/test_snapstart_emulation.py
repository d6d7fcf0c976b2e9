"""The bench's restore row: Lambda SnapStart's cycle emulated with real CRIU (`packager/bench/snapstart.py`).

A fresh process runs the handler's init phase and the before-snapshot hooks through awslambdaric's hook runner,
is dumped once warm, and each restored copy runs the after-restore hooks (SIGUSR1) before it streams a token.
"""

from __future__ import annotations

import sys
from pathlib import Path

from packager.bench.snapstart import SnapStartRuns, summary_line
from packager.coldstart import ChatProbe


def test_each_restored_copy_runs_the_after_restore_hooks_and_streams_sooner_than_a_fresh_init(
    demo_bundle: Path, tmp_path: Path
) -> None:
    runs = SnapStartRuns(sys.executable, demo_bundle, ["--max-batch", "4"], ChatProbe(None), 2, tmp_path)
    samples = []
    for _ in range(2):  # two copies of one snapshot
        samples.append(runs())
        log = (tmp_path / "function.log").read_text(errors="replace")  # truncated at each restore
        assert "after-restore hooks took" in log and "restored from a snapshot" in log, log[-2000:]
        assert "before-snapshot hooks took" not in log  # the init phase is not run again
    for sample in samples:
        assert sample["first_text"] and sample["snapshot_bytes"] > 50e6
        assert sample["phases"]["criu_restore"] <= sample["exec_to_ready"] <= sample["exec_to_first_token"]
        assert sample["exec_to_first_token"] < sample["fresh_init"], sample
    entry = {key: {"median": samples[-1][key]} for key in ("exec_to_first_token", "fresh_init", "snapshot_bytes")}
    line = summary_line(entry)
    assert line is not None and "SnapStart emulated: restore → first token" in line and "tiered snapshot cache" in line
