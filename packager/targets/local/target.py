"""The `local` target: the runtime's HTTP server as a detached background process on this machine.

A deployment's state lives in the function's per-user folder (`store.py`: `~/.local/state/onnxfn/functions/
FOLDER-HASH/`, whatever the current folder): `state.json` (what runs where), `server.pid`, `server.log`,
`server.exit` (how the server ended), `api-key` when the key was generated here, `deploy.lock` (`lock.py`:
one deploy or destroy of a function at a time) and `process-snapshot/` when `[targets.local]
process_snapshot` is on (the warmed server, which the next deploy resumes instead of starting one:
`process_snapshot.py`; `pkg destroy` keeps it). The prepacked weights are a build output for this CPU and
stay beside the bundle (`build/NAME/local/prepacked/`). `Local` puts it behind the `Target` contract:
`plan(spec)` → `apply(plan)` → `status(spec)` → `destroy(spec)`, `invoke`, `logs`.

API key: `[endpoint] api_key_env` names the variable clients use. If it is set when deploying, the server
reads it from the environment; if it is not, a random key is generated into the state folder's `api-key`
(mode 0600, no trailing newline, kept across redeploys, removed by destroy) and the server reads that file.
`pkg status NAME --api-key` prints it either way. Without `api_key_env` the endpoint has no auth.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console

from packager.errors import UserError
from packager.gateway import control as gateway
from packager.logs import file_lines
from packager.paths import build_dir, bundle_dir
from packager.processes import precompile_runtime
from packager.progress import StepProgress
from packager.runtime_flags import adapter_flags, server_flags
from packager.spec import FunctionSpec
from packager.targets.base import READY_TIMEOUT, STOP_TIMEOUT, HttpEndpoint, LogLine, Removal, Target, TargetStatus
from packager.targets.local import (
    inventory,
    lock,
    memory_limit,
    process_snapshot,
    rolling,
    server_process,
    starting,
    store,
)
from packager.targets.local.process_snapshot import Criu, SnapshotKey, SnapshotUnavailable
from packager.targets.local.records import ApiKey, LocalDeployed, LocalDeployment, LocalPlan, ServerState
from packager.targets.local.starting import Launch, StartFailed
from packager.targets.local.store import TARGET, state_dir
from runtime.bundle import BundleError, Manifest, open_bundle, read_manifest
from runtime.engine.graphs import bundle_graphs
from runtime.engine.prepacked import PrepackedGraphs

LOG_FILE = "server.log"
PREVIOUS_LOG_FILE = "server.previous.log"  # the log of the server a rolling redeploy replaced
KEY_FILE = "api-key"
ADAPTER_DIR = "adapters"  # adapters added with `pkg adapter add`, in the state folder: they outlive the server
PREPACKED_DIR = "prepacked"
PROMPT_GRAPH_WAIT = 60.0
_stderr = Console(stderr=True)


def _say(message: str) -> None:
    _stderr.print(message, highlight=False)


def plan(spec: FunctionSpec) -> LocalPlan:
    bundle = bundle_dir(spec).resolve()
    try:
        manifest = read_manifest(bundle)
    except BundleError as exc:
        raise UserError(f"{exc}\nbuild it first: pkg build {spec.directory}") from exc
    directory = state_dir(spec).resolve()
    prepack = (
        spec.targets.local.prepack and manifest.model is not None and tuple(spec.runtime.providers[:1]) == ("cpu",)
    )
    # A build output for this CPU, next to the bundle it was derived from (and as large as its weights).
    prepacked = build_dir(spec).resolve() / TARGET / PREPACKED_DIR if prepack else None
    env_name = spec.endpoint.api_key_env
    if env_name is None:
        api_key = ApiKey("none")
    elif os.environ.get(env_name, "").strip():
        api_key = ApiKey("env", env_name)
    else:
        api_key = ApiKey("file", str(directory / KEY_FILE))
    return LocalPlan(
        function=spec.name,
        bundle=bundle,
        bundle_digest=manifest.digest,
        host=spec.targets.local.host,
        port=spec.targets.local.port,
        state_dir=directory,
        api_key=api_key,
        server_flags=tuple(
            server_flags(spec) + api_key.server_flags() + _prepacked_flags(prepacked) + _adapter_flags(spec, manifest)
        ),
        function_dir=spec.directory.resolve(),
        process_snapshot=spec.targets.local.process_snapshot,
        prepacked=prepacked,
        idle_timeout=float(spec.targets.local.idle_timeout),
        max_waking_requests=spec.targets.local.max_waking_requests,
        memory_mb=spec.targets.local.memory_mb,
        legacy_dirs=tuple(found for found, _ in store.found(spec) if found.resolve() != directory),
    )


def _adapter_flags(spec: FunctionSpec, manifest: Manifest) -> list[str]:
    """Only for a bundle whose graph takes adapters: the others' command (and process snapshot) stays as it was."""
    return adapter_flags(adapter_dir(spec)) if manifest.adapters else []


