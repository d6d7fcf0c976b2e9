"""`pkg deploy --emit-terraform DIR`: a Terraform root module calling `infra/terraform/modules/` with the values
`pkg deploy` would use, taken from the same deploy plan resources, so both paths create the same things.

The root is written as `terraform fmt` would write it (no Terraform is needed to emit it). Values that depend
on the account (bucket name, ARNs) become expressions over `data.aws_caller_identity`; `aws_endpoint_url`
points every provider endpoint at a local AWS stand-in. `WIRING` names, for each module input, the resource
argument it sets: the tests check the modules against it and the inputs against what `pkg deploy` created.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from packager.paths import bundle_dir
from packager.progress import StepProgress
from packager.spec import FunctionSpec
from packager.targets.aws import lambda_function as aws_lambda
from packager.targets.aws import neuron
from packager.targets.aws import sagemaker as aws_sagemaker
from packager.targets.aws.common import AwsContext, Resource, resolve_region
from packager.targets.aws.resources import bundle_digest, function_image
from runtime.bundle import MANIFEST_NAME, read_manifest

MODULES_DIR = Path(__file__).resolve().parents[3] / "infra" / "terraform" / "modules"
ACCOUNT = "000000000000"  # stands for the account while planning offline; 12 digits like the real one
ACCOUNT_EXPRESSION = "${data.aws_caller_identity.current.account_id}"
ENDPOINT_SERVICES = ("applicationautoscaling", "cloudwatch", "ecr", "iam", "lambda", "logs", "s3", "sagemaker",
                     "sqs", "sts")  # fmt: skip
SSE_S3_REASON = "AES256 (SSE-S3) encrypts at rest, as the bucket's default does."
WIRING: dict[str, dict[str, str]] = {
    "lambda_function": {
        "memory_mb": "aws_lambda_function.this.memory_size",
        "timeout_seconds": "aws_lambda_function.this.timeout",
        "architecture": "aws_lambda_function.this.architectures",
        "ephemeral_storage_mb": "aws_lambda_function.this.ephemeral_storage.size",
        "environment": "aws_lambda_function.this.environment.variables",
        "reserved_concurrency": "aws_lambda_function.this.reserved_concurrent_executions",
        "image_uri": "aws_lambda_function.this.image_uri",
        "package_type": "aws_lambda_function.this.package_type",
        "code_bucket": "aws_lambda_function.this.s3_bucket",
        "code_key": "aws_lambda_function.this.s3_key",
        "code_hash": "aws_lambda_function.this.source_code_hash",
        "runtime": "aws_lambda_function.this.runtime",
        "handler": "aws_lambda_function.this.handler",
        "snapstart": "aws_lambda_function.this.dynamic",  # dynamic "snap_start"
        "url_auth": "aws_lambda_function_url.this.authorization_type",
        "batch_size": "aws_lambda_event_source_mapping.requests.batch_size",
        "batch_window_seconds": "aws_lambda_event_source_mapping.requests.maximum_batching_window_in_seconds",
        "max_concurrency": "aws_lambda_event_source_mapping.requests.dynamic",  # dynamic "scaling_config"
        "max_receive_count": "aws_sqs_queue.requests.redrive_policy",
        "provisioned_concurrency": "aws_lambda_provisioned_concurrency_config.this.provisioned_concurrent_executions",
        "log_retention_days": "aws_cloudwatch_log_group.this.retention_in_days",
        "tags": "aws_lambda_function.this.tags",
    },
    "sagemaker_endpoint": {
        "image_uri": "aws_sagemaker_model.this.primary_container.image",
        "model_data_url": "aws_sagemaker_model.this.primary_container.model_data_url",
        "environment": "aws_sagemaker_model.this.primary_container.environment",
        "instance_type": "aws_sagemaker_endpoint_configuration.this.production_variants.instance_type",
        "startup_timeout_seconds": "aws_sagemaker_endpoint_configuration.this.production_variants."
        "container_startup_health_check_timeout_in_seconds",
        "max_concurrent_invocations": "aws_sagemaker_endpoint_configuration.this.dynamic",  # async_inference_config
        "min_instances": "aws_appautoscaling_target.this.min_capacity",
        "max_instances": "aws_appautoscaling_target.this.max_capacity",
        "scaling_target": "aws_appautoscaling_policy.tracking.target_tracking_scaling_policy_configuration",
        "scale_in_cooldown_seconds": "aws_appautoscaling_policy.tracking.target_tracking_scaling_policy_configuration",
        "log_retention_days": "aws_cloudwatch_log_group.this.retention_in_days",
        "tags": "aws_sagemaker_endpoint.this.tags",
    },
}


class Expr(str):
    """A Terraform expression, written as it is (a plain `str` is written as a quoted string)."""


def emit_root_module(spec: FunctionSpec, target: str, out: Path, *, progress: StepProgress) -> list[Path]:
    """Write `main.tf` for `target` into `out`; returns the files written."""
    region = _region(spec, target)
    context = AwsContext(None, region, None, ACCOUNT, _partition(region), target)
    if target == "aws-lambda":
        blocks = _lambda_blocks(spec, context, out, progress)
    else:
        blocks = _sagemaker_blocks(spec, context, out, progress)
    out.mkdir(parents=True, exist_ok=True)
    zipped = target == "aws-lambda" and aws_lambda.choose_package(spec.targets.aws_lambda)[0] == "zip"
    first = "The zip and the bundle upload with it." if zipped else "Push the image first: pkg image push."
    header = (f"# Written by `pkg deploy --emit-terraform` for {spec.name} on {target}: the resources and settings\n"
              f"# `pkg deploy --target {target}` creates. {first}\n")  # fmt: skip
    main = out / "main.tf"
    main.write_text(header + "\n" + "\n".join(_preamble(region) + blocks))
    return [main]


def _region(spec: FunctionSpec, target: str) -> str:
    settings = spec.targets.aws_lambda if target == "aws-lambda" else spec.targets.aws_sagemaker
    return resolve_region(settings.region, target)[0]


def _partition(region: str) -> str:
    if region.startswith("cn-"):
        return "aws-cn"
    return "aws-us-gov" if region.startswith("us-gov-") else "aws"


def _preamble(region: str) -> list[str]:
    required = ('terraform {\n  required_version = ">= 1.5"\n  required_providers {\n    aws = {\n'
                '      source  = "hashicorp/aws"\n      version = ">= 5.40"\n    }\n  }\n}\n')  # fmt: skip
    variable = block('variable "aws_endpoint_url"', [
        ("description", "Every AWS call goes here when set (a local AWS endpoint); null for AWS itself."),
        ("type", Expr("string")), ("default", None),
    ])  # fmt: skip
    endpoints = block("endpoints", [(name, Expr("var.aws_endpoint_url")) for name in ENDPOINT_SERVICES], indent=1)
    provider = f'provider "aws" {{\n  region = {value(region)}\n\n{endpoints}}}\n'
    return [required, variable, provider, 'data "aws_caller_identity" "current" {}\n']


def _lambda_blocks(spec: FunctionSpec, context: AwsContext, out: Path, progress: StepProgress) -> list[str]:
    names = aws_lambda.Names.of(spec.name, context)
    aws_lambda.check_settings(spec.targets.aws_lambda)
    aws_lambda.check_size(spec)
    if aws_lambda.choose_package(spec.targets.aws_lambda)[0] == "zip":
        return _lambda_zip_blocks(spec, context, names, out, progress)
    platform = aws_lambda.PLATFORMS[spec.targets.aws_lambda.architecture]
    _, digest = function_image(spec, platform, aws_lambda.state_dir(spec), progress)
    listed = aws_lambda.resources(spec, context, names, f"{names.repository}@{digest}", bundle_digest(spec))
    function_arn = context.arn("lambda", f"function:{names.function}")
    package = [("image_uri", Expr(f'"${{module.ecr.repository_url}}@{digest}"'))]
    inputs, tags = _lambda_inputs(spec, names, listed, package)
    return [
        _tags_locals(tags),
        _module("bucket", out, "s3_bundle_store", [("name", _account(names.bucket)), ("tags", Expr("local.tags"))]),
        _module(
            "ecr",
            out,
            "ecr",
            [
                ("name", names.repository),
                ("pull_service", "lambda.amazonaws.com"),
                ("pull_source_arn", _account(function_arn)),
                ("tags", Expr("local.tags")),
            ],
        ),
        _module("function", out, "lambda_function", inputs),
    ]


def _lambda_zip_blocks(
    spec: FunctionSpec, context: AwsContext, names: aws_lambda.Names, out: Path, progress: StepProgress
) -> list[str]:
    """The zip package: the zip and the bundle's files as S3 objects in the function's bucket, the function from
    the zip with SnapStart as `pkg deploy` creates it."""
    digest = bundle_digest(spec)
    zipped = aws_lambda.zip_package(spec, progress)
    code = aws_lambda.zip_code(zipped, digest)
    listed = aws_lambda.resources(spec, context, names, "", digest, code=code)
    function = _named(listed, names.function).settings
    package: list[tuple[str, Any]] = [
        ("package_type", "Zip"), ("code_bucket", Expr("module.bucket.bucket")),
        ("code_key", Expr("aws_s3_object.code.key")), ("code_hash", function["code_sha256"]),
        ("runtime", function["runtime"]), ("handler", function["handler"]),
        ("snapstart", function["snapstart"] == "PublishedVersions"),
    ]  # fmt: skip
    inputs, tags = _lambda_inputs(spec, names, listed, package)
    bundle = bundle_dir(spec)
    files = {f"{code.bundle_prefix}{name}": str((bundle / name).resolve()) for name in read_manifest(bundle).files}
    files[f"{code.bundle_prefix}{MANIFEST_NAME}"] = str((bundle / MANIFEST_NAME).resolve())
    objects = [
        block('resource "aws_s3_object" "code"', [
            ("bucket", Expr("module.bucket.bucket")), ("key", code.code_key), ("source", str(zipped.path)),
            ("source_hash", zipped.sha256),
        ]),
        block('resource "aws_s3_object" "bundle"', [
            ("for_each", files), ("bucket", Expr("module.bucket.bucket")), ("key", Expr("each.key")),
            ("source", Expr("each.value")),
        ], comments=["# The bundle, content-addressed by its digest: the handler fetches it in the init phase."]),
    ]  # fmt: skip
    uploaded = ("depends_on", [Expr("aws_s3_object.bundle")])  # the init phase fetches it
    function_module = _module("function", out, "lambda_function", [*inputs, uploaded])
    return [
        _tags_locals(tags),
        _module("bucket", out, "s3_bundle_store", [("name", _account(names.bucket)), ("tags", Expr("local.tags"))]),
        *objects,
        function_module,
    ]


def _lambda_inputs(
    spec: FunctionSpec, names: aws_lambda.Names, listed: list[Resource], package: list[tuple[str, Any]]
) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """The lambda_function module's inputs (`package`: the image's or the zip's) and the tags."""
    found = {r.kind: r for r in listed if r.kind != "sqs-queue"} | {"sqs-queue": _named(listed, names.queue)}
    function, settings = found["lambda-function"].settings, spec.targets.aws_lambda
    inputs: list[tuple[str, Any]] = [
        ("function_name", names.function), *package,
        ("architecture", function["architecture"]), ("memory_mb", function["memory_mb"]),
        ("timeout_seconds", function["timeout_seconds"]), ("ephemeral_storage_mb", function["ephemeral_storage_mb"]),
        ("reserved_concurrency", function["reserved_concurrency"]),
        ("provisioned_concurrency", settings.provisioned_concurrency),
        ("url_auth", found["lambda-url"].settings["auth_type"]),
        ("batch_size", found["event-source"].settings["batch_size"]),
        ("batch_window_seconds", found["event-source"].settings["batch_window_seconds"]),
        ("max_concurrency", found["event-source"].settings["max_concurrency"]),
        ("max_receive_count", found["sqs-queue"].settings["redrive"]["maxReceiveCount"]),
        ("log_retention_days", found["log-group"].settings["retention_days"]),
        ("bucket_arn", Expr("module.bucket.bucket_arn")), ("tags", Expr("local.tags")),
        ("environment", {k: _account(v) for k, v in function["environment"].items()}),
    ]  # fmt: skip
    return inputs, function["tags"]


