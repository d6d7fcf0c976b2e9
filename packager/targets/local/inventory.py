"""What the local servers on this machine are doing right now: `pkg status` reads one, `pkg ps` all of them.

A record says what was started; only the process and its HTTP answers say what runs: alive and serving the
recorded bundle (pids are reused), ready or not (`/ready`), its memory (`/proc`), its request counter
(`/metrics`, with the deployment's key). A server that is gone is `exited` with how it ended, which the
launcher recorded (`server_process.launch`), and the last lines of its log; one that was snapshotted and
stopped on purpose is `idle`.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from packager.errors import UserError
from packager.targets.local import crashes, memory_limit, server_process, store
from packager.targets.local.records import LocalDeployment, ServerState

REASON_LOG_LINES = 5
SCRAPE_TIMEOUT = 2.0
EXIT_STATUS_WAIT = 1.0  # seconds: the launcher writes the exit status a moment after the server ends
REQUESTS_METRIC = "onnxfn_http_requests"  # a counter by route and status (runtime/api/metrics.py)


@dataclass(frozen=True)
class Observed:
    state: ServerState
    reason: str = ""  # when not ready: how it ended or what it says, one line
    log_tail: tuple[str, ...] = ()  # when not ready: the last lines of its log
    rss_bytes: int | None = None  # None when it does not run; 0 when idle
    uptime_seconds: float | None = None

    def detail(self, log_file: str) -> str:
        """The reason and the log's last lines, for the lines under `pkg status`'s table."""
        lines = [self.reason or f"see {log_file}"]
        if self.log_tail:
            lines.append(f"last {len(self.log_tail)} lines of {log_file}:")
            lines += [f"  {line}" for line in self.log_tail]
        return "\n".join(lines)


def observe(deployment: LocalDeployment, *, log_lines: int = REASON_LOG_LINES) -> Observed:
    if server_process.serves_bundle(deployment.pid, deployment.bundle):
        state = ServerState(server_process.probe(deployment.url))
        rss = server_process.rss_bytes(deployment.pid)
        uptime = time.time() - deployment.started_at
        if state is ServerState.READY:
            return Observed(state, rss_bytes=rss, uptime_seconds=uptime)
        reason = {
            ServerState.STARTING: "its /ready says it is still loading",
            ServerState.FAILED: "its /ready says its start failed",
        }.get(state, f"nothing answers {deployment.url}/ready as the server would")
        return Observed(state, reason, _log_tail(deployment, log_lines), rss, uptime)
    if deployment.crashloop_since is not None:
        reason = crashes.describe(deployment, time.time())
        return Observed(ServerState.CRASHLOOP, reason, _log_tail(deployment, log_lines))
    if deployment.idle_since is not None:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(deployment.idle_since))
        how = "resumes its process snapshot" if deployment.wake == "snapshot" else (
            f"starts it fresh ({deployment.wake_note})" if deployment.wake_note else "starts it fresh"
        )  # fmt: skip
        reason = f"stopped as idle at {since}; the next request through the gateway {how}"
        return Observed(ServerState.IDLE, reason, (), 0)
    return Observed(ServerState.EXITED, how_it_ended(deployment), _log_tail(deployment, log_lines))


def how_it_ended(deployment: LocalDeployment) -> str:
    """How its server ended, as far as anything recorded it: the kernel's OOM killer in its memory cgroup, the
    exit status the launcher wrote, or nothing known."""
    if memory_limit.oom_kills(memory_limit.existing(deployment.cgroup)):
        return (
            f"the server (pid {deployment.pid}) went over its memory limit ([targets.local] memory_mb = "
            f"{deployment.memory_mb}) and the kernel's OOM killer ended it"
        )
    code = _recorded_exit(deployment)
    if code is not None:
        return f"the server (pid {deployment.pid}) {server_process.exit_reason(code)}"
    unknown = "it was resumed from a process snapshot" if deployment.start == "restored" else "no exit status recorded"
    return f"the server (pid {deployment.pid}) is gone ({unknown}); its log may say why"


def _recorded_exit(deployment: LocalDeployment) -> int | None:
    """The exit status its launcher wrote, waiting `EXIT_STATUS_WAIT` for it: the launcher writes it a moment
    after the server ends, and `pkg status` run just then (or the gateway noting a crash) should still say it.
    A server resumed from a process snapshot has no launcher: nothing to wait for."""
    if not deployment.exit_file:
        return None
    deadline = time.monotonic() + (EXIT_STATUS_WAIT if deployment.start != "restored" else 0)
    while True:
        code = server_process.recorded_exit(Path(deployment.exit_file), deployment.started_at)
        if code is not None or time.monotonic() >= deadline:
            return code
        time.sleep(0.05)


def _log_tail(deployment: LocalDeployment, lines: int) -> tuple[str, ...]:
    try:
        return tuple(Path(deployment.log_file).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return (f"(no log at {deployment.log_file})",)


def requests_served(deployment: LocalDeployment) -> int | None:
    """The server's HTTP request counter, summed over routes and statuses; None when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        key = deployment.api_key.read()
        headers = {"authorization": f"Bearer {key}"} if key else {}
        response = httpx.get(deployment.url + "/metrics", headers=headers, timeout=SCRAPE_TIMEOUT)
    except (UserError, OSError, httpx.HTTPError):
        return None  # the key is not at hand here (an unset variable), or the server does not answer
    if response.status_code != 200:
        return None
    total = 0.0
    for family in text_string_to_metric_families(response.text):
        if family.name == REQUESTS_METRIC:
            total += sum(sample.value for sample in family.samples if sample.name == f"{REQUESTS_METRIC}_total")
    return int(total)


