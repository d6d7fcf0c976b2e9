"""`pkg deploy --emit-terraform` against what `pkg deploy` created: deploy to the local AWS endpoint, emit the
root module, and compare every module input with the setting read back from the endpoint through boto3."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from packager.targets.aws.terraform import ACCOUNT_EXPRESSION, WIRING
from tests.deploy_aws.conftest import Workspace, tags_of
from tests.fixtures.moto_server import MotoServer
from tests.terraform.conftest import CHECKOV, blocks, load_hcl
from tests.terraform.test_modules import unformatted

ACCOUNT = "123456789012"  # moto's
LAMBDA = """
[targets.aws-lambda]
region = "us-east-1"
memory_mb = 2048
timeout_seconds = 45
ephemeral_storage_mb = 4096
reserved_concurrency = 7
url_auth = "NONE"
batch_size = 5
batch_window_seconds = 2
max_receive_count = 4
max_concurrency = 3
log_retention_days = 14
"""
SAGEMAKER = """
[targets.aws-sagemaker]
region = "us-east-1"
instance_type = "ml.g6e.xlarge"
mode = "async"
min_instances = 0
max_instances = 3
scaling_metric = "backlog"
scaling_target = 2.5
scale_in_cooldown_seconds = 120
scale_out_cooldown_seconds = 30
max_concurrent_invocations = 3
startup_timeout_seconds = 900
log_retention_days = 7
"""


def emit(workspace: Workspace, target: str, capsys: pytest.CaptureFixture[str]) -> tuple[Path, dict[str, Any]]:
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", target, capsys=capsys)
    assert code == 0, out
    root = workspace.root / f"terraform-{target}"
    code, out = workspace.pkg(
        "deploy", str(workspace.function_dir), "--target", target, "--emit-terraform", str(root), capsys=capsys
    )
    assert code == 0, out
    assert unformatted(root) == []
    document = load_hcl(root / "main.tf")
    (tags,) = [entry["tags"] for entry in document["locals"]]
    modules = blocks(document, "module")
    for inputs in modules.values():
        for name, raw in inputs.items():
            inputs[name] = resolve(raw, tags)
        assert (root / inputs["source"]).is_dir(), inputs["source"]
    return root, modules


def resolve(raw: Any, tags: dict[str, str]) -> Any:
    """The value an input takes once applied in moto's account (module outputs left as they are)."""
    if raw == "${local.tags}":
        return tags
    if isinstance(raw, str):
        return raw.replace(ACCOUNT_EXPRESSION, ACCOUNT)
    if isinstance(raw, dict):
        return {k: resolve(v, tags) for k, v in raw.items()}
    return raw


ZIP_ONLY = {"package_type", "code_bucket", "code_key", "code_hash", "runtime", "handler", "snapstart"}


def compare(inputs: dict[str, Any], actual: dict[str, Any], module: str, unread: frozenset[str] = frozenset()) -> None:
    mismatched = {k: (inputs.get(k), v) for k, v in actual.items() if inputs.get(k) != v}
    assert mismatched == {}, mismatched
    # Every wired input was compared (or is known to have no read-back here, or does not apply to this package).
    assert set(WIRING[module]) - set(actual) <= {"provisioned_concurrency", "model_data_url", *unread}


