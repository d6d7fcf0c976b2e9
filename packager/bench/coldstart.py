"""Cold start: a fresh process from exec to the first streamed token, with its phases.

In-process systems run `worker.py --cold`, which stamps each phase; servers are exec'd by this
process, polled until ready, then asked for one streamed token. Runs are interleaved across systems.
With `drop_cache`, the page cache is dropped before every run (a first request after a reboot).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from packager.bench.machine import drop_page_cache
from packager.bench.pool import WORKER, worker_env
from packager.bench.serving import free_port, launch, run_streams, wait_ready
from packager.bench.stats import median
from packager.bench.systems import SERVERS
from packager.bench.systems.base import SystemConfig, now, process_memory
from packager.bench.systems.server import SPECS
from packager.processes import stop_process

ENGINE_READY_LOG = re.compile(r"serving .* \(([\d.]+) s after start\)")


def cold_in_process(config: SystemConfig, text: str) -> dict[str, Any]:
    exec_time = now()
    completed = subprocess.run(
        [config.python, *WORKER, json.dumps(asdict(config)), "--cold", repr(exec_time)],
        input=text,
        capture_output=True,
        text=True,
        env=worker_env(config.threads),
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"cold start of {config.system} failed:\n{completed.stderr[-2000:]}")
    return json.loads(completed.stdout)


def cold_server(config: SystemConfig, text: str) -> dict[str, Any]:
    spec = SPECS[config.system](config)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as log_dir:
        log_path = Path(log_dir) / "server.log"
        exec_time = now()
        process = launch(spec, port, log_path)
        try:
            ready = wait_ready(process, base_url, spec.ready_path, log_path)
            (stream,) = asyncio.run(run_streams(base_url, [text], 1, spec.extra_body))
            first = ready + stream.first
            memory = process_memory(process.pid)
        finally:
            stop_process(process)
        phases = {"exec_to_ready": ready - exec_time, "first_token": first - ready}
        # onnxfn's server logs when its engine is loaded, measured from its own start.
        if reported := ENGINE_READY_LOG.search(log_path.read_text(errors="replace")):
            phases = {"server_reports_loaded": float(reported.group(1)), **phases}
    return {"total": first - exec_time, "phases": phases, **memory}


def cold_once(config: SystemConfig, text: str) -> dict[str, Any]:
    return cold_server(config, text) if config.system in SERVERS else cold_in_process(config, text)


def measure_cold(configs: list[SystemConfig], text: str, repetitions: int, drop_cache: bool) -> dict[str, Any]:
    samples: dict[str, list[dict[str, Any]]] = {c.system: [] for c in configs}
    errors: dict[str, str] = {}
    if not drop_cache:
        for config in configs:  # warms the page cache and the interpreter's bytecode caches
            try:
                cold_once(config, text)
            except (RuntimeError, TimeoutError) as exc:
                errors[config.system] = str(exc)
    for round_index in range(repetitions):
        shift = round_index % len(configs)
        for config in configs[shift:] + configs[:shift]:
            if config.system in errors:
                continue
            if drop_cache and not drop_page_cache():
                return {"skipped": "dropping the page cache needs root and a writable /proc/sys/vm/drop_caches"}
            try:
                samples[config.system].append(cold_once(config, text))
            except (RuntimeError, TimeoutError) as exc:
                errors[config.system] = str(exc)
    results: dict[str, Any] = {}
    for name, runs in samples.items():
        if name in errors:
            results[name] = {"error": errors[name]}
            continue
        phases = {key: median([r["phases"][key] for r in runs]) for key in runs[0]["phases"]}
        results[name] = {
            "total_s": median([r["total"] for r in runs]),
            "phases_s": phases,
            "peak_rss_mib": median([r["peak_rss_mib"] for r in runs]),
            "samples_s": [r["total"] for r in runs],
        }
    return {"systems": results}


def measure_process_snapshot(config: SystemConfig, text: str, repetitions: int) -> dict[str, Any]:
    """onnxfn's server resumed from the `local` target's process snapshot, with the same flags and request as
    `onnxfn-http`'s fresh starts; an error entry where CRIU cannot run."""
    from packager.coldstart import CompletionProbe, ProcessSnapshotRuns, ServerVariant
    from packager.targets.local.process_snapshot import SnapshotUnavailable

    spec = SPECS["onnxfn-http"](config)
    serve_flags = spec.command[spec.command.index("--log-level") + 2 :]  # the engine flags, threads included
    flags = ServerVariant("process-snapshot", tuple(serve_flags))
    probe = CompletionProbe(text, extra_body=dict(spec.extra_body))
    samples = []
    with tempfile.TemporaryDirectory(prefix="bench-criu-") as work:
        try:
            runs = ProcessSnapshotRuns(config.python, Path(config.bundle), flags, probe, config.threads, Path(work))
            runs()  # takes the snapshot, then warms the page cache like the other systems' first run
            samples = [runs() for _ in range(repetitions)]
        except (SnapshotUnavailable, RuntimeError, TimeoutError) as exc:
            return {"error": str(exc)}
    return {
        "total_s": median([s.exec_to_first_token for s in samples]),
        "phases_s": {
            "criu_restore": median([s.phases["criu_restore"] for s in samples]),
            "exec_to_ready": median([s.exec_to_ready for s in samples]),
            "first_token": median([s.ready_to_first_token for s in samples]),
        },
        "peak_rss_mib": None,
        "samples_s": [s.exec_to_first_token for s in samples],
        "dump_bytes": runs.captured.size_bytes,  # the CRIU images on disk: what a wake reads back
        "dump_s": runs.captured.seconds,
    }