@dataclass(frozen=True)
class LocalProcess:
    """One row of `pkg ps`, and one object of `pkg ps --json`."""

    name: str
    function_dir: str | None  # None for a record an earlier version wrote
    url: str  # where clients go: the gateway's root when it runs (it routes by model), else the server's; + /v1
    server_url: str  # the server's own root
    model: str
    state: ServerState
    wake: str | None  # while idle, how the next request starts it: "snapshot" or "fresh"
    idle_timeout: float  # seconds without a request before the gateway stops it (0: never)
    reason: str
    log_tail: tuple[str, ...]
    pid: int
    bundle_digest: str
    rss_bytes: int | None
    uptime_seconds: float | None
    requests: int | None  # HTTP requests served since it started (or since its snapshot was taken)
    crashes: int  # times its server ended on its own in the last crash window (the gateway started it again)
    last_crash: str  # how the last of those ended ("" when none did)
    started_at: float
    state_dir: str
    log_file: str

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "state": str(self.state), "log_tail": list(self.log_tail)}


def processes(gateway_url: str | None) -> tuple[list[LocalProcess], list[str]]:
    """Every local deployment of this user, observed in parallel (each may wait on a slow server); problems.

    `gateway_url`: the running gateway's root, the URL clients use for every function (None: none runs)."""
    records, problems = store.everything()
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(records)))) as pool:
        found = list(pool.map(lambda record: _process(record[0], record[1], gateway_url), records))
    return sorted(found, key=lambda p: (p.name, p.function_dir or "")), problems


def _process(directory: Path, deployment: LocalDeployment, gateway_url: str | None) -> LocalProcess:
    observed = observe(deployment)
    # A record under build/ (an earlier version's) is not the gateway's: it reads the per-user folder only.
    routed = gateway_url is not None and deployment.function_dir != ""
    return LocalProcess(
        name=deployment.function,
        function_dir=deployment.function_dir or None,
        url=gateway_url if routed and gateway_url else deployment.url,
        server_url=deployment.url,
        model=deployment.model_id,
        state=observed.state,
        wake=(deployment.wake or None) if observed.state is ServerState.IDLE else None,
        idle_timeout=deployment.idle_timeout,
        reason=observed.reason,
        log_tail=observed.log_tail,
        pid=deployment.pid,
        bundle_digest=deployment.bundle_digest,
        rss_bytes=observed.rss_bytes,
        uptime_seconds=observed.uptime_seconds,
        requests=requests_served(deployment) if observed.state is ServerState.READY else None,
        crashes=len(crashes.recent(deployment, time.time())),
        last_crash=deployment.crash_reason,
        started_at=deployment.started_at,
        state_dir=str(directory),
        log_file=deployment.log_file,
    )