def test_lambda_module_inputs_match_the_deployed_function(
    workspace: Workspace, moto_server: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace.write_spec(LAMBDA)
    _, modules = emit(workspace, "aws-lambda", capsys)
    name, lam = workspace.name, moto_server.client("lambda")
    function = lam.get_function(FunctionName=name)
    config = function["Configuration"]
    sqs = moto_server.client("sqs")
    queue = sqs.get_queue_url(QueueName=f"{name}-requests")["QueueUrl"]
    attributes = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["All"])["Attributes"]
    (mapping,) = lam.list_event_source_mappings(EventSourceArn=attributes["QueueArn"])["EventSourceMappings"]
    (group,) = moto_server.client("logs").describe_log_groups(logGroupNamePrefix=f"/aws/lambda/{name}")["logGroups"]
    repository, digest = function["Code"]["ImageUri"].split("/", 1)[1].split("@")
    actual = {
        "function_name": config["FunctionName"],
        "image_uri": "${module.ecr.repository_url}@" + digest,
        "architecture": config["Architectures"][0],
        "memory_mb": config["MemorySize"],
        "timeout_seconds": config["Timeout"],
        "ephemeral_storage_mb": config["EphemeralStorage"]["Size"],
        "environment": config["Environment"]["Variables"],
        "reserved_concurrency": function["Concurrency"]["ReservedConcurrentExecutions"],
        "url_auth": lam.get_function_url_config(FunctionName=name, Qualifier="live")["AuthType"],
        "batch_size": mapping["BatchSize"],
        "batch_window_seconds": mapping["MaximumBatchingWindowInSeconds"],
        "max_concurrency": mapping["ScalingConfig"]["MaximumConcurrency"],
        "max_receive_count": int(json.loads(attributes["RedrivePolicy"])["maxReceiveCount"]),
        "log_retention_days": group["retentionInDays"],
        "tags": function["Tags"],
    }
    compare(modules["function"], actual, "lambda_function", frozenset(ZIP_ONLY))
    assert not ZIP_ONLY & set(modules["function"])  # the image package leaves them at their defaults
    assert modules["ecr"]["name"] == repository
    assert modules["ecr"]["pull_source_arn"] == config["FunctionArn"].removesuffix(":$LATEST")
    buckets = [b["Name"] for b in moto_server.client("s3").list_buckets()["Buckets"]]
    assert buckets == [modules["bucket"]["name"]]
    assert modules["function"]["provisioned_concurrency"] == 0


