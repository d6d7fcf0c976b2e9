"""The deploy target interface, the table of targets, and the row `pkg status` shows for each.

Every target is a module offering the same four functions: `plan(spec)` (what would change; nothing is
touched), `apply(plan)` (make it so), `status(spec)` (a `TargetStatus`, or None when not deployed there)
and `destroy(spec)` (remove it; None when there was nothing). Modules load on first use, so `pkg deploy
--target local` never imports boto3.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any, Protocol, cast

from packager.spec import FunctionSpec

TARGET_MODULES = {
    "local": "packager.deploy.local",
    "aws-lambda": "packager.deploy.aws_lambda",
    "aws-sagemaker": "packager.deploy.aws_sagemaker",
    "greengrass": "packager.deploy.greengrass",
    "jetson": "packager.deploy.jetson",
}
TARGETS = tuple(TARGET_MODULES)


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


class Target(Protocol):
    def plan(self, spec: FunctionSpec) -> Any: ...
    def apply(self, plan: Any) -> Any: ...
    def status(self, spec: FunctionSpec) -> TargetStatus | None: ...
    def destroy(self, spec: FunctionSpec) -> Any: ...


def target(name: str) -> Target:
    return cast(Target, import_module(TARGET_MODULES[name]))
