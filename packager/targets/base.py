"""The deploy target contract, the registry of targets, and the shapes every command renders.

A target is one class behind `Target` (the way httpx puts each transport behind `BaseTransport`):

    plan(spec, progress) -> Plan          what would change; nothing is touched
    apply(plan, progress) -> Deployment   make it so
    status(spec) -> TargetStatus | None   one row of `pkg status`; None when not deployed there
    destroy(spec) -> Removal | None       remove it; None when there was nothing
    http_endpoint(spec) -> HttpEndpoint   where clients reach it over HTTP (streaming); None: use `invoke`
    invoke(spec, path, body) -> dict      one non-streaming OpenAI request through the target's own door
    logs(spec, ...) -> Iterator[LogLine]  the deployment's log
    scaling(spec) -> (min, max)           how far the deployment scales
    emit_terraform(spec, out, progress)   the same resources as a Terraform root module
    emit_kubernetes(spec, out, progress)  the same deployment as Kubernetes manifests

A target that cannot do one of these raises the `UserError` of `refuse`, which says so and what to use
instead: a command never needs `if target == ...`, and never ends in a traceback. Targets load on first use
(`pkg deploy --target local` never imports boto3).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any, ClassVar, Protocol

from packager.errors import UserError
from packager.progress import StepProgress
from packager.spec import FunctionSpec

TARGET_CLASSES = {
    "local": "packager.targets.local.target:Local",
    "aws-lambda": "packager.targets.aws.targets:Lambda",
    "aws-sagemaker": "packager.targets.aws.targets:SageMaker",
    "greengrass": "packager.targets.greengrass.target:Greengrass",
    "jetson": "packager.targets.jetson:Jetson",
    "ray": "packager.targets.ray.target:Ray",
}
TARGETS = tuple(TARGET_CLASSES)
READY_TIMEOUT = 120.0  # seconds a deploy waits for its endpoint to serve (a first start compiles and loads)
STOP_TIMEOUT = 10.0  # seconds a destroy waits between SIGTERM and SIGKILL

PlanRow = tuple[str, str, str, str]  # (action: create|update|replace|delete|none, resource kind, name, what changes)


@dataclass(frozen=True)
class TargetStatus:
    """One row of `pkg status`; `state` is ready, starting, updating, failed, unresponsive, exited or missing."""

    target: str
    url: str
    bundle_digest: str
    state: str
    uptime_seconds: float | None = None
    pid: int | None = None
    detail: str = ""  # shown under the table when the state is not ready: where to look, what failed
    deployment: Any = None  # the target's own record of the deployment


@dataclass(frozen=True)
class LogLine:
    message: str
    timestamp: float | None = None  # epoch seconds, where the source records one
    stream: str = ""


class Plan(Protocol):
    """What `pkg deploy` shows before it changes anything."""

    @property
    def no_changes(self) -> bool: ...
    @property
    def where(self) -> str: ...  # the plan's title after "NAME on TARGET": a region, a device
    def rows(self) -> list[PlanRow]: ...


class Deployment(Protocol):
    """What `pkg deploy` shows after it changed something."""

    def summary(self) -> list[tuple[str, str]]: ...  # (label, value) rows
    def next_step(self, function_dir: Path) -> str: ...  # what to try now, one line


@dataclass(frozen=True)
class HttpEndpoint:
    url: str  # without /v1
    headers: dict[str, str]  # the Authorization header, when the endpoint has a key


@dataclass(frozen=True)
class Removal:
    """What `pkg destroy` removed: one line of summary, then one line per thing removed."""

    summary: str
    removed: tuple[str, ...] = ()


class Target(ABC):
    name: ClassVar[str]

    def __init__(self, *, ready_timeout: float = READY_TIMEOUT, stop_timeout: float = STOP_TIMEOUT) -> None:
        self.ready_timeout = ready_timeout  # how long `apply` waits for the endpoint, where it waits
        self.stop_timeout = stop_timeout  # how long `destroy` lets a process stop, where it stops one

    @abstractmethod
    def plan(self, spec: FunctionSpec, progress: StepProgress) -> Plan: ...

    @abstractmethod
    def apply(self, plan: Any, progress: StepProgress) -> Deployment: ...

    @abstractmethod
    def status(self, spec: FunctionSpec) -> TargetStatus | None: ...

    @abstractmethod
    def destroy(self, spec: FunctionSpec) -> Removal | None: ...

    def http_endpoint(self, spec: FunctionSpec) -> HttpEndpoint | None:
        return None

    def invoke(self, spec: FunctionSpec, path: str, body: dict[str, Any]) -> dict[str, Any]:
        raise self.refuse("invoke", "send requests to the device's own URL (`pkg status` shows it)")

    def logs(
        self, spec: FunctionSpec, *, follow: bool, since_seconds: float | None, tail: int | None
    ) -> Iterator[LogLine]:
        raise self.refuse("logs", "read the log where the target keeps it")

    def scaling(self, spec: FunctionSpec) -> tuple[int | str, int | str]:
        return 1, 1  # one server process or device

    def emit_terraform(self, spec: FunctionSpec, out: Path, progress: StepProgress) -> list[Path]:
        raise self.refuse("deploy --emit-terraform", "use --target aws-lambda or --target aws-sagemaker")

    def emit_kubernetes(self, spec: FunctionSpec, out: Path, progress: StepProgress) -> list[Path]:
        raise self.refuse("deploy --emit-kubernetes", "use --target ray (a KubeRay RayService)")

    def refuse(self, command: str, instead: str) -> UserError:
        return UserError(f"pkg {command} does not work with --target {self.name}: {instead}", exit_code=2)


def target(name: str, *, ready_timeout: float = READY_TIMEOUT, stop_timeout: float = STOP_TIMEOUT) -> Target:
    """The target registered as `name`, imported on first use."""
    try:
        module_name, class_name = TARGET_CLASSES[name].split(":")
    except KeyError:
        raise UserError(f"unknown target {name!r}; targets: {', '.join(TARGETS)}", exit_code=2) from None
    cls: type[Target] = getattr(import_module(module_name), class_name)
    return cls(ready_timeout=ready_timeout, stop_timeout=stop_timeout)
