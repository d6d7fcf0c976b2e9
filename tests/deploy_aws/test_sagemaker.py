"""`pkg deploy --target aws-sagemaker` on GPU instance types against the local AWS endpoint: real-time with
target tracking, async scaled to zero, in-place updates, status, invoke through boto3, destroy, a failed endpoint."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from packager.runtime_flags import server_flags
from packager.spec import load_spec
from tests.conftest import DEMO_FUNCTION
from tests.deploy_aws.conftest import Workspace, tags_of
from tests.deploy_aws.sagemaker_runtime import SageMakerRuntime, running_sagemaker_runtime
from tests.fixtures.moto_server import MotoServer

GPU = '["cuda", "cpu"]'
REALTIME = """
[targets.aws-sagemaker]
region = "us-east-1"
instance_type = "{instance}"
min_instances = 1
max_instances = {max}
scaling_metric = "invocations"
scaling_target = {target}
"""
ASYNC = """
[targets.aws-sagemaker]
region = "us-east-1"
instance_type = "ml.g6.2xlarge"
mode = "async"
min_instances = 0
max_instances = 2
scaling_metric = "backlog"
scaling_target = 3.0
max_concurrent_invocations = 2
"""
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="session")
def model_container(frozen_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The runtime serving SageMaker's /ping and /invocations, started as the image's `serve` does."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flags = server_flags(load_spec(DEMO_FUNCTION))
    log = (tmp_path_factory.mktemp("sagemaker-container") / "serve.log").open("wb")
    command = [sys.executable, "-m", "runtime", "serve", str(frozen_bundle), "--host", "127.0.0.1",
               "--port", str(port), "--sagemaker", *flags]  # fmt: skip
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{url}/ping", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass  # not listening yet, or busy loading the model
            assert process.poll() is None, f"the model container exited: {Path(log.name).read_text()[-2000:]}"
            time.sleep(0.25)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()


@pytest.fixture
def sagemaker_runtime(
    model_container: str, moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SageMakerRuntime]:
    with running_sagemaker_runtime(model_container, moto_server) as runtime:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", f"http://{runtime.address}")
        yield runtime


def pkg(workspace: Workspace, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, out = workspace.pkg(*args[:1], str(workspace.function_dir), *args[1:], capsys=capsys)
    assert code == 0, out
    return out


def scaling(moto_server: MotoServer, endpoint: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    autoscaling = moto_server.client("application-autoscaling")
    resource = f"endpoint/{endpoint}/variant/AllTraffic"
    (target,) = autoscaling.describe_scalable_targets(ServiceNamespace="sagemaker", ResourceIds=[resource])[
        "ScalableTargets"
    ]
    policies = autoscaling.describe_scaling_policies(ServiceNamespace="sagemaker", ResourceId=resource)
    return target, {p["PolicyName"]: p for p in policies["ScalingPolicies"]}


def test_gpu_realtime_deploy_update_invoke_destroy(
    workspace: Workspace,
    moto_server: MotoServer,
    sagemaker_runtime: SageMakerRuntime,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name, sagemaker = workspace.name, moto_server.client("sagemaker")
    workspace.write_spec(REALTIME.format(instance="ml.g5.xlarge", max=3, target=5.0), providers=GPU)
    pkg(workspace, capsys, "deploy", "--target", "aws-sagemaker")

    endpoint = sagemaker.describe_endpoint(EndpointName=name)
    assert endpoint["EndpointStatus"] == "InService"
    config = sagemaker.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
    (variant,) = config["ProductionVariants"]
    assert (variant["InstanceType"], variant["InitialInstanceCount"]) == ("ml.g5.xlarge", 1)
    assert "AsyncInferenceConfig" not in config
    model = sagemaker.describe_model(ModelName=variant["ModelName"])
    assert model["PrimaryContainer"]["Image"].split("/", 1)[1].startswith(f"onnxfn/{name}/aws-sagemaker@sha256:")
    assert model["ExecutionRoleArn"].endswith(f":role/onnxfn-{name}-sagemaker")
    for arn in (endpoint["EndpointArn"], config["EndpointConfigArn"], model["ModelArn"]):
        tags = tags_of(sagemaker.list_tags(ResourceArn=arn)["Tags"])
        assert tags["onnxfn:function"] == name and tags["onnxfn:bundle-digest"].startswith("sha256:")
    target, policies = scaling(moto_server, name)
    assert (target["MinCapacity"], target["MaxCapacity"]) == (1, 3)
    tracking = policies[f"{name}-invocations"]["TargetTrackingScalingPolicyConfiguration"]
    assert tracking["TargetValue"] == 5.0
    assert tracking["PredefinedMetricSpecification"]["PredefinedMetricType"] == "SageMakerVariantInvocationsPerInstance"
    document = moto_server.client("iam").get_role_policy(RoleName=f"onnxfn-{name}-sagemaker", PolicyName="onnxfn")
    wildcards = [s["Sid"] for s in document["PolicyDocument"]["Statement"] if s["Resource"] == "*"]
    assert wildcards == ["EcrLoginHasNoResourceLevelPermissions"]  # the one action AWS grants only on "*"

    assert "no changes" in pkg(workspace, capsys, "deploy", "--target", "aws-sagemaker")

    # Scaling settings change in place; the endpoint config (immutable) stays.
    workspace.write_spec(REALTIME.format(instance="ml.g5.xlarge", max=4, target=10.0), providers=GPU)
    pkg(workspace, capsys, "deploy", "--target", "aws-sagemaker")
    target, policies = scaling(moto_server, name)
    assert target["MaxCapacity"] == 4
    assert policies[f"{name}-invocations"]["TargetTrackingScalingPolicyConfiguration"]["TargetValue"] == 10.0
    assert sagemaker.describe_endpoint(EndpointName=name)["EndpointConfigName"] == config["EndpointConfigName"]

    # A new instance type is a new endpoint config; the endpoint switches to it and the old one is deleted.
    workspace.write_spec(REALTIME.format(instance="ml.g6.xlarge", max=4, target=10.0), providers=GPU)
    out = pkg(workspace, capsys, "deploy", "--target", "aws-sagemaker", "--plan")
    assert "endpoint-config" in out and "config →" in out
    pkg(workspace, capsys, "deploy", "--target", "aws-sagemaker")
    switched = sagemaker.describe_endpoint(EndpointName=name)
    assert switched["EndpointArn"] == endpoint["EndpointArn"]
    assert switched["EndpointConfigName"] != config["EndpointConfigName"]
    names = [c["EndpointConfigName"] for c in sagemaker.list_endpoint_configs()["EndpointConfigs"]]
    assert names == [switched["EndpointConfigName"]]
    assert "no changes" in pkg(workspace, capsys, "deploy", "--target", "aws-sagemaker")

    out = pkg(workspace, capsys, "status")
    assert "aws-sagemaker" in out and "ready" in out and f"/endpoints/{name}/invocations" in out

    out = pkg(workspace, capsys, "invoke", QUESTION, "--target", "aws-sagemaker", "--max-tokens", "8")
    assert direct_reply(sagemaker_runtime) in out and "8 completion tokens" in out and "via aws-sagemaker" in out
    assert sagemaker_runtime.calls == [f"invocations {name}"]

    out = pkg(workspace, capsys, "destroy", "--target", "aws-sagemaker")
    assert f"endpoint {name}" in out
    assert sagemaker.list_endpoints()["Endpoints"] == []
    assert sagemaker.list_endpoint_configs()["EndpointConfigs"] == []
    assert sagemaker.list_models()["Models"] == []
    assert scaling_targets(moto_server) == []


def direct_reply(runtime: SageMakerRuntime) -> str:
    """The container's own answer to the question (greedy: the same through any path)."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8}
    answer = requests.post(f"{runtime.container_url}/invocations", json=body, timeout=60).json()
    text = answer["choices"][0]["message"]["content"]
    assert text
    return str(text)


