"""`pkg deploy --target aws-lambda` against the local AWS endpoint: plan, deploy, redeploy, update, status, destroy."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest
import requests

from runtime.bundle import read_manifest
from tests.deploy_aws.conftest import Workspace, tags_of
from tests.fixtures.moto_server import MotoServer

LAMBDA_TABLE = """
[targets.aws-lambda]
region = "us-east-1"
memory_mb = {memory}
timeout_seconds = 60
architecture = "x86_64"
ephemeral_storage_mb = 2048
reserved_concurrency = 20
batch_size = {batch}
max_receive_count = 5
"""
KINDS = ("s3-bucket", "log-group", "sqs-queue", "ecr-repository", "ecr-image", "iam-role", "lambda-function",
         "lambda-alias", "lambda-url", "event-source")  # fmt: skip


def deploy(workspace: Workspace, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-lambda", *flags, capsys=capsys)
    assert code == 0, out
    return out


def plan_rows(out: str) -> dict[tuple[str, str], str]:
    """(kind, name) → action, from the plan table."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 4 and cells[0] in ("create", "update", "delete", "none"):
            rows[(cells[1], cells[2])] = cells[0]
    return rows


def all_statements(document: dict[str, Any]) -> list[dict[str, Any]]:
    return list(document["Statement"])


