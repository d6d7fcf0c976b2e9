"""The `aws-sagemaker` target: a SageMaker endpoint on a GPU (ml.g5 / ml.g6 / ml.g6e) or Inferentia2 (ml.inf2)
instance type, scaled by Application Auto Scaling between the spec's min and max instances.

Resources, in creation order (names from the endpoint name `E`, the function name):
  s3-bucket `onnxfn-E-sagemaker-ACCOUNT-REGION` (async requests and replies, the Neuron artifact),
  log-group `/aws/sagemaker/Endpoints/E`, ecr-repository `onnxfn/E/aws-sagemaker`, ecr-image,
  iam-role `onnxfn-E-sagemaker`, model-artifact (ml.inf2 only), sagemaker-model `E-DIGEST`,
  endpoint-config `E-DIGEST`, endpoint `E`, scalable-target, scaling-policy `E-METRIC` (target tracking);
  with `min_instances = 0` (async only) also scaling-policy `E-wake-from-zero` and alarm
  `E-backlog-without-capacity`, which start an instance when requests wait and none runs.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from packager.errors import UserError
from packager.paths import build_dir
from packager.progress import StepProgress
from packager.spec import FunctionSpec
from packager.targets.aws import common as aws
from packager.targets.aws import neuron
from packager.targets.aws.common import AwsContext, AwsDeployment, AwsPlan, Driver, Resource
from packager.targets.aws.resources import (
    BucketDriver,
    ImageDriver,
    LogGroupDriver,
    RepositoryDriver,
    RoleDriver,
    bucket_name,
    bucket_resource,
    bundle_digest,
    function_image,
    image_registry,
    repository_resource,
)
from packager.targets.aws.sagemaker_drivers import (
    PREDEFINED_METRICS,
    VARIANT,
    AlarmDriver,
    ArtifactDriver,
    EndpointConfigDriver,
    EndpointDriver,
    ModelDriver,
    ScalableTargetDriver,
    ScalingPolicyDriver,
)
from packager.targets.base import TargetStatus

TARGET = "aws-sagemaker"
ASYNC_RESULT_TIMEOUT = 300.0


@dataclass(frozen=True)
class Names:
    endpoint: str
    repository: str
    role: str
    bucket: str
    log_group: str
    scaling_resource: str

    @classmethod
    def of(cls, function: str, context: AwsContext) -> Names:
        endpoint = function.replace("_", "-")
        return cls(
            endpoint=endpoint, repository=f"onnxfn/{function}/{TARGET}", role=f"onnxfn-{function}-sagemaker",
            bucket=bucket_name(function, TARGET, context), log_group=f"/aws/sagemaker/Endpoints/{endpoint}",
            scaling_resource=f"endpoint/{endpoint}/variant/{VARIANT}",
        )  # fmt: skip


def state_dir(spec: FunctionSpec) -> Path:
    return build_dir(spec) / TARGET


def is_inferentia(instance_type: str) -> bool:
    return instance_type.startswith("ml.inf2.")


def check_settings(spec: FunctionSpec) -> None:
    settings, section = spec.targets.aws_sagemaker, f"targets.{TARGET}"
    problems = []
    if settings.min_instances > settings.max_instances:
        problems.append(f"{section}.min_instances = {settings.min_instances} exceeds max_instances = "
                        f"{settings.max_instances}")  # fmt: skip
    if settings.min_instances == 0 and settings.mode != "async":
        problems.append(f'{section}.min_instances = 0 (scale to zero) needs mode = "async": a real-time endpoint '
                        "keeps at least one instance")  # fmt: skip
    if settings.scaling_metric == "backlog" and settings.mode != "async":
        problems.append(f'{section}.scaling_metric = "backlog" needs mode = "async" (only async endpoints queue)')
    gpu_providers = {"cuda", "tensorrt"} & set(spec.runtime.providers)
    if not is_inferentia(settings.instance_type) and not gpu_providers:
        problems.append(
            f"{section}.instance_type = {settings.instance_type!r} has a GPU, but runtime.providers = "
            f'{spec.runtime.providers}: add "cuda" (and "tensorrt" first for TensorRT) so the engine uses it'
        )
    if problems:
        raise UserError("\n".join(problems), exit_code=2)


def drivers(
    image: ImageDriver | None = None, artifact: Path | None = None, tags: dict[str, str] | None = None
) -> dict[str, Driver]:
    table: dict[str, Driver] = {
        "s3-bucket": BucketDriver(), "log-group": LogGroupDriver(), "ecr-repository": RepositoryDriver(),
        "iam-role": RoleDriver(), "model-artifact": ArtifactDriver(artifact), "sagemaker-model": ModelDriver(),
        "endpoint-config": EndpointConfigDriver(), "endpoint": EndpointDriver(),
        "scalable-target": ScalableTargetDriver(tags), "scaling-policy": ScalingPolicyDriver(), "alarm": AlarmDriver(),
    }  # fmt: skip
    if image is not None:
        table["ecr-image"] = image
    return table


def plan(spec: FunctionSpec, *, progress: StepProgress | None = None) -> AwsPlan:
    settings = spec.targets.aws_sagemaker
    check_settings(spec)
    progress = progress or StepProgress()
    digest = bundle_digest(spec)
    artifact = neuron.build_artifact(spec, progress) if is_inferentia(settings.instance_type) else None
    context = aws.connect(TARGET, settings.region, settings.endpoint_url)
    names = Names.of(spec.name, context)
    layout, manifest_digest = function_image(spec, "linux/amd64", state_dir(spec), progress)
    repository_uri, registry = image_registry(context, names.repository, tag=manifest_digest[7:23])
    artifact_sha = artifact.sha256 if artifact else None
    desired = resources(spec, context, names, f"{repository_uri}@{manifest_digest}", digest, artifact_sha)
    tags = aws.tags(spec.name, digest, TARGET)
    table = drivers(ImageDriver(layout, registry), artifact.archive if artifact else None, tags)
    previous = aws.load_state(state_dir(spec))
    wanted = {(r.kind, r.name) for r in desired}
    removals = tuple(
        Resource(kind, name, {})
        for kind, name in (previous.resources if previous else [])
        if (kind, name) not in wanted and kind not in ("ecr-image", "model-artifact")
    )
    return AwsPlan(
        target=TARGET, function=spec.name, context=context, changes=aws.plan_changes(context, table, desired),
        removals=removals, state_dir=state_dir(spec), bundle_digest=digest, url=_invocation_url(context, names),
        drivers=table,
    )  # fmt: skip


def resources(
    spec: FunctionSpec, context: AwsContext, names: Names, image_uri: str, digest: str, artifact_sha: str | None
) -> list[Resource]:
    settings = spec.targets.aws_sagemaker
    tags = aws.tags(spec.name, digest, TARGET)
    manifest_digest = image_uri.rpartition("@")[2]
    listed = [
        bucket_resource(names.bucket, tags),
        Resource("log-group", names.log_group, {"retention_days": settings.log_retention_days, "tags": tags}),
        repository_resource(names.repository, None, tags),
        Resource("ecr-image", f"{names.repository}@{manifest_digest}", {"digest": manifest_digest}),
        Resource(
            "iam-role",
            names.role,
            {
                "trust": aws.trust_policy("sagemaker.amazonaws.com"),
                "policy": role_policy(context, names),
                "tags": tags,
            },
        ),
    ]
    model_data_url = None
    environment: dict[str, str] = {}
    if artifact_sha is not None:
        model_data_url = f"s3://{names.bucket}/neuron/{artifact_sha[:16]}/model.tar.gz"
        listed.append(Resource("model-artifact", model_data_url, {"sha256": artifact_sha}))
        # SageMaker unpacks the artifact into /opt/ml/model; the Neuron runtime reads its core count here.
        environment = {"ONNXFN_BACKEND": "neuron", "ONNXFN_NEURON_MODEL_DIR": "/opt/ml/model",
                       "NEURON_RT_NUM_CORES": str(settings.neuron.num_cores)}  # fmt: skip
    model = {
        "image": image_uri, "role": context.arn("iam", f"role/{names.role}", regional=False),
        "environment": environment, "model_data_url": model_data_url,
    }  # fmt: skip
    model_name = f"{names.endpoint}-{_digest(model)}"
    asynchronous = None
    if settings.mode == "async":
        asynchronous = {"output": f"s3://{names.bucket}/async-out/", "failure": f"s3://{names.bucket}/async-failures/",
                        "max_concurrent": settings.max_concurrent_invocations}  # fmt: skip
    config = {
        "model": model_name, "instance_type": settings.instance_type,
        "initial_instances": max(1, settings.min_instances),  # SageMaker starts with at least one
        "startup_timeout": settings.startup_timeout_seconds, "async": asynchronous,
    }  # fmt: skip
    config_name = f"{names.endpoint}-{_digest(config)}"
    listed += [
        Resource("sagemaker-model", model_name, {**model, "tags": tags}),
        Resource("endpoint-config", config_name, {**config, "tags": tags}),
        Resource("endpoint", names.endpoint, {"config": config_name, "tags": tags}),
        Resource(
            "scalable-target", names.scaling_resource, {"min": settings.min_instances, "max": settings.max_instances}
        ),
        Resource(
            "scaling-policy",
            f"{names.endpoint}-{settings.scaling_metric}",
            {
                "resource_id": names.scaling_resource,
                "type": "TargetTrackingScaling",
                "configuration": tracking_configuration(spec, names.endpoint),
            },
        ),
    ]
    if settings.mode == "async" and settings.min_instances == 0:
        wake = f"{names.endpoint}-wake-from-zero"
        listed += [
            Resource("scaling-policy", wake, {
                "resource_id": names.scaling_resource, "type": "StepScaling",
                "configuration": {
                    "AdjustmentType": "ChangeInCapacity", "MetricAggregationType": "Average",
                    "Cooldown": settings.scale_out_cooldown_seconds,
                    "StepAdjustments": [{"MetricIntervalLowerBound": 0.0, "ScalingAdjustment": 1}],
                },
            }),
            Resource("alarm", f"{names.endpoint}-backlog-without-capacity", {
                "metric": "HasBacklogWithoutCapacity", "endpoint": names.endpoint, "threshold": 1.0, "periods": 1,
                "policy": wake, "resource_id": names.scaling_resource, "tags": tags,
            }),
        ]  # fmt: skip
    return listed


def tracking_configuration(spec: FunctionSpec, endpoint: str) -> dict[str, Any]:
    settings = spec.targets.aws_sagemaker
    configuration: dict[str, Any] = {
        "TargetValue": settings.scaling_target,
        "ScaleInCooldown": settings.scale_in_cooldown_seconds,
        "ScaleOutCooldown": settings.scale_out_cooldown_seconds,
    }
    if settings.scaling_metric == "backlog":
        configuration["CustomizedMetricSpecification"] = {
            "MetricName": "ApproximateBacklogSizePerInstance", "Namespace": "AWS/SageMaker",
            "Dimensions": [{"Name": "EndpointName", "Value": endpoint}], "Statistic": "Average",
        }  # fmt: skip
    else:
        configuration["PredefinedMetricSpecification"] = {
            "PredefinedMetricType": PREDEFINED_METRICS[settings.scaling_metric]
        }
    return configuration


def role_policy(context: AwsContext, names: Names) -> dict[str, Any]:
    """What the endpoint's container does: pull its image, write its logs, read requests and write replies."""
    bucket = context.arn("s3", names.bucket, regional=False)
    return aws.policy(
        # AWS offers no resource-level permission for this one action: it can only be granted on "*".
        {"Sid": "EcrLoginHasNoResourceLevelPermissions", "Action": ["ecr:GetAuthorizationToken"], "Resource": "*"},
        {"Sid": "PullImage", "Action": ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage",
                                        "ecr:GetDownloadUrlForLayer"],
         "Resource": context.arn("ecr", f"repository/{names.repository}")},
        {"Sid": "Logs", "Action": ["logs:CreateLogStream", "logs:DescribeLogStreams", "logs:PutLogEvents"],
         "Resource": context.arn("logs", f"log-group:{names.log_group}:*")},
        {"Sid": "ReadRequestsAndModel", "Action": ["s3:GetObject"],
         "Resource": [f"{bucket}/async-in/*", f"{bucket}/neuron/*"]},
        {"Sid": "WriteReplies", "Action": ["s3:PutObject"],
         "Resource": [f"{bucket}/async-out/*", f"{bucket}/async-failures/*"]},
    )  # fmt: skip