def _sagemaker_blocks(spec: FunctionSpec, context: AwsContext, out: Path, progress: StepProgress) -> list[str]:
    settings = spec.targets.aws_sagemaker
    aws_sagemaker.check_settings(spec)
    artifact = neuron.build_artifact(spec, progress) if aws_sagemaker.is_inferentia(settings.instance_type) else None
    names = aws_sagemaker.Names.of(spec.name, context)
    _, digest = function_image(spec, "linux/amd64", aws_sagemaker.state_dir(spec), progress)
    artifact_sha = artifact.sha256 if artifact else None
    listed = aws_sagemaker.resources(
        spec, context, names, f"{names.repository}@{digest}", bundle_digest(spec), artifact_sha
    )
    found = {r.kind: r for r in listed if r.kind != "scaling-policy"}
    model, config = found["sagemaker-model"].settings, found["endpoint-config"].settings
    tracking = next(r for r in listed if r.kind == "scaling-policy" and r.settings["type"] == "TargetTrackingScaling")
    inputs: list[tuple[str, Any]] = [
        ("function_name", spec.name), ("endpoint_name", names.endpoint),
        ("image_uri", Expr(f'"${{module.ecr.repository_url}}@{digest}"')),
        ("repository_arn", Expr("module.ecr.repository_arn")),
        ("model_data_url", _account(model["model_data_url"]) if model["model_data_url"] else None),
        ("instance_type", config["instance_type"]), ("mode", settings.mode),
        ("min_instances", found["scalable-target"].settings["min"]),
        ("max_instances", found["scalable-target"].settings["max"]),
        ("scaling_metric", settings.scaling_metric),
        ("scaling_target", tracking.settings["configuration"]["TargetValue"]),
        ("scale_in_cooldown_seconds", tracking.settings["configuration"]["ScaleInCooldown"]),
        ("scale_out_cooldown_seconds", tracking.settings["configuration"]["ScaleOutCooldown"]),
        ("max_concurrent_invocations", settings.max_concurrent_invocations),
        ("startup_timeout_seconds", config["startup_timeout"]),
        ("log_retention_days", found["log-group"].settings["retention_days"]),
        ("bucket", Expr("module.bucket.bucket")), ("bucket_arn", Expr("module.bucket.bucket_arn")),
        ("tags", Expr("local.tags")), ("environment", model["environment"]),
    ]  # fmt: skip
    blocks = [
        _tags_locals(found["endpoint"].settings["tags"]),
        _module("bucket", out, "s3_bundle_store", [("name", _account(names.bucket)), ("tags", Expr("local.tags"))]),
        _module("ecr", out, "ecr", [("name", names.repository), ("tags", Expr("local.tags"))]),
        _module("endpoint", out, "sagemaker_endpoint", inputs),
    ]
    if artifact is not None:
        key = model["model_data_url"].split("/", 3)[3]
        blocks.append(block('resource "aws_s3_object" "neuron_model"', [
            ("bucket", Expr("module.bucket.bucket")), ("key", key), ("source", str(artifact.archive.resolve())),
            ("server_side_encryption", "AES256"), ("metadata", {"sha256": artifact.sha256}),
        ], comments=[f"#checkov:skip=CKV_AWS_186:{SSE_S3_REASON}"]))  # fmt: skip
    return blocks


