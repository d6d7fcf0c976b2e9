"""The `jetson` target: `pkg deploy --target jetson`, run on an NVIDIA Jetson, serves the function there.

Like `local`, it works on the machine it runs on: it starts the edge agent (`python -m runtime agent`) with
TensorRT, then CUDA, then CPU, its bundle root on persistent storage (the agent keeps each bundle's TensorRT
engine and timing caches beside it, so the engine is built once per device and bundle), and hands it the
bundle with the same push client as `pkg push`; later pushes to `http://DEVICE:PORT` reach the same agent.
With `wheel` set it also writes the Jetson Docker context (L4T base + that onnxruntime-gpu wheel).

Anywhere else it refuses before touching anything, naming what is missing (aarch64, L4T, the TensorRT and
CUDA providers) and where it works. Nothing of it can run on this project's CI machine: the plan and its
refusal are what the tests check.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packager.edge.archive import archive_bundle
from packager.edge.client import AgentClient, AgentError, DeviceAuth
from packager.edge.devices import TOKEN_ENV
from packager.edge.fleet import push
from packager.errors import UserError
from packager.image.jetson import JETPACK_6, L4TBase, check_wheel, write_jetson_context
from packager.logs import file_lines
from packager.paths import build_dir, bundle_dir
from packager.progress import StepProgress
from packager.runtime_flags import server_flags
from packager.spec import FunctionSpec, JetsonTarget
from packager.targets.base import HttpEndpoint, LogLine, Removal, Target, TargetStatus
from packager.targets.local.server_process import alive, terminate
from runtime.bundle import BundleError, read_manifest

TARGET = "jetson"
PROVIDERS = ("tensorrt", "cuda", "cpu")
REQUIRED_PROVIDERS = {"TensorrtExecutionProvider": "tensorrt", "CUDAExecutionProvider": "cuda"}
L4T_RELEASE_FILE = Path("/etc/nv_tegra_release")
JETPACK_BASES = {"6.1": JETPACK_6, "6.0": L4TBase("nvcr.io/nvidia/l4t-jetpack:r36.3.0", "3.10")}
READY_TIMEOUT = 1800.0  # the first start on a device compiles the TensorRT engine


@dataclass(frozen=True)
class HostFacts:
    """What decides whether this machine can run the Jetson configuration."""

    machine: str
    l4t_release: str | None  # first line of /etc/nv_tegra_release, None when absent
    providers: tuple[str, ...]  # onnxruntime.get_available_providers()
    onnxruntime: str
    hostname: str

    @classmethod
    def here(cls) -> HostFacts:
        import onnxruntime

        release = L4T_RELEASE_FILE.read_text().splitlines()[0].strip() if L4T_RELEASE_FILE.is_file() else None
        return cls(
            platform.machine(), release, tuple(onnxruntime.get_available_providers()), onnxruntime.__version__,
            socket.gethostname(),
        )  # fmt: skip

    def missing(self) -> list[str]:
        problems = []
        if self.machine != "aarch64":
            problems.append(f"this machine is {self.machine}, not aarch64")
        if self.l4t_release is None:
            problems.append(f"no {L4T_RELEASE_FILE}: this is not Linux for Tegra (JetPack)")
        absent = [name for name in REQUIRED_PROVIDERS if name not in self.providers]
        if absent:
            problems.append(
                f"onnxruntime {self.onnxruntime} here offers {', '.join(self.providers)}, without "
                f"{' and '.join(absent)} (NVIDIA's onnxruntime-gpu wheel for the JetPack provides them)"
            )
        return problems


@dataclass(frozen=True)
class JetsonPlan:
    """The agent to start (unless it runs), the bundle to push to it, and the Docker context to write."""

    spec: FunctionSpec
    device: str  # the device's platform: machine and L4T release
    bundle: Path
    bundle_digest: str
    agent_command: tuple[str, ...]
    bundle_root: Path
    tensorrt_cache: Path
    url: str
    token: str = field(repr=False)
    wheel: Path | None
    base: L4TBase
    state_dir: Path
    host: HostFacts
    serving: str | None  # the digest the device's agent serves now, None when no agent runs

    @property
    def where(self) -> str:
        return self.device

    @property
    def no_changes(self) -> bool:
        return self.serving == self.bundle_digest and (self.wheel is None or self._context_written())

    def _context_written(self) -> bool:
        return (self.state_dir / "image" / "Dockerfile").is_file()

    def rows(self) -> list[tuple[str, str, str, str]]:
        agent = "none" if self.serving is not None else "create"
        bundle = "none" if self.serving == self.bundle_digest else ("create" if self.serving is None else "update")
        rows = [
            (agent, "edge agent", self.url, " ".join(self.agent_command[3:])),
            (bundle, "bundle", self.bundle_digest[:19], f"TensorRT engine cache {self.tensorrt_cache}"),
        ]
        if self.wheel is not None:
            image = "none" if self._context_written() else "create"
            rows.append((image, "docker context", str(self.state_dir / "image"), f"FROM {self.base.reference}"))
        return rows


@dataclass(frozen=True)
class JetsonDeployment:
    function: str
    url: str
    device: str  # machine and L4T release
    hostname: str
    bundle_digest: str
    pid: int
    log_file: str
    changed: int
    updated_at: float

    def summary(self) -> list[tuple[str, str]]:
        return [
            ("url", f"[bold]{self.url}/v1[/] (the agent; OpenAI-compatible)"),
            ("device", f"{self.hostname} ({self.device})"),
            ("bundle", self.bundle_digest),
            ("agent", f"pid {self.pid}, log {self.log_file}"),
            ("changed", f"{self.changed} of the plan's rows"),
        ]

    def next_step(self, function_dir: Path) -> str:
        return f'try it: pkg invoke {function_dir} "Hello!" --target jetson'


def state_dir(spec: FunctionSpec) -> Path:
    return build_dir(spec) / TARGET


def check_host(spec: FunctionSpec, host: HostFacts) -> None:
    problems = host.missing()
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise UserError(
            f"--target jetson runs on an NVIDIA Jetson (aarch64, L4T from JetPack {spec.targets.jetson.jetpack}, "
            f"onnxruntime-gpu with the TensorRT and CUDA providers), and this machine is not one:\n{listing}\n"
            f"run `pkg deploy {spec.directory} --target jetson` on the device; to prepare an image here instead: "
            f"pkg image jetson {spec.directory} --wheel onnxruntime_gpu-…-linux_aarch64.whl",
            exit_code=2,
        )


def plan(spec: FunctionSpec, *, progress: object = None, host: HostFacts | None = None) -> JetsonPlan:
    """Check that this is a Jetson and work out the agent, its bundle root and TensorRT cache; starts nothing."""
    host = host or HostFacts.here()
    check_host(spec, host)
    settings = spec.targets.jetson
    base = JETPACK_BASES[settings.jetpack]
    wheel = Path(settings.wheel) if settings.wheel else None
    if wheel is not None:
        check_wheel(wheel, base)
    try:
        digest = read_manifest(bundle_dir(spec)).digest
    except BundleError as exc:
        raise UserError(f"{exc}\nbuild it first: pkg build {spec.directory}") from exc
    root = Path(settings.bundle_root)
    token = _token(settings)
    url = f"http://127.0.0.1:{settings.port}"
    command = agent_command(spec, root, state_dir(spec).resolve() / "agent-token")
    return JetsonPlan(
        spec=spec, device=f"{host.machine}, {host.l4t_release}", bundle=bundle_dir(spec),
        bundle_digest=digest, agent_command=command, bundle_root=root,
        tensorrt_cache=root / "bundles" / f".{digest.removeprefix('sha256:')[:16]}-tensorrt-cache",
        url=url, token=token, wheel=wheel, base=base, state_dir=state_dir(spec), host=host,
        serving=_serving(url, token),
    )  # fmt: skip


def agent_command(spec: FunctionSpec, bundle_root: Path, token_file: Path) -> tuple[str, ...]:
    flags = server_flags(spec)
    at = flags.index("--providers")
    flags[at + 1] = ",".join(PROVIDERS)  # the spec's list is for the other targets; a Jetson has these
    return (
        sys.executable, "-m", "runtime", "agent", "--bundle-root", str(bundle_root), "--token-file", str(token_file),
        "--host", "0.0.0.0", "--port", str(spec.targets.jetson.port), *flags,
    )  # fmt: skip


def _token(settings: JetsonTarget) -> str:
    if settings.token_file:
        try:
            return Path(settings.token_file).read_text().strip()
        except OSError as exc:
            raise UserError(f"targets.jetson.token_file {settings.token_file}: {exc.strerror}", exit_code=2) from exc
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise UserError(f"no agent token: set targets.jetson.token_file or ${TOKEN_ENV}", exit_code=2)
    return token


def _serving(url: str, token: str) -> str | None:
    try:
        with AgentClient(url, DeviceAuth(token), timeout=3.0) as client:
            return str((client.status().get("current") or {}).get("digest", ""))
    except AgentError:
        return None


def apply(plan: JetsonPlan) -> JetsonDeployment:
    """Write the Docker context (with a wheel), start the agent unless it runs, push the bundle to it."""
    plan.state_dir.mkdir(parents=True, exist_ok=True)
    changed = sum(1 for row in plan.rows() if row[0] != "none")
    if plan.wheel is not None:
        write_jetson_context(plan.state_dir / "image", plan.spec, plan.bundle, plan.wheel, plan.base)
    log_file = plan.state_dir / "agent.log"
    previous = _load(plan.state_dir)
    pid = previous.pid if previous is not None and alive(previous.pid) else 0
    if plan.serving is None:
        token_file = Path(plan.agent_command[plan.agent_command.index("--token-file") + 1])
        token_file.unlink(missing_ok=True)
        os.close(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        token_file.write_text(plan.token + "\n")
        plan.bundle_root.mkdir(parents=True, exist_ok=True)
        with log_file.open("ab") as log:
            process = subprocess.Popen(plan.agent_command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        pid = process.pid
        _wait_up(plan, process)
    archive = archive_bundle(plan.bundle, build_dir(plan.spec) / "edge")
    [result] = push([plan.url], archive, DeviceAuth(plan.token), lambda *_: None, 8 << 20)
    if not result.ok:
        raise UserError(f"the agent on this Jetson refused the bundle ({result.outcome}): {result.detail}\n"
                        f"its log: {log_file}")  # fmt: skip
    deployment = JetsonDeployment(
        plan.spec.name, plan.url, plan.device, plan.host.hostname, result.digest, pid, str(log_file),
        changed, time.time(),
    )  # fmt: skip
    (plan.state_dir / "state.json").write_text(json.dumps(asdict(deployment), indent=2) + "\n")
    return deployment


def _wait_up(plan: JetsonPlan, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UserError(f"the agent exited with {process.returncode}; see {plan.state_dir / 'agent.log'}")
        if _serving(plan.url, plan.token) is not None:
            return
        time.sleep(0.5)
    raise UserError(f"the agent did not answer on {plan.url} within {READY_TIMEOUT:.0f} s")


def _load(directory: Path) -> JetsonDeployment | None:
    try:
        record = json.loads((directory / "state.json").read_text())
    except FileNotFoundError:
        return None
    # Records written before the device had its own fields kept it in AwsDeployment's `region` and `account`.
    record.setdefault("device", record.pop("region", ""))
    record.setdefault("hostname", record.pop("account", ""))
    return JetsonDeployment(**record)


def status(spec: FunctionSpec) -> TargetStatus | None:
    deployment = _load(state_dir(spec))
    if deployment is None:
        return None
    serving = _serving(deployment.url, _token(spec.targets.jetson))
    state = "ready" if serving == deployment.bundle_digest else ("unresponsive" if serving is None else "updating")
    detail = f"agent log: {deployment.log_file}" + (f"; serves {serving}" if serving else "")
    return TargetStatus(TARGET, deployment.url, deployment.bundle_digest, state, pid=deployment.pid, detail=detail,
                        deployment=deployment)  # fmt: skip


def destroy(spec: FunctionSpec) -> list[str] | None:
    """Stop the agent this target started; its bundle root (bundles, TensorRT caches) stays on the device."""
    deployment = _load(state_dir(spec))
    if deployment is None:
        return None
    if deployment.pid and alive(deployment.pid):
        terminate(deployment.pid, 30.0)
    (state_dir(spec) / "state.json").unlink(missing_ok=True)
    return [f"edge agent pid {deployment.pid} ({deployment.url})"]


class Jetson(Target):
    name = TARGET

    def plan(self, spec: FunctionSpec, progress: StepProgress) -> JetsonPlan:
        return plan(spec)

    def apply(self, plan: JetsonPlan, progress: StepProgress) -> JetsonDeployment:
        return apply(plan)

    def status(self, spec: FunctionSpec) -> TargetStatus | None:
        return status(spec)

    def destroy(self, spec: FunctionSpec) -> Removal | None:
        stopped = destroy(spec)
        if not stopped:
            return None
        kept = spec.targets.jetson.bundle_root
        return Removal(f"stopped {spec.name} on {TARGET}; bundles and TensorRT caches stay in {kept}", tuple(stopped))

    def http_endpoint(self, spec: FunctionSpec) -> HttpEndpoint:
        current = status(spec)
        if current is None:
            raise UserError(f"{spec.name} is not deployed; deploy it: pkg deploy {spec.directory} --target jetson")
        if current.state != "ready":
            raise UserError(f"the agent of {spec.name} is not serving (state: {current.state}); {current.detail}")
        return HttpEndpoint(current.url, {})  # the agent's /v1 has no key unless the agent was given one

    def logs(
        self, spec: FunctionSpec, *, follow: bool, since_seconds: float | None, tail: int | None
    ) -> Iterator[LogLine]:
        deployment = _load(state_dir(spec))
        log_file = Path(deployment.log_file) if deployment else state_dir(spec) / "agent.log"
        if not log_file.is_file():
            raise UserError(f"{spec.name} was never deployed here: pkg deploy {spec.directory} --target jetson")
        return file_lines(log_file, follow=follow, tail=tail)
