"""What a local deployment is on disk and on screen: its API key, its plan, its `state.json` record and the
states a server can be in."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from packager.errors import UserError
from packager.targets.base import PlanRow


class ServerState(StrEnum):
    """What `pkg status` and `pkg ps` say about a local server."""

    READY = "ready"  # answers /ready with 200
    STARTING = "starting"  # its process runs and /ready says it is loading
    # Stopped on purpose by the gateway after `idle_timeout` without a request (`LocalDeployment.idle_since`;
    # targets/local/idle.py): it holds no memory, and the next request through the gateway starts it again.
    IDLE = "idle"
    EXITED = "exited"  # its process is gone, and nobody meant it to be: the reason says how it ended
    FAILED = "failed"  # its process runs but /ready says its start failed (the log says why)
    UNRESPONSIVE = "unresponsive"  # its process runs but /ready does not answer (or something else answers)
    # Its server ended on its own too often in a minute (supervise.py): the gateway stopped restarting it.
    CRASHLOOP = "crashloop"


@dataclass(frozen=True)
class ApiKey:
    """Where the server and clients find the key: `env` (a variable name), `file` (a path) or `none`."""

    source: str
    location: str = ""

    def describe(self) -> str:
        if self.source == "env":
            return f"from ${self.location}"
        if self.source == "file":
            return f"generated into {self.location}"
        return "none: the endpoint has no auth"

    def server_flags(self) -> list[str]:
        flag = {"env": "--api-key-env", "file": "--api-key-file"}.get(self.source)
        return [flag, self.location] if flag else []

    def read(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The key; `environ` is where an `env` key is looked up (default: this process's environment)."""
        if self.source == "env":
            key = (os.environ if environ is None else environ).get(self.location, "").strip()
            if not key:
                raise UserError(f"the deployment reads its API key from ${self.location}, which is now unset")
            return key
        if self.source == "file":
            try:
                return Path(self.location).read_text().strip()
            except FileNotFoundError:
                raise UserError(
                    f"the deployment's API key file {self.location} is missing; redeploy to generate a new key"
                ) from None
        return None


@dataclass(frozen=True)
class LocalPlan:
    function: str
    bundle: Path
    bundle_digest: str
    host: str
    port: int  # 0 = a free port, chosen by `apply`
    state_dir: Path
    api_key: ApiKey
    server_flags: tuple[str, ...]  # everything after `serve BUNDLE --host H --port P`
    function_dir: Path  # absolute, for `pkg ps`
    process_snapshot: bool = False
    prepacked: Path | None = None  # where the graphs with prepacked weights live (`prepack`), if they are used
    idle_timeout: float = 0.0  # seconds without a request before the gateway stops it; 0 = never
    max_waking_requests: int = 1
    memory_mb: int = 0  # the server's memory limit (a cgroup); 0 = none

    replaces: str | None = None  # the deployment this one replaces: "pid P (state, bundle D)"
    # Where an earlier version left this function's record (`build/NAME/local`): the deploy stops its server.
    legacy_dirs: tuple[Path, ...] = ()

    def command(self, port: int) -> tuple[str, ...]:
        return (
            sys.executable, "-m", "runtime", "serve", str(self.bundle),
            "--host", self.host, "--port", str(port), *self.server_flags,
        )  # fmt: skip

    @property
    def no_changes(self) -> bool:
        return False  # a deploy always (re)starts the server, so its flags and key take effect

    @property
    def where(self) -> str:
        return "this machine"

    def rows(self) -> list[PlanRow]:
        action = "replace" if self.replaces is not None else "create"
        return [(action, "local server", self.function, f"bundle {self.bundle_digest[:19]}…")]


