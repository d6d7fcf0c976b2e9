"""Lambda SnapStart, emulated on this machine for `pkg bench cold`: the restore row.

The aws-lambda zip package's cycle, with CRIU in place of Lambda's Firecracker snapshot: a fresh process runs
the init phase and the before-snapshot hooks (`python -m runtime.aws_lambda.snapstart_emulation`: the handler
module, awslambdaric's hook runner, the engine loaded and warmed), and is dumped once it is ready and warm;
each run restores a copy, which runs the after-restore hooks (SIGUSR1), then streams the probe. Reported:
restore → first token, restore → ready, the CRIU restore itself, the snapshot's bytes and the same process's
fresh init (exec → ready, before the dump).

What real SnapStart adds that this cannot show: Lambda restores from a tiered snapshot cache (pages fetched
over the network on first touch, slower for a snapshot not recently used), the microVM's resume, and the
network path of the invocation; SnapStart also re-runs nothing of the init, as here.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from packager.coldstart import (
    READY_TIMEOUT,
    STOP_GRACE,
    Probe,
    _client,
    _first_token,
    _Pid,
    _wait_ready,
    free_port,
)
from packager.processes import precompile_runtime
from packager.targets.local.server_process import terminate

ROW = "onnxfn, SnapStart emulated (aws-lambda zip, CRIU)"
MODULE = "runtime.aws_lambda.snapstart_emulation"


class SnapStartRuns:
    """Each call: restore a copy of the init-phase snapshot, run its after-restore hooks, stream the probe."""

    def __init__(self, python: str, bundle: Path, flags: Sequence[str], probe: Probe, threads: int, work: Path) -> None:
        from packager.targets.local.process_snapshot import Criu

        self.criu = Criu.find()  # SnapshotUnavailable, with the reason, where CRIU cannot run
        self.port = free_port()
        self.command = (python, "-m", MODULE, "--port", str(self.port))
        handler_flags = [*flags, "--threads", str(threads), "--model-name", "bench"]
        self.env = {
            **os.environ, "OMP_NUM_THREADS": str(threads), "ONNXFN_STATE_DIR": str(work / "state"),
            "ORT_DISABLE_TELEMETRY": "1", "ONNXFN_BUNDLE": str(bundle), "ONNXFN_FLAGS": shlex.join(handler_flags),
            "AWS_EC2_METADATA_DISABLED": "true",
        }  # fmt: skip
        for name, value in (("AWS_REGION", "us-east-1"), ("AWS_ACCESS_KEY_ID", "bench"),
                            ("AWS_SECRET_ACCESS_KEY", "bench")):  # fmt: skip
            self.env.setdefault(name, value)  # the AWS clients are built, never called
        self.env.setdefault("AWS_DEFAULT_REGION", self.env["AWS_REGION"])
        self.bundle, self.probe, self.work = bundle, probe, work
        self.key: Any = None
        self.fresh_init = 0.0
        self.snapshot_bytes = 0

    def __call__(self) -> dict[str, Any]:
        from packager.targets.local import process_snapshot

        if self.key is None:
            self.key = self._capture()
        log = self.work / "function.log"
        with _client(self.port) as client:
            start = time.monotonic()
            try:
                pid = process_snapshot.restore(self.work, self.key, self.criu, log)
            except process_snapshot.SnapshotUnavailable as exc:
                raise RuntimeError(str(exc)) from exc
            restored = time.monotonic()
            try:
                ready = _wait_ready(client, _Pid(pid), log)
                first, text = _first_token(client, self.probe)
            finally:
                terminate(pid, STOP_GRACE)
        return {
            "exec_to_ready": ready - start,
            "exec_to_first_token": first - start,
            "ready_to_first_token": first - ready,
            "phases": {"criu_restore": restored - start},
            "fresh_init": self.fresh_init,
            "snapshot_bytes": float(self.snapshot_bytes),
            "first_text": text,
        }

    def _capture(self) -> Any:
        from packager.targets.local import process_snapshot
        from runtime.bundle import read_manifest

        precompile_runtime()
        log = self.work / "function.log"
        with log.open("wb") as out:
            started = time.monotonic()
            launcher, pid = process_snapshot.launch_isolated(self.command, out, self.env)
        try:
            with _client(self.port) as client:
                self.fresh_init = _wait_ready(client, launcher, log) - started
            process_snapshot.wait_until_warm(f"http://127.0.0.1:{self.port}", {}, READY_TIMEOUT)
            digest = read_manifest(self.bundle).digest
            key = process_snapshot.SnapshotKey.current(digest, self.command, self.criu.version, None, "", self.env)
            self.snapshot_bytes = process_snapshot.capture(self.work, pid, key, self.criu).size_bytes
        except process_snapshot.SnapshotUnavailable as exc:
            raise RuntimeError(str(exc)) from exc
        finally:
            terminate(pid, STOP_GRACE)
            launcher.wait()
        return key


def summary_line(entry: dict[str, Any]) -> str | None:
    """The restore row's figures beside its fresh init, for the bench's report; None without them."""
    try:
        first = entry["exec_to_first_token"]["median"]
        fresh = entry["fresh_init"]["median"]
        size = entry["snapshot_bytes"]["median"]
    except (KeyError, TypeError):
        return None
    return (
        f"SnapStart emulated: restore → first token {first * 1000:.0f} ms (target ≤ 300) = {first / fresh:.2f} x the "
        f"same process's fresh init {fresh * 1000:.0f} ms (target ≤ 0.25); snapshot {size / 1e6:.0f} MB. Real "
        "SnapStart adds the tiered snapshot cache (pages over the network) and the invocation's network path"
    )