def adapter_dir(spec: FunctionSpec) -> Path:
    """Where the local server keeps the adapters `pkg adapter add` gave it (kept by redeploys and `destroy`)."""
    return state_dir(spec).resolve() / ADAPTER_DIR


def _prepacked_flags(directory: Path | None) -> list[str]:
    return ["--prepacked", str(directory)] if directory is not None else []


def prepack(plan: LocalPlan) -> str | None:
    """Write the graphs with their weights packed for this CPU, unless valid ones are there; what was done.

    None when nothing was needed. A failure is reported, not raised: the server then loads the bundle's graphs.
    """
    if plan.prepacked is None:
        return None
    bundle = open_bundle(plan.bundle, verify=False)
    graphs = bundle_graphs(bundle)
    packed = PrepackedGraphs(plan.prepacked)
    if all(packed.problem(bundle, graph.name) is None for graph in graphs):
        return None
    started = time.perf_counter()
    try:
        packed.write(bundle, graphs, threads=os.cpu_count() or 1)
    except Exception as exc:  # ONNX Runtime raises its own types; the deploy goes on without
        return f"weights not prepacked ({exc}): the server packs them at start"
    return f"packed the weights for this CPU into {plan.prepacked} in {time.perf_counter() - started:.1f} s"


@dataclass(frozen=True)
class Started:
    deployment: LocalDeployment
    memory_note: str  # how memory_mb is enforced, or why not ("" without a limit)