def _digest(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def _invocation_url(context: AwsContext, names: Names) -> str:
    return f"https://runtime.sagemaker.{context.region}.{context.dns_suffix}/endpoints/{names.endpoint}/invocations"


def apply(plan: AwsPlan) -> AwsDeployment:
    return aws.apply_plan(plan)


def status(spec: FunctionSpec) -> TargetStatus | None:
    deployment = aws.load_state(state_dir(spec))
    if deployment is None:
        return None
    context = aws.connect(TARGET, deployment.region, deployment.endpoint_url)
    names = Names.of(spec.name, context)
    row = partial(
        TargetStatus, target=TARGET, url=deployment.url, bundle_digest=deployment.bundle_digest, deployment=deployment
    )
    if deployment.outcome == "failed":
        return row(state="failed", detail=f"the last deploy stopped at: {deployment.failed_step}")
    client = context.client("sagemaker")
    with aws.aws_errors(context, f"read SageMaker endpoint {names.endpoint}"):
        endpoint = aws.if_exists(
            lambda: client.describe_endpoint(EndpointName=names.endpoint), lambda exc: "Could not find" in str(exc)
        )
        if endpoint is None:
            return row(state="missing", detail="the endpoint no longer exists in AWS; deploy again")
    state = {"InService": "ready", "Creating": "starting", "Updating": "updating", "SystemUpdating": "updating",
             "Failed": "failed"}.get(endpoint["EndpointStatus"], "unresponsive")  # fmt: skip
    variants = endpoint.get("ProductionVariants") or [{}]
    settings = spec.targets.aws_sagemaker
    detail = (f"{endpoint['EndpointStatus']}: {endpoint.get('FailureReason', '')}" if state == "failed" else
              f"{variants[0].get('CurrentInstanceCount', '?')} instance(s), scaling "
              f"{settings.min_instances}-{settings.max_instances}")  # fmt: skip
    return row(state=state, detail=detail)


def destroy(spec: FunctionSpec) -> list[str] | None:
    deployment = aws.load_state(state_dir(spec))
    settings = spec.targets.aws_sagemaker
    region = deployment.region if deployment else settings.region
    context = aws.connect(TARGET, region, deployment.endpoint_url if deployment else settings.endpoint_url)
    names = Names.of(spec.name, context)
    recorded = [Resource(kind, name, {}) for kind, name in (deployment.resources if deployment else [])]
    # What the spec's names imply, for when state.json is gone; models and configs are named by digests of
    # settings only the recorded state knows.
    implied = [r for r in resources(spec, context, names, "", "", None)
               if r.kind not in ("sagemaker-model", "endpoint-config")]  # fmt: skip
    deleted = aws.destroy_resources(context, drivers(), [*recorded, *implied])
    (state_dir(spec) / "state.json").unlink(missing_ok=True)
    return deleted or None


def invoke(spec: FunctionSpec, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """InvokeEndpoint (real-time) or InvokeEndpointAsync with the request in S3 (async); returns the JSON reply."""
    deployment = aws.load_state(state_dir(spec))
    if deployment is None or deployment.outcome != "applied":
        raise UserError(f"{spec.name} is not deployed on {TARGET}; deploy it first: pkg deploy {spec.directory} "
                        f"--target {TARGET}")  # fmt: skip
    context = aws.connect(TARGET, deployment.region, deployment.endpoint_url)
    names = Names.of(spec.name, context)
    runtime = context.client("sagemaker-runtime")
    # An endpoint serves one model, and its /invocations fills in the name: none to get wrong.
    payload = json.dumps({k: v for k, v in body.items() if k != "model"}).encode()
    with aws.aws_errors(context, f"invoke SageMaker endpoint {names.endpoint}"):
        if spec.targets.aws_sagemaker.mode == "realtime":
            response = runtime.invoke_endpoint(
                EndpointName=names.endpoint, ContentType="application/json", Accept="application/json", Body=payload
            )
            return dict(json.loads(response["Body"].read()))
        key = f"async-in/{uuid.uuid4()}.json"
        context.client("s3").put_object(Bucket=names.bucket, Key=key, Body=payload, ContentType="application/json")
        response = runtime.invoke_endpoint_async(
            EndpointName=names.endpoint, ContentType="application/json", Accept="application/json",
            InputLocation=f"s3://{names.bucket}/{key}",
        )  # fmt: skip
        return _await_async(context, response)


def _await_async(context: AwsContext, response: dict[str, Any]) -> dict[str, Any]:
    """Poll S3 for the reply (or the failure record) SageMaker writes when the request has run."""
    s3 = context.client("s3")
    locations = {"output": response["OutputLocation"], "failure": response.get("FailureLocation")}
    deadline = time.monotonic() + ASYNC_RESULT_TIMEOUT
    while time.monotonic() < deadline:
        for outcome, location in locations.items():
            if not location:
                continue
            bucket, key = location.removeprefix("s3://").split("/", 1)
            try:
                data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            except s3.exceptions.NoSuchKey:
                continue
            if outcome == "failure":
                raise UserError(f"the endpoint failed the request: {data[:500].decode(errors='replace')}")
            return dict(json.loads(data))
        time.sleep(2.0)
    raise UserError(f"no reply at {locations['output']} after {ASYNC_RESULT_TIMEOUT:.0f} s (an endpoint scaled to "
                    "zero takes minutes to start); it will still be written there")  # fmt: skip