def scaling_targets(moto_server: MotoServer) -> list[dict[str, Any]]:
    autoscaling = moto_server.client("application-autoscaling")
    return list(autoscaling.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"])


def test_async_endpoint_scales_to_zero_and_answers_through_s3(
    workspace: Workspace,
    moto_server: MotoServer,
    sagemaker_runtime: SageMakerRuntime,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name, sagemaker = workspace.name, moto_server.client("sagemaker")
    workspace.write_spec(ASYNC, providers='["tensorrt", "cuda", "cpu"]')
    pkg(workspace, capsys, "deploy", "--target", "aws-sagemaker")
    config_name = sagemaker.describe_endpoint(EndpointName=name)["EndpointConfigName"]
    config = sagemaker.describe_endpoint_config(EndpointConfigName=config_name)
    output = config["AsyncInferenceConfig"]["OutputConfig"]
    assert output["S3OutputPath"].endswith("/async-out/") and output["S3FailurePath"].endswith("/async-failures/")
    assert config["AsyncInferenceConfig"]["ClientConfig"]["MaxConcurrentInvocationsPerInstance"] == 2
    target, policies = scaling(moto_server, name)
    assert (target["MinCapacity"], target["MaxCapacity"]) == (0, 2)
    tracking = policies[f"{name}-backlog"]["TargetTrackingScalingPolicyConfiguration"]
    assert tracking["CustomizedMetricSpecification"]["MetricName"] == "ApproximateBacklogSizePerInstance"
    wake = policies[f"{name}-wake-from-zero"]
    assert wake["PolicyType"] == "StepScaling"
    assert wake["StepScalingPolicyConfiguration"]["StepAdjustments"][0]["ScalingAdjustment"] == 1
    (alarm,) = moto_server.client("cloudwatch").describe_alarms(AlarmNames=[f"{name}-backlog-without-capacity"])[
        "MetricAlarms"
    ]
    assert alarm["MetricName"] == "HasBacklogWithoutCapacity" and alarm["AlarmActions"] == [wake["PolicyARN"]]
    assert "no changes" in pkg(workspace, capsys, "deploy", "--target", "aws-sagemaker")

    out = pkg(workspace, capsys, "invoke", QUESTION, "--target", "aws-sagemaker", "--max-tokens", "8")
    assert direct_reply(sagemaker_runtime) in out
    assert sagemaker_runtime.calls == [f"async-invocations {name}"]
    s3 = moto_server.client("s3")
    bucket = output["S3OutputPath"].removeprefix("s3://").split("/")[0]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert any(k.startswith("async-in/") for k in keys) and any(k.startswith("async-out/") for k in keys)

    pkg(workspace, capsys, "destroy", "--target", "aws-sagemaker")
    assert moto_server.client("cloudwatch").describe_alarms()["MetricAlarms"] == []
    assert scaling_targets(moto_server) == []
    assert s3.list_buckets()["Buckets"] == []


def test_settings_sagemaker_refuses_are_named(workspace: Workspace, capsys: pytest.CaptureFixture[str]) -> None:
    table = REALTIME.format(instance="ml.g5.xlarge", max=2, target=5.0).replace(
        "min_instances = 1", "min_instances = 0"
    )
    workspace.write_spec(table)
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-sagemaker", capsys=capsys)
    assert code == 2
    assert 'min_instances = 0 (scale to zero) needs mode = "async"' in out
    assert "has a GPU, but runtime.providers = ['cpu']" in out
    workspace.write_spec(table.replace("ml.g5.xlarge", "ml.p9.huge"))
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-sagemaker", capsys=capsys)
    assert code == 2 and "targets.aws-sagemaker.instance_type = 'ml.p9.huge': not allowed" in out


def test_fail_on_create_endpoint_is_reported_and_destroyed(
    workspace: Workspace, moto_server: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The endpoint ends `Failed` (the test server injects it for this name): precise message, non-zero exit."""
    workspace.write_spec(REALTIME.format(instance="ml.g5.xlarge", max=2, target=5.0), providers=GPU)
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-sagemaker", capsys=capsys)
    assert code == 1
    assert "did not pass the ping health check" in out and f"create endpoint {workspace.name}" in out
    state = json.loads((workspace.root / "build" / workspace.name / "aws-sagemaker" / "state.json").read_text())
    assert state["outcome"] == "failed"
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-sagemaker", capsys=capsys)
    assert code == 1 and "is in a failed state" in out and "cannot be updated" in out
    code, out = workspace.pkg("destroy", str(workspace.function_dir), "--target", "aws-sagemaker", capsys=capsys)
    assert code == 0 and f"endpoint {workspace.name}" in out, out
    assert moto_server.client("sagemaker").list_endpoints()["Endpoints"] == []