def _start(plan: LocalPlan, *, ready_timeout: float = READY_TIMEOUT) -> Started:
    """Start the server and wait until it is ready, then switch to it and drain the one it replaces; under
    the lock.

    A rolling redeploy: the running server keeps serving (the record's `previous_url`, where the gateway routes
    while the new one is not `ready`) until the new one is ready and, with `process_snapshot` on, dumped; then
    the record switches and the old server gets SIGTERM, which lets its requests in flight finish. With
    `process_snapshot` on, a valid snapshot of an earlier deploy is resumed instead of a fresh start (unless the
    running server holds the port it listens on: then a fresh one starts beside it and is dumped in its place).
    A server that does not start leaves the previous deployment as it was.
    """
    plan.state_dir.mkdir(parents=True, exist_ok=True)
    generated_key = plan.state_dir / KEY_FILE
    for legacy in plan.legacy_dirs:  # an earlier version's deployment: its server goes, its key stays valid
        previous = _stop(legacy, forget_key=False)
        _adopt_key(previous, generated_key if plan.api_key.source == "file" else None)
    previous = store.load(plan.state_dir)
    serving = rolling.replaced_server(plan.state_dir, previous, plan.host, plan.port)
    if plan.api_key.source != "file":
        generated_key.unlink(missing_ok=True)  # left by an earlier deploy that had no key in the environment
    elif not generated_key.is_file():
        _write_secret(generated_key, secrets.token_urlsafe(32))
    # A key from a variable is kept for the gateway, which starts the server again after it idled.
    key_env = plan.api_key.location if plan.api_key.source == "env" else None
    store.save_server_env(plan.state_dir, {key_env: os.environ[key_env].strip()} if key_env else {})
    log_file = plan.state_dir / LOG_FILE
    criu, note = _criu(plan)
    snapshot_port = process_snapshot.recorded_port(plan.state_dir)
    resume = True
    if criu is not None and serving is not None and snapshot_port == serving.port:
        key = _snapshot_key(plan, plan.command(snapshot_port), criu)
        if process_snapshot.problem(plan.state_dir, key) is None:  # valid, but its port is the running server's
            resume = False
            note = (
                f"started fresh beside the running server: the process snapshot listens on port {snapshot_port}, "
                "which that server holds until this one is ready; this one is dumped in its place"
            )
    cgroup, memory_note = _memory_cgroup(plan)
    if serving is not None and log_file.is_file():
        # The server being replaced keeps writing to the file it has open, under this name from now on.
        log_file.replace(log_file.with_name(PREVIOUS_LOG_FILE))
    precompile_runtime()
    launch = Launch(
        directory=plan.state_dir,
        command=plan.command,
        log_file=log_file,
        # No ONNX Runtime telemetry: its store is an SQLite file held under a lock, which CRIU cannot dump.
        env={**os.environ, "ORT_DISABLE_TELEMETRY": "1"},
        criu=criu,
        snapshot_key=lambda command: _snapshot_key(plan, command, criu),
        timeout=ready_timeout,
        cgroup=cgroup,
        resume=resume,
    )

    def restore_port() -> int:
        return plan.port or snapshot_port or server_process.free_port(plan.host)

    def record(port: int, pid: int, start: str, note: str, exit_file: str) -> LocalDeployment:
        return _deployment(
            plan, port, pid, launch.log_file, start=start, note=note, exit_file=exit_file, replaces=serving,
            cgroup=str(cgroup.path) if cgroup is not None else "",
        )  # fmt: skip

    try:
        deployment = starting.start(
            launch, restore_port, lambda: plan.port or server_process.free_port(plan.host), record, note
        )
    except StartFailed as exc:
        _restore(plan.state_dir, previous)
        kept = "; the running version keeps serving" if serving is not None else ""
        raise UserError(f"{plan.function} did not start: {exc}{kept}") from None
    try:
        if criu is not None and deployment.start == "fresh":
            deployment = _capture(plan, deployment, criu)
        deployment = replace(deployment, ready=True)
        store.save(plan.state_dir, deployment)  # the switch: the gateway routes new requests to it from now on
    except BaseException:  # a full disk, Ctrl-C: the new server goes, the one it would replace serves on
        server_process.terminate(deployment.pid, STOP_TIMEOUT)
        with contextlib.suppress(UserError):  # if even that cannot be written, the gateway still routes to it
            _restore(plan.state_dir, previous)
        raise
    if serving is not None:
        rolling.drain(serving)
        deployment = replace(deployment, previous_url="", previous_pid=0)
        store.save(plan.state_dir, deployment)
    return Started(deployment, memory_note)


def _memory_cgroup(plan: LocalPlan) -> tuple[memory_limit.Cgroup | None, str]:
    if plan.memory_mb <= 0:
        return None, ""
    cgroup, why = memory_limit.prepare(plan.state_dir.name, plan.memory_mb)
    if cgroup is None:
        return None, f"memory_mb = {plan.memory_mb} is NOT enforced: {why}"
    return cgroup, f"at most {plan.memory_mb} MiB ({cgroup.describe()}): over it, this server alone is ended"


def _restore(directory: Path, previous: LocalDeployment | None) -> None:
    """Put the record of the deployment a failed deploy would have replaced back, or none."""
    if previous is None:
        store.forget(directory)
    else:
        store.save(directory, previous)


def _adopt_key(previous: LocalDeployment | None, generated_key: Path | None) -> None:
    """Keep the key an earlier version generated, so its clients keep working after the redeploy."""
    if previous is None or previous.api_key_source != "file":
        return
    old = Path(previous.api_key_location)
    if generated_key is not None and not generated_key.exists() and old.is_file():
        _write_secret(generated_key, old.read_text().strip())
    old.unlink(missing_ok=True)


def _snapshot_key(plan: LocalPlan, command: tuple[str, ...], criu: Criu | None) -> SnapshotKey:
    assert criu is not None  # only asked for when a snapshot is resumed or taken
    return starting.snapshot_key(plan.bundle_digest, command, criu, plan.api_key, plan.prepacked, os.environ)


def _criu(plan: LocalPlan) -> tuple[Criu | None, str]:
    if not plan.process_snapshot:
        return None, ""
    try:
        return Criu.find(), ""
    except SnapshotUnavailable as exc:
        return None, f"started fresh: no process snapshot ({exc})"


