"""The AWS Lambda and SageMaker targets: their steps (`lambda_function`, `sagemaker`) behind the `Target`
contract, and both as a Terraform root module (`terraform`, which reads the same resource lists)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from packager.progress import StepProgress
from packager.spec import FunctionSpec
from packager.targets.aws import lambda_function, sagemaker
from packager.targets.aws.target import AwsTarget, AwsTargetModule
from packager.targets.aws.terraform import emit_root_module


class _Terraformed(AwsTarget):
    def emit_terraform(self, spec: FunctionSpec, out: Path, progress: StepProgress) -> list[Path]:
        return emit_root_module(spec, self.name, out, progress=progress)


class Lambda(_Terraformed):
    name = lambda_function.TARGET
    steps: ClassVar[AwsTargetModule] = lambda_function

    def invoke(self, spec: FunctionSpec, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return lambda_function.invoke(spec, path, body)

    def scaling(self, spec: FunctionSpec) -> tuple[int | str, int | str]:
        settings = spec.targets.aws_lambda
        ceiling = settings.reserved_concurrency
        return settings.provisioned_concurrency, "account" if ceiling is None else ceiling


class SageMaker(_Terraformed):
    name = sagemaker.TARGET
    steps: ClassVar[AwsTargetModule] = sagemaker

    def invoke(self, spec: FunctionSpec, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return sagemaker.invoke(spec, path, body)

    def scaling(self, spec: FunctionSpec) -> tuple[int | str, int | str]:
        return spec.targets.aws_sagemaker.min_instances, spec.targets.aws_sagemaker.max_instances
