"""What the AWS targets share behind the `Target` contract: an `AwsPlan` of resources to create or update,
an `AwsDeployment` record, destroy's list of deleted resources, the CloudWatch log group and Terraform."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from packager.progress import StepProgress
from packager.spec import FunctionSpec
from packager.targets.aws.common import AwsDeployment, AwsPlan
from packager.targets.aws.logs import deployment_log
from packager.targets.base import LogLine, Removal, Target


class AwsTarget(Target):
    @abstractmethod
    def state_dir(self, spec: FunctionSpec) -> Path: ...

    @abstractmethod
    def plan(self, spec: FunctionSpec, progress: StepProgress) -> AwsPlan: ...

    @abstractmethod
    def apply(self, plan: AwsPlan, progress: StepProgress) -> AwsDeployment: ...

    @abstractmethod
    def delete(self, spec: FunctionSpec) -> list[str] | None: ...

    @abstractmethod
    def invoke(self, spec: FunctionSpec, path: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def destroy(self, spec: FunctionSpec) -> Removal | None:
        deleted = self.delete(spec)
        if not deleted:
            return None
        return Removal(f"destroyed {spec.name} on {self.name}: deleted {len(deleted)} resources", tuple(deleted))

    def logs(
        self, spec: FunctionSpec, *, follow: bool, since_seconds: float | None, tail: int | None
    ) -> Iterator[LogLine]:
        return deployment_log(
            spec, self.name, self.state_dir(spec), follow=follow, since_seconds=since_seconds, tail=tail
        )

    def emit_terraform(self, spec: FunctionSpec, out: Path, progress: StepProgress) -> list[Path]:
        from packager.targets.aws.terraform import emit_root_module  # it imports both AWS targets' modules

        return emit_root_module(spec, self.name, out, progress=progress)