def _deployment(
    plan: LocalPlan,
    port: int,
    pid: int,
    log_file: Path,
    *,
    start: str,
    note: str,
    exit_file: str,
    replaces: rolling.Serving | None = None,
    cgroup: str = "",
) -> LocalDeployment:
    """The record of a server that is starting (`ready` once the deploy switches to it), saved."""
    deployment = LocalDeployment(
        function=plan.function,
        url=starting.server_url(plan.host, port),
        host=plan.host,
        port=port,
        pid=pid,
        bundle=str(plan.bundle),
        bundle_digest=plan.bundle_digest,
        started_at=time.time(),
        log_file=str(log_file),
        api_key_source=plan.api_key.source,
        api_key_location=plan.api_key.location,
        command=plan.command(port),
        start=start,
        start_note=note,
        function_dir=str(plan.function_dir),
        exit_file=exit_file,
        process_snapshot=plan.process_snapshot,
        prepacked=str(plan.prepacked or ""),
        idle_timeout=plan.idle_timeout,
        max_waking_requests=plan.max_waking_requests,
        ready=False,
        previous_url=replaces.url if replaces is not None else "",
        previous_pid=replaces.pid if replaces is not None else 0,
        memory_mb=plan.memory_mb,
        cgroup=cgroup,
    )
    store.save(plan.state_dir, deployment)
    return deployment


def _capture(plan: LocalPlan, deployment: LocalDeployment, criu: Criu) -> LocalDeployment:
    """Snapshot the ready server once its prompt graph is built, so a resumed copy needs no build either."""
    api_key = deployment.api_key.read()
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    process_snapshot.wait_until_warm(deployment.url, headers, PROMPT_GRAPH_WAIT)
    key = _snapshot_key(plan, deployment.command, criu)
    try:
        captured = process_snapshot.capture(plan.state_dir, deployment.pid, key, criu)
    except SnapshotUnavailable as exc:
        note = f"{deployment.start_note}; " if deployment.start_note else ""
        return _deployment_with_note(plan, deployment, f"{note}no process snapshot taken ({exc})")
    taken = f"process snapshot taken ({captured.size_bytes / 2**20:,.0f} MiB in {captured.seconds:.1f} s): " \
        "the next deploy resumes it"  # fmt: skip
    note = f"{deployment.start_note}; {taken}" if deployment.start_note else taken
    return _deployment_with_note(plan, deployment, note)


def _deployment_with_note(plan: LocalPlan, deployment: LocalDeployment, note: str) -> LocalDeployment:
    updated = replace(deployment, start_note=note)
    store.save(plan.state_dir, updated)
    return updated


def status(spec: FunctionSpec) -> TargetStatus | None:
    deployment = store.current(spec)
    if deployment is None:
        return None
    observed = inventory.observe(deployment)
    running = gateway.running()
    return TargetStatus(
        target=TARGET,
        url=running.url if running is not None else deployment.url,  # the gateway routes to it, idle or not
        pid=deployment.pid,
        bundle_digest=deployment.bundle_digest,
        state=str(observed.state),
        uptime_seconds=observed.uptime_seconds,
        detail=observed.detail(deployment.log_file),
        deployment=deployment,
    )


def destroy(
    spec: FunctionSpec, *, timeout: float = STOP_TIMEOUT, say: Callable[[str], None] = _say
) -> LocalDeployment | None:
    """Stop the server and remove its state (the log stays for post-mortems); None if nothing was deployed."""
    with lock.held(state_dir(spec), spec.name, "destroy", say):
        stopped = [_stop(directory, timeout=timeout) for directory, _ in store.found(spec)]
    return next((deployment for deployment in stopped if deployment is not None), None)


def _stop(directory: Path, *, timeout: float = STOP_TIMEOUT, forget_key: bool = True) -> LocalDeployment | None:
    deployment = store.load(directory)
    if deployment is None:
        return None
    for pid in (deployment.pid, deployment.previous_pid):  # the previous: a rolling redeploy was under way
        if pid and server_process.serves_bundle(pid, deployment.bundle):
            server_process.terminate(pid, timeout)
    store.forget(directory)
    memory_limit.remove(deployment.cgroup)
    if forget_key and deployment.api_key_source == "file":
        Path(deployment.api_key_location).unlink(missing_ok=True)
    return deployment