@dataclass(frozen=True)
class LocalDeployment:
    """The contents of `state.json`."""

    function: str
    url: str
    host: str
    port: int
    pid: int
    bundle: str
    bundle_digest: str
    started_at: float  # epoch seconds
    log_file: str
    api_key_source: str
    api_key_location: str
    command: tuple[str, ...]
    start: str = "fresh"  # or "restored": resumed from the process snapshot
    start_note: str = ""  # what happened with the process snapshot, for the deploy's summary
    replaced: str = ""  # the deployment this one replaced, when there was one
    # Added with the per-user state folder; records an earlier version wrote lack them (hence the defaults).
    function_dir: str = ""  # the function folder, absolute: `pkg ps` shows it
    exit_file: str = ""  # where the launcher writes the server's exit status; "" for a resumed process
    idle_since: float | None = None  # epoch seconds it was snapshotted and stopped as idle; None while it should run
    # Added with the gateway (packager/gateway/): what it needs to stop the server when idle and start it again.
    process_snapshot: bool = False  # deployed with `process_snapshot`: a wake may resume the snapshot
    prepacked: str = ""  # the prepacked graphs the server maps ("" without): part of the snapshot's key
    idle_timeout: float = 0.0  # seconds without a request before the gateway stops it; 0 (and old records) = never
    max_waking_requests: int = 1  # requests that may wait while it wakes; more get 429
    wake: str = ""  # while idle: "snapshot" (the next request resumes the process snapshot) or "fresh"
    wake_note: str = ""  # why a wake will be a fresh start
    # Added with supervision and rolling redeploys (packager/targets/local/supervise.py).
    # False while this server starts: the gateway routes to `previous_url` (the server it replaces, while that
    # runs) until the deploy has it ready, then switches; records an earlier version wrote are ready.
    ready: bool = True
    previous_url: str = ""
    previous_pid: int = 0
    crashes: tuple[float, ...] = ()  # when its server ended on its own, within the last crash window
    crash_reason: str = ""  # how the last one ended
    crashloop_since: float | None = None  # too many crashes in the window: the gateway stopped restarting it
    memory_mb: int = 0  # [targets.local] memory_mb; 0 = no limit
    cgroup: str = ""  # the memory cgroup its server runs in ("" = none: no limit, or none could be made)

    @property
    def api_key(self) -> ApiKey:
        return ApiKey(self.api_key_source, self.api_key_location)

    @property
    def model_id(self) -> str:
        return self.function  # the server runs with `--model-name NAME` (runtime_flags.py)


@dataclass(frozen=True)
class LocalDeployed:
    """What `pkg deploy` shows: the deployment and the gateway that routes to it."""

    deployment: LocalDeployment
    gateway_url: str  # "" when no gateway runs (`gateway_note` says why)
    gateway_note: str = ""
    memory_note: str = ""  # how [targets.local] memory_mb is enforced, or why it is not

    def summary(self) -> list[tuple[str, str]]:
        d = self.deployment
        if self.gateway_url:
            url = (
                f"[bold]{self.gateway_url}/v1[/] (OpenAI-compatible, model {d.model_id!r}: the gateway routes by model)"
            )
        else:
            url = f"[bold]{d.url}/v1[/] (OpenAI-compatible; no gateway: {self.gateway_note})"
        if d.idle_timeout <= 0:
            idle = "never stopped when idle ([targets.local] idle_timeout = 0)"
        elif self.gateway_url:
            idle = f"stopped after {d.idle_timeout:.0f} s without a request; the next request starts it again"
        else:
            idle = "never stopped when idle: the gateway does that, and it does not run"
        rows = [
            ("url", url),
            ("server", f"{d.url} (its own port)"),
            ("pid", str(d.pid)),
            ("bundle", d.bundle),
            ("digest", d.bundle_digest),
            ("api key", d.api_key.describe()),
            ("idle", idle),
            ("log", d.log_file),
        ]
        rows += [("memory", self.memory_note)] if self.memory_note else []
        rows += [("start", d.start_note)] if d.start_note else []
        return rows + ([("replaced", d.replaced)] if d.replaced else [])

    def next_step(self, function_dir: Path) -> str:
        return f'try it: pkg invoke {function_dir} "Hello!"'