def test_deploy_redeploy_update_status_destroy(
    workspace: Workspace, moto_server: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = workspace.name
    workspace.write_spec(LAMBDA_TABLE.format(memory=2048, batch=4))
    lam, sqs, iam = moto_server.client("lambda"), moto_server.client("sqs"), moto_server.client("iam")

    # --plan lists every resource as a creation and touches nothing.
    rows = plan_rows(deploy(workspace, capsys, "--plan"))
    assert {kind for kind, _ in rows} == set(KINDS) and set(rows.values()) == {"create"}
    assert lam.list_functions()["Functions"] == []

    out = deploy(workspace, capsys)
    assert "changed" in out and f"{len(rows)} of {len(rows)} resources" in out
    function = lam.get_function(FunctionName=name)
    config = function["Configuration"]
    assert (config["MemorySize"], config["Timeout"], config["Architectures"]) == (2048, 60, ["x86_64"])
    assert config["EphemeralStorage"]["Size"] == 2048 and config["PackageType"] == "Image"
    assert config["ImageConfigResponse"]["ImageConfig"]["Command"] == ["lambda"]
    flags = shlex.split(config["Environment"]["Variables"]["ONNXFN_FLAGS"])
    assert flags[flags.index("--max-batch") + 1] == "8" and flags[flags.index("--ledger") + 1].startswith(
        "s3://onnxfn-"
    )
    assert function["Concurrency"]["ReservedConcurrentExecutions"] == 20

    # The image the function names is in the registry standing in for ECR, by digest.
    image_uri = function["Code"]["ImageUri"]
    repository, digest = image_uri.split("/", 1)[1].split("@")
    assert repository == f"onnxfn/{name}/aws-lambda"
    registry = workspace.env["ONNXFN_ECR_REGISTRY_URL"]
    manifest = requests.get(f"{registry}/v2/{repository}/manifests/{digest}", timeout=10,
                            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})  # fmt: skip
    assert manifest.status_code == 200 and manifest.headers["Docker-Content-Digest"] == digest

    # Queue + DLQ with the redrive policy, and the trigger reporting partial batch failures.
    queue_url = sqs.get_queue_url(QueueName=f"{name}-requests")["QueueUrl"]
    attributes = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["All"])["Attributes"]
    redrive = json.loads(attributes["RedrivePolicy"])
    assert redrive["deadLetterTargetArn"].endswith(f":{name}-dlq") and int(redrive["maxReceiveCount"]) == 5
    assert int(attributes["VisibilityTimeout"]) == 360  # 6x the function timeout
    queue_arn = attributes["QueueArn"]
    (mapping,) = lam.list_event_source_mappings(EventSourceArn=queue_arn)["EventSourceMappings"]
    assert mapping["BatchSize"] == 4 and mapping["FunctionResponseTypes"] == ["ReportBatchItemFailures"]
    url = lam.get_function_url_config(FunctionName=name, Qualifier="live")
    assert url["AuthType"] == "AWS_IAM" and url.get("InvokeMode", "RESPONSE_STREAM") == "RESPONSE_STREAM"

    # Tags: function name and bundle digest on everything taggable.
    bundle_digest = read_manifest(workspace.root / "build" / name / "bundle").digest
    expected = {"onnxfn:function": name, "onnxfn:target": "aws-lambda", "onnxfn:bundle-digest": bundle_digest}
    tag_sets = [
        function["Tags"],
        sqs.list_queue_tags(QueueUrl=queue_url)["Tags"],
        tags_of(iam.list_role_tags(RoleName=f"onnxfn-{name}-lambda")["Tags"]),
        tags_of(moto_server.client("ecr").list_tags_for_resource(
            resourceArn=f"arn:aws:ecr:us-east-1:123456789012:repository/{repository}")["tags"]),
        moto_server.client("logs").list_tags_log_group(logGroupName=f"/aws/lambda/{name}")["tags"],
    ]  # fmt: skip
    for tags in tag_sets:
        assert expected.items() <= tags.items(), tags

    # Least privilege, written out: no wildcard action, every resource names this function's own.
    document = iam.get_role_policy(RoleName=f"onnxfn-{name}-lambda", PolicyName="onnxfn")["PolicyDocument"]
    for statement in all_statements(document):
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        assert all("*" not in action for action in actions), statement
        assert all(resource != "*" and (name in resource or "onnxfn-reply-" in resource) for resource in resources)

    # A second deploy with no change: "no changes", and nothing is touched.
    version_before = lam.get_alias(FunctionName=name, Name="live")["FunctionVersion"]
    assert "no changes" in deploy(workspace, capsys)
    assert lam.get_alias(FunctionName=name, Name="live")["FunctionVersion"] == version_before

    # A changed spec updates in place: same function, same trigger, new version behind the alias.
    workspace.write_spec(LAMBDA_TABLE.format(memory=4096, batch=6))
    rows = plan_rows(deploy(workspace, capsys, "--plan"))
    changed = {kind for (kind, _), action in rows.items() if action != "none"}
    assert changed == {"lambda-function", "lambda-alias", "event-source"}, rows
    assert lam.get_function(FunctionName=name)["Configuration"]["MemorySize"] == 2048  # --plan changed nothing
    deploy(workspace, capsys)
    assert lam.get_function(FunctionName=name)["Configuration"]["MemorySize"] == 4096
    (updated,) = lam.list_event_source_mappings(EventSourceArn=queue_arn)["EventSourceMappings"]
    assert updated["UUID"] == mapping["UUID"] and updated["BatchSize"] == 6
    assert lam.get_alias(FunctionName=name, Name="live")["FunctionVersion"] != version_before
    assert "no changes" in deploy(workspace, capsys)

    code, out = workspace.pkg("status", str(workspace.function_dir), capsys=capsys)
    assert code == 0 and "aws-lambda" in out and "ready" in out and ".lambda-url.us-east-1.on.aws" in out

    code, out = workspace.pkg("destroy", str(workspace.function_dir), "--target", "aws-lambda", capsys=capsys)
    assert code == 0 and "deleted 10 resources" in out, out
    assert lam.list_functions()["Functions"] == []
    assert sqs.list_queues().get("QueueUrls", []) == []
    assert moto_server.client("ecr").describe_repositories()["repositories"] == []
    assert moto_server.client("s3").list_buckets()["Buckets"] == []
    assert not [r for r in iam.list_roles()["Roles"] if r["RoleName"].startswith("onnxfn-")]
    code, out = workspace.pkg("status", str(workspace.function_dir), capsys=capsys)
    assert "not deployed" in out
