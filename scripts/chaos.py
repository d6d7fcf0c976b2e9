"""Chaos: mixed traffic through the local gateway while servers, the gateway and the worker are killed, disks
fill up, state files are corrupted and functions are redeployed; then the figures (not a test).

    sudo .venv/bin/python scripts/chaos.py [--minutes 10] [--seed 1] [--markdown bench/chaos.md]

Needs root (tmpfs mounts, CRIU, memory cgroups), the demo and embedding bundles (built if missing) and the
[packager] extra (the adapter function is built and its adapter written with PEFT). Everything runs in a
workspace of its own (its `$XDG_STATE_HOME`, a free gateway port, a moto server on a free port), removed after.
What it measures: requests sent/answered/failed by kind, clients that hung and streams that ended as if whole
(both should be 0), queue messages lost (0), recovery time after each kind of fault, RSS and descriptor drift
of every process, and the processes, cgroups and mounts left behind after the teardown (0). The world is
scripts/chaos_parts/world.py, the clients traffic.py, the faults faults.py, the figures report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packager.targets.local.server_process import free_port
from scripts.chaos_parts import world as worlds
from scripts.chaos_parts.faults import Faults, Supervisor
from scripts.chaos_parts.report import Figures, Sample, markdown
from scripts.chaos_parts.traffic import Traffic
from scripts.chaos_parts.world import MARK, World

SAMPLE_EVERY_S = 5.0
QUEUE_SETTLE_S = 180.0


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--markdown", type=Path, help="write the figures here (bench/chaos.md)")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    parser.add_argument("--logs", type=Path, help="copy the gateway's, servers' and worker's logs here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("error: run as root: the run mounts tmpfs folders and uses CRIU and memory cgroups", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="onnxfn-chaos-"))
    world = worlds.create(root, free_port("127.0.0.1"))
    supervisor = Supervisor(world)
    samples: list[Sample] = []
    stop_sampling = threading.Event()
    traffic: Traffic | None = None
    faults = Faults(world, rng.randrange(1 << 30))
    started = time.monotonic()
    try:
        worlds.deploy_all(world, say)
        worlds.start_queue(world, say)
        supervisor.start()
        started = time.monotonic()
        until = started + args.minutes * 60
        sampler = threading.Thread(target=_sample, args=(world, samples, started, stop_sampling), name="sampler")
        sampler.start()
        traffic = Traffic(world, until, rng.randrange(1 << 30))
        traffic.start()
        say(f"traffic and faults for {args.minutes:g} minutes (workspace {root})")
        world.notes.append(f"load average when the traffic started: {_load()} (2 cores shared with other work)")
        while time.monotonic() < until - 25:
            time.sleep(rng.uniform(8.0, 20.0))
            kind = faults.next_kind()
            fault = faults.inject(kind)
            recovered = "never" if fault.recovery_s is None else f"{fault.recovery_s:.2f} s"
            say(f"{kind} ({fault.target}): recovered in {recovered} {fault.note}")
        traffic.join()
        world.notes.append(f"load average when it ended: {_load()}")
        say("traffic over; waiting for the queue to settle")
        queue = _settle_queue(world, traffic.sent_messages)
    finally:
        stop_sampling.set()
        supervisor.stop()
        leftovers, orphans = _teardown(world, args.logs)
        events = _gateway_events(world)  # its log, before the workspace goes
        shutil.rmtree(root, ignore_errors=True)
    calls = traffic.calls if traffic is not None else []
    figures = Figures(
        time.monotonic() - started, calls, faults.done, samples, queue, orphans, leftovers, supervisor.restarts
    )
    figures.notes += world.notes
    figures.gateway_events = events
    report = figures.to_json()
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        command = f".venv/bin/python scripts/chaos.py --minutes {args.minutes:g} --seed {args.seed}"
        machine = f"{platform.node()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}"
        args.markdown.write_text(markdown(figures, command, machine))
    return 0


def _load() -> str:
    return ", ".join(f"{value:.1f}" for value in os.getloadavg()) + " (1, 5, 15 min)"


def _sample(world: World, samples: list[Sample], started: float, stop: threading.Event) -> None:
    while not stop.wait(SAMPLE_EVERY_S):
        at = time.monotonic() - started
        pids = {"gateway": world.gateway_pid(), "driver": os.getpid()}
        queue = world.queue
        if queue is not None and queue.worker is not None:
            pids["worker"] = queue.worker.pid
        for kind, function in world.functions.items():
            try:
                pids[kind] = int(world.record(function)["pid"])
            except (OSError, ValueError, KeyError):
                continue
        for who, pid in pids.items():
            look = _look(pid) if pid else None
            if look is not None:
                samples.append(Sample(at, who, pid, *look))  # type: ignore[arg-type]


def _look(pid: int) -> tuple[int, int] | None:
    try:
        rss = next(
            int(line.split()[1]) * 1024
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("VmRSS:")
        )
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None


def _settle_queue(world: World, sent: list[str]) -> dict[str, int]:
    queue = world.queue
    assert queue is not None
    sqs, s3 = queue.client("sqs"), queue.client("s3")
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    deadline = time.monotonic() + QUEUE_SETTLE_S
    queued = 1
    while time.monotonic() < deadline:
        attributes = sqs.get_queue_attributes(QueueUrl=queue.url, AttributeNames=names)["Attributes"]
        queued = sum(int(attributes[name]) for name in names)
        if queued == 0:
            break
        time.sleep(1.0)
    stored: set[str] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=queue.bucket, Prefix="results/"):
        stored |= {item["Key"].removeprefix("results/").removesuffix(".json") for item in page.get("Contents", [])}
    dead: set[str] = set()
    while batch := sqs.receive_message(QueueUrl=queue.dlq_url, MaxNumberOfMessages=10).get("Messages", []):
        for message in batch:
            try:
                dead.add(json.loads(message["Body"])["request_id"])
            except (ValueError, KeyError):
                dead.add(message["MessageId"])
    answered, dead_lettered = len(set(sent) & stored), len(set(sent) & dead)
    lost = len(sent) - answered - dead_lettered - queued
    return {"sent": len(sent), "answered": answered, "dead_lettered": dead_lettered, "queued": queued, "lost": lost}


def _teardown(world: World, logs: Path | None) -> tuple[list[str], list[str]]:
    """Destroy the functions, stop the gateway, the worker and moto, keep the logs, unmount; what is left."""
    for function in world.functions.values():
        destroyed = world.pkg("destroy", str(function.folder))
        if destroyed.returncode != 0:
            world.notes.append(f"pkg destroy {function.name}: {destroyed.stderr.strip()[-300:]}")
    world.pkg("gateway", "stop")
    queue = world.queue
    if queue is not None and queue.worker is not None and queue.worker.poll() is None:
        queue.worker.send_signal(signal.SIGTERM)
        try:
            queue.worker.wait(40)
        except Exception:
            queue.worker.kill()
            queue.worker.wait(10)
    world.stack.close()
    if logs is not None:
        _keep_logs(world, logs)
    for mount in reversed(world.mounts):
        worlds.unmount(mount)
    time.sleep(1.0)  # a launcher shell writes its server's exit status, then ends
    leftovers = [line for line in Path("/proc/mounts").read_text().splitlines() if str(world.root) in line]
    names = {world.state_dir(function).name for function in world.functions.values()}
    leftovers += [str(path) for path in Path("/sys/fs/cgroup").rglob("onnxfn-*") if path.name[7:] in names]
    return leftovers, _orphans(world.root)


# What the gateway logs when it acts (packager/gateway/lifecycle.py, relay.py, functions.py), and uvicorn's
# line for an exception that escaped the app (a 500): counted from its log, every incarnation appending to it.
GATEWAY_EVENTS = {
    "wakes": "woke ",
    "idle stops": " s: stopped; the next request wakes it",
    "restarts after a crash": "; started again: ",
    "restarts after a backoff pause": " ended again (",
    "restarts that failed": "could not start ",
    "wakes that failed": "could not wake ",
    "streams that broke off": "the server's stream broke off",
    "records written back": "wrote back the record",
    "idle checks that failed": "idle check failed",
    "exceptions in the app (500s)": "Exception in ASGI application",
}


def _gateway_events(world: World) -> dict[str, int]:
    try:
        log = (world.state_root / "gateway" / "gateway.log").read_text(errors="replace")
    except OSError:
        return {}
    return {event: log.count(pattern) for event, pattern in GATEWAY_EVENTS.items()}


def _keep_logs(world: World, where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    for log in [*world.state_root.rglob("*.log"), *(world.root / "logs").glob("*.log")]:
        shutil.copy(log, where / f"{log.parent.name}-{log.name}")


def _orphans(root: Path) -> list[str]:
    """Processes still carrying this run's mark, and zombies of this one."""
    mark = f"{MARK}={root}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        if mark in environ or (stat[0] == "Z" and int(stat[1]) == os.getpid()):
            found.append(f"pid {proc.name} ({stat[0]}): {command}")
    return found


if __name__ == "__main__":
    sys.exit(main())