def _write_secret(path: Path, value: str) -> None:
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(value)  # no newline: `open(path).read()` is the key, as clients expect


class Local(Target):
    name = TARGET

    def plan(self, spec: FunctionSpec, progress: StepProgress) -> LocalPlan:
        previous = status(spec)
        replaces = None
        if previous is not None:
            replaces = f"pid {previous.pid} ({previous.state}, bundle {previous.bundle_digest[:19]}…)"
        return replace(plan(spec), replaces=replaces)

    def apply(self, plan: LocalPlan, progress: StepProgress) -> LocalDeployed:
        def say(message: str) -> None:
            progress.console.print(message, highlight=False)

        # One deploy or destroy of this function at a time, from the first look at what runs to the last record.
        with lock.held(plan.state_dir, plan.function, "deploy", say):
            previous = next((d for d in map(store.load, (plan.state_dir, *plan.legacy_dirs)) if d is not None), None)
            with progress.step("prepack", "pack the weights for this CPU (once per bundle)") as step:
                packed = prepack(plan)
                if packed is None:
                    step.cached()
            if packed is not None:
                progress.console.print(f"  {packed}", highlight=False)
            with progress.step("start", f"start {plan.function} (bundle {plan.bundle_digest[:19]}…)"):
                started = _start(plan, ready_timeout=self.ready_timeout)
        # What it replaced once it held the lock: another pkg may have deployed while this one waited.
        replaced = f"pid {previous.pid} (bundle {previous.bundle_digest[:19]}…)" if previous is not None else ""
        try:  # the one endpoint for every function; without it the server still answers on its own port
            gateway_url, gateway_note = gateway.ensure().url, ""
        except UserError as exc:
            gateway_url, gateway_note = "", str(exc).splitlines()[0]
        deployment = replace(started.deployment, replaced=replaced)
        return LocalDeployed(deployment, gateway_url, gateway_note, started.memory_note)

    def status(self, spec: FunctionSpec) -> TargetStatus | None:
        return status(spec)

    def scaling(self, spec: FunctionSpec) -> tuple[int | str, int | str]:
        return (0 if spec.targets.local.idle_timeout > 0 else 1), 1  # the gateway stops it when idle

    def destroy(self, spec: FunctionSpec) -> Removal | None:
        stopped = destroy(spec, timeout=self.stop_timeout)
        if stopped is None:
            return None
        where = f"pid {stopped.pid}, {stopped.url}"
        return Removal(f"stopped {spec.name} on {TARGET} ({where}); log kept at {stopped.log_file}")

    def http_endpoint(self, spec: FunctionSpec) -> HttpEndpoint:
        """The gateway's URL (started if the function is idle or its server ended: only the gateway wakes it or
        starts it again), else the server's."""
        deployment = store.current(spec)
        if deployment is None:
            raise UserError(f"{spec.name} is not deployed; deploy it first: pkg deploy {spec.directory} --target local")
        observed = inventory.observe(deployment)
        state = observed.state
        if state not in (ServerState.READY, ServerState.IDLE, ServerState.EXITED):
            tail = server_process.log_tail(Path(deployment.log_file))
            raise UserError(
                f"the local deployment of {spec.name} is not serving (state: {state}, pid {deployment.pid}: "
                f"{observed.reason}); redeploy with `pkg deploy {spec.directory} --target local`\n{tail}"
            )
        running = gateway.running() or (gateway.ensure() if state is not ServerState.READY else None)
        key = deployment.api_key.read()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return HttpEndpoint(running.url if running is not None else deployment.url, headers)

    def logs(
        self, spec: FunctionSpec, *, follow: bool, since_seconds: float | None, tail: int | None
    ) -> Iterator[LogLine]:
        deployment = store.current(spec)
        # A destroyed deployment leaves its log behind, in the place a deploy writes it (or an earlier version did).
        places = [state_dir(spec) / LOG_FILE, *(legacy / LOG_FILE for legacy in store.legacy_dirs(spec))]
        log_file = Path(deployment.log_file) if deployment else next((p for p in places if p.is_file()), places[0])
        if not log_file.is_file():
            raise UserError(
                f"{spec.name} was never deployed locally; deploy it: pkg deploy {spec.directory} --target local"
            )
        return file_lines(log_file, follow=follow, tail=tail)