def test_lambda_zip_module_inputs_match_the_deployed_snapstart_function(
    workspace: Workspace, moto_server: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace.write_spec(LAMBDA.replace("ephemeral_storage_mb = 4096", "ephemeral_storage_mb = 512")
                         + "snapstart = true\n")  # fmt: skip
    root, modules = emit(workspace, "aws-lambda", capsys)
    name, lam = workspace.name, moto_server.client("lambda")
    function = lam.get_function(FunctionName=name)
    config = function["Configuration"]
    sqs = moto_server.client("sqs")
    queue = sqs.get_queue_url(QueueName=f"{name}-requests")["QueueUrl"]
    attributes = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["All"])["Attributes"]
    (mapping,) = lam.list_event_source_mappings(EventSourceArn=attributes["QueueArn"])["EventSourceMappings"]
    (group,) = moto_server.client("logs").describe_log_groups(logGroupNamePrefix=f"/aws/lambda/{name}")["logGroups"]
    actual = {
        "function_name": config["FunctionName"],
        "package_type": config["PackageType"],
        "code_hash": config["CodeSha256"],
        "runtime": config["Runtime"],
        "handler": config["Handler"],
        "snapstart": config["SnapStart"]["ApplyOn"] == "PublishedVersions",
        "architecture": config["Architectures"][0],
        "memory_mb": config["MemorySize"],
        "timeout_seconds": config["Timeout"],
        "ephemeral_storage_mb": config["EphemeralStorage"]["Size"],
        "environment": config["Environment"]["Variables"],
        "reserved_concurrency": function["Concurrency"]["ReservedConcurrentExecutions"],
        "url_auth": lam.get_function_url_config(FunctionName=name, Qualifier="live")["AuthType"],
        "batch_size": mapping["BatchSize"],
        "batch_window_seconds": mapping["MaximumBatchingWindowInSeconds"],
        "max_concurrency": mapping["ScalingConfig"]["MaximumConcurrency"],
        "max_receive_count": int(json.loads(attributes["RedrivePolicy"])["maxReceiveCount"]),
        "log_retention_days": group["retentionInDays"],
        "tags": function["Tags"],
    }
    compare(modules["function"], actual, "lambda_function", frozenset({"image_uri", "code_bucket", "code_key"}))
    assert "ecr" not in modules
    assert modules["function"]["code_key"] == "${aws_s3_object.code.key}"
    # The objects the root uploads are the ones pkg deploy uploaded: the same keys, the same bytes.
    s3 = moto_server.client("s3")
    (bucket,) = [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert bucket == modules["bucket"]["name"]
    objects = blocks(load_hcl(root / "main.tf"), "resource")
    code, bundle = objects["aws_s3_object.code"], objects["aws_s3_object.bundle"]
    deployed = {item["Key"] for item in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    assert deployed == {code["key"], *bundle["for_each"]}
    for key, source in [(code["key"], code["source"]), *bundle["for_each"].items()]:
        assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == Path(source).read_bytes(), key


def test_sagemaker_module_inputs_match_the_deployed_endpoint(
    workspace: Workspace, moto_server: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace.write_spec(SAGEMAKER, providers='["cuda", "cpu"]')
    root, modules = emit(workspace, "aws-sagemaker", capsys)
    name, sagemaker = workspace.name, moto_server.client("sagemaker")
    endpoint = sagemaker.describe_endpoint(EndpointName=name)
    config = sagemaker.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
    (variant,) = config["ProductionVariants"]
    model = sagemaker.describe_model(ModelName=variant["ModelName"])
    autoscaling = moto_server.client("application-autoscaling")
    resource = f"endpoint/{name}/variant/AllTraffic"
    (target,) = autoscaling.describe_scalable_targets(ServiceNamespace="sagemaker", ResourceIds=[resource])[
        "ScalableTargets"
    ]
    policies = autoscaling.describe_scaling_policies(ServiceNamespace="sagemaker", ResourceId=resource)
    (tracking,) = [p for p in policies["ScalingPolicies"] if p["PolicyType"] == "TargetTrackingScaling"]
    tracking_config = tracking["TargetTrackingScalingPolicyConfiguration"]
    (group,) = moto_server.client("logs").describe_log_groups(logGroupNamePrefix=f"/aws/sagemaker/Endpoints/{name}")[
        "logGroups"
    ]
    actual = {
        "endpoint_name": endpoint["EndpointName"],
        "image_uri": "${module.ecr.repository_url}@" + model["PrimaryContainer"]["Image"].split("@")[1],
        "environment": model["PrimaryContainer"].get("Environment", {}),
        "instance_type": variant["InstanceType"],
        "startup_timeout_seconds": variant["ContainerStartupHealthCheckTimeoutInSeconds"],
        "mode": "async" if "AsyncInferenceConfig" in config else "realtime",
        "max_concurrent_invocations": config["AsyncInferenceConfig"]["ClientConfig"][
            "MaxConcurrentInvocationsPerInstance"
        ],
        "min_instances": target["MinCapacity"],
        "max_instances": target["MaxCapacity"],
        "scaling_metric": "backlog" if "CustomizedMetricSpecification" in tracking_config else "invocations",
        "scaling_target": tracking_config["TargetValue"],
        "scale_in_cooldown_seconds": tracking_config["ScaleInCooldown"],
        "scale_out_cooldown_seconds": tracking_config["ScaleOutCooldown"],
        "log_retention_days": group["retentionInDays"],
        "tags": tags_of(sagemaker.list_tags(ResourceArn=endpoint["EndpointArn"])["Tags"]),
    }
    compare(modules["endpoint"], actual, "sagemaker_endpoint")
    assert modules["endpoint"]["model_data_url"] is None and "ModelDataUrl" not in model["PrimaryContainer"]
    output = config["AsyncInferenceConfig"]["OutputConfig"]
    bucket = modules["bucket"]["name"]
    assert (output["S3OutputPath"], output["S3FailurePath"]) == (f"s3://{bucket}/async-out/",
                                                                  f"s3://{bucket}/async-failures/")  # fmt: skip

    # The emitted root passes checkov as well (it adds only module calls to the modules checked already).
    result = subprocess.run(
        [str(CHECKOV), "-d", str(root), "--framework", "terraform", "--output", "json", "--skip-download"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert [c["check_id"] for r in reports for c in r["results"]["failed_checks"]] == []
