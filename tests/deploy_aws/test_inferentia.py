"""`pkg deploy --target aws-sagemaker` on ml.inf2: the Neuron build step and the deploy configuration.

The Neuron SDK does not install here, so the build must stop with what to install and where; the deploy
is then tested with a folder laid out as `optimum-cli export neuron` writes it (config.json with its
`neuron` section and the compiled graph), as if compiled on a machine with the SDK and copied here.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from packager.spec import load_spec
from packager.targets.aws import neuron
from tests.deploy_aws.conftest import Workspace
from tests.fixtures.moto_server import MotoServer

INF2 = """
[targets.aws-sagemaker]
region = "us-east-1"
instance_type = "ml.inf2.xlarge"
min_instances = 1
max_instances = 2
scaling_metric = "concurrency"
scaling_target = 4.0

[targets.aws-sagemaker.neuron]
batch_size = 2
sequence_length = 1024
num_cores = 2
auto_cast_type = "bf16"
"""


def compiled_folder(workspace: Workspace, graph: bytes) -> Path:
    folder = workspace.root / "build" / workspace.name / "neuron"
    (folder / "compiled").mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "neuron": {"batch_size": 2, "sequence_length": 1024, "num_cores": 2,
                                                "auto_cast_type": "bf16", "compiler_type": "neuronx-cc"}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "compiled" / "model.neff").write_bytes(graph)
    return folder


def test_without_the_neuron_sdk_the_build_says_what_to_install_and_where(
    workspace: Workspace, moto_server: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace.write_spec(INF2)
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-sagemaker", capsys=capsys)
    assert code == 1
    flat = " ".join(out.split())
    assert "AWS Inferentia2" in flat and "ONNX Runtime has no Neuron provider" in flat
    for missing in ("torch-neuronx", "optimum-neuron", "neuronx-cc"):
        assert missing in flat
    assert "pip install --extra-index-url https://pip.repos.neuron.amazonaws.com" in flat
    assert "--batch_size 2 --sequence_length 1024 --num_cores 2 --auto_cast_type bf16" in flat
    assert f"build/{workspace.name}/neuron" in flat
    assert moto_server.client("sagemaker").list_models()["Models"] == []

    # A folder that is not an optimum-neuron export is refused, naming what is missing.
    (workspace.root / "build" / workspace.name / "neuron").mkdir()
    (workspace.root / "build" / workspace.name / "neuron" / "config.json").write_text('{"model_type": "llama"}')
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-sagemaker", capsys=capsys)
    assert code == 1 and "lacks its `neuron` section and 0 compiled graphs" in " ".join(out.split())


def test_export_command_carries_the_static_shapes(workspace: Workspace) -> None:
    workspace.write_spec(INF2)
    spec = load_spec(workspace.function_dir)
    command = neuron.export_command(Path("/hf"), Path("/out"), spec.targets.aws_sagemaker.neuron, spec.model.task)
    assert command == ["optimum-cli", "export", "neuron", "--model", "/hf", "--task", "text-generation",
                       "--batch_size", "2", "--sequence_length", "1024", "--num_cores", "2", "--auto_cast_type",
                       "bf16", "/out"]  # fmt: skip


def test_inferentia_deploy_configuration(
    workspace: Workspace, moto_server: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name, sagemaker, s3 = workspace.name, moto_server.client("sagemaker"), moto_server.client("s3")
    workspace.write_spec(INF2)
    compiled_folder(workspace, b"NEFF graph v1")
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-sagemaker", capsys=capsys)
    assert code == 0, out

    endpoint = sagemaker.describe_endpoint(EndpointName=name)
    config = sagemaker.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
    assert config["ProductionVariants"][0]["InstanceType"] == "ml.inf2.xlarge"
    model = sagemaker.describe_model(ModelName=config["ProductionVariants"][0]["ModelName"])
    container = model["PrimaryContainer"]
    assert container["Environment"] == {"ONNXFN_BACKEND": "neuron", "ONNXFN_NEURON_MODEL_DIR": "/opt/ml/model",
                                        "NEURON_RT_NUM_CORES": "2"}  # fmt: skip
    bucket, key = container["ModelDataUrl"].removeprefix("s3://").split("/", 1)
    archive = s3.get_object(Bucket=bucket, Key=key)
    data = archive["Body"].read()
    assert archive["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == ["compiled/model.neff", "config.json"]
        assert tar.extractfile("compiled/model.neff").read() == b"NEFF graph v1"  # type: ignore[union-attr]
    policies = moto_server.client("application-autoscaling").describe_scaling_policies(ServiceNamespace="sagemaker")
    (policy,) = policies["ScalingPolicies"]
    predefined = policy["TargetTrackingScalingPolicyConfiguration"]["PredefinedMetricSpecification"]
    assert predefined["PredefinedMetricType"] == "SageMakerVariantConcurrentRequestsPerModelHighResolution"

    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-sagemaker", capsys=capsys)
    assert code == 0 and "no changes" in out

    # A recompiled model is a new artifact and a new model; the endpoint switches, the old model goes.
    compiled_folder(workspace, b"NEFF graph v2")
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-sagemaker", capsys=capsys)
    assert code == 0, out
    models = [m["ModelName"] for m in sagemaker.list_models()["Models"]]
    assert len(models) == 1 and models[0] != model["ModelName"]
    assert sagemaker.describe_endpoint(EndpointName=name)["EndpointConfigName"] != endpoint["EndpointConfigName"]

    code, out = workspace.pkg("destroy", str(workspace.function_dir), "--target", "aws-sagemaker", capsys=capsys)
    assert code == 0 and sagemaker.list_models()["Models"] == [] and s3.list_buckets()["Buckets"] == []