def _named(listed: list[Resource], name: str) -> Resource:
    return next(r for r in listed if r.name == name)


def _account(text: str) -> Any:
    """A value naming the offline account (a bucket, an ARN) as an expression over the real one."""
    if ACCOUNT not in text:
        return text
    return Expr(json.dumps(text).replace(ACCOUNT, ACCOUNT_EXPRESSION))


def _tags_locals(tags: dict[str, str]) -> str:
    return f"locals {{\n  tags = {value(tags, indent=1)}\n}}\n"


def _module(name: str, out: Path, module: str, inputs: list[tuple[str, Any]]) -> str:
    source = os.path.relpath(MODULES_DIR / module, out.resolve())
    return block(f'module "{name}"', [("source", source), *inputs])


def block(header: str, attributes: list[tuple[str, Any]], *, indent: int = 0, comments: Sequence[str] = ()) -> str:
    """A block as `terraform fmt` writes it: `=` aligned across adjacent one-line attributes, a blank line
    around each multi-line one (which ends the alignment group)."""
    pad = "  " * indent
    lines = [f"{pad}{header} {{"] + [f"{pad}  {c}" for c in comments]
    group: list[tuple[str, str]] = []

    def flush() -> None:
        width = max((len(k) for k, _ in group), default=0)
        lines.extend(f"{pad}  {k.ljust(width)} = {v}" for k, v in group)
        group.clear()

    for key, raw in attributes:
        rendered = value(raw, indent=indent + 1)
        if "\n" in rendered:
            flush()
            if lines[-1] != "" and not lines[-1].endswith("{"):
                lines.append("")
            lines.append(f"{pad}  {key} = {rendered}")
            lines.append("")
        else:
            group.append((key, rendered))
    flush()
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + f"\n{pad}}}\n"


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def value(item: Any, *, indent: int = 0) -> str:
    """One HCL value: strings quoted (with `${` escaped), maps one key per line, lists inline."""
    if isinstance(item, Expr):
        return str(item)
    if item is None:
        return "null"
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, int | float):
        return repr(item)
    if isinstance(item, str):
        return json.dumps(item).replace("${", "$${").replace("%{", "%%{")
    if isinstance(item, list):
        return "[" + ", ".join(value(v, indent=indent) for v in item) + "]"
    if isinstance(item, dict):
        if not item:
            return "{}"
        pad = "  " * indent
        keys = {k: (k if _IDENTIFIER.fullmatch(k) else json.dumps(k)) for k in item}
        width = max(len(k) for k in keys.values())
        body = [f"{pad}  {keys[k].ljust(width)} = {value(v, indent=indent + 1)}" for k, v in sorted(item.items())]
        return "{\n" + "\n".join(body) + f"\n{pad}}}"
    raise TypeError(f"no HCL form for {item!r}")
