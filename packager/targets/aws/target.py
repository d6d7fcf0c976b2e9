"""What the AWS-hosted targets share behind the `Target` contract: an `AwsPlan` of resources to create or
update, an `AwsDeployment` record, destroy's list of deleted resources and the CloudWatch log group.

Each target keeps its steps as functions in its own module (`lambda_function`, `sagemaker`, `greengrass.target`);
its class names that module, which must offer the functions of `AwsTargetModule`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar, Protocol

from packager.progress import StepProgress
from packager.spec import FunctionSpec
from packager.targets.aws.common import AwsDeployment, AwsPlan
from packager.targets.aws.logs import deployment_log
from packager.targets.base import LogLine, Removal, Target, TargetStatus


class AwsTargetModule(Protocol):
    def state_dir(self, spec: FunctionSpec) -> Path: ...
    def plan(self, spec: FunctionSpec, *, progress: StepProgress | None = None) -> AwsPlan: ...
    def apply(self, plan: AwsPlan) -> AwsDeployment: ...
    def status(self, spec: FunctionSpec) -> TargetStatus | None: ...
    def destroy(self, spec: FunctionSpec) -> list[str] | None: ...


class AwsTarget(Target):
    steps: ClassVar[AwsTargetModule]

    def plan(self, spec: FunctionSpec, progress: StepProgress) -> AwsPlan:
        return self.steps.plan(spec, progress=progress)

    def apply(self, plan: AwsPlan, progress: StepProgress) -> AwsDeployment:
        return self.steps.apply(plan)

    def status(self, spec: FunctionSpec) -> TargetStatus | None:
        return self.steps.status(spec)

    def destroy(self, spec: FunctionSpec) -> Removal | None:
        deleted = self.steps.destroy(spec)
        if not deleted:
            return None
        return Removal(f"destroyed {spec.name} on {self.name}: deleted {len(deleted)} resources", tuple(deleted))

    def logs(
        self, spec: FunctionSpec, *, follow: bool, since_seconds: float | None, tail: int | None
    ) -> Iterator[LogLine]:
        return deployment_log(
            spec, self.name, self.steps.state_dir(spec), follow=follow, since_seconds=since_seconds, tail=tail
        )
