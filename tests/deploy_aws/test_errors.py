"""Deploy errors give a precise message and a non-zero exit; a deploy that fails halfway resumes or is destroyed."""

from __future__ import annotations

import json

import pytest

from tests.deploy_aws.conftest import Workspace
from tests.fixtures.moto_server import MotoServer

TABLE = """
[targets.aws-lambda]
region = "{region}"
reserved_concurrency = {reserved}
{extra}
"""


def deploy(workspace: Workspace, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    return workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-lambda", capsys=capsys)


def test_missing_credentials_and_wrong_region_fail_before_anything_is_created(
    workspace: Workspace, moto_server: MotoServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace.write_spec(TABLE.format(region="us-east-7", reserved=10, extra=""))
    code, out = deploy(workspace, capsys)
    assert code == 1 and "region 'us-east-7'" in out and "is not an AWS region" in out, out

    workspace.write_spec(TABLE.format(region="us-east-1", reserved=10, extra=""))
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(variable)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(workspace.root / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(workspace.root / "no-config"))
    code, out = deploy(workspace, capsys)
    assert code == 1 and "no AWS credentials" in out and "AWS_ACCESS_KEY_ID" in out, out
    assert moto_server.client("iam").list_roles()["Roles"] == []


def test_settings_aws_refuses_are_named_before_deploying(
    workspace: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace.write_spec(
        TABLE.format(region="us-east-1", reserved=2, extra="snapstart = true\nprovisioned_concurrency = 3")
    )
    code, out = deploy(workspace, capsys)
    assert code == 2
    assert (
        "snapstart = true with provisioned_concurrency: AWS allows one or the other" in out
        and "provisioned_concurrency = 3 exceeds reserved_concurrency = 2" in out
    )


def test_a_quota_error_stops_the_deploy_and_the_next_one_resumes(
    workspace: Workspace, moto_server: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # 950 reserved would leave 50 of the account's 1000 unreserved: AWS requires 100.
    workspace.write_spec(TABLE.format(region="us-east-1", reserved=950, extra=""))
    code, out = deploy(workspace, capsys)
    assert code == 1, out
    assert "UnreservedConcurrentExecution" in out and "quota" in out
    assert f"the deploy stopped at: create lambda-function {workspace.name}" in out
    state = json.loads((workspace.root / "build" / workspace.name / "aws-lambda" / "state.json").read_text())
    assert state["outcome"] == "failed" and state["failed_step"] == f"create lambda-function {workspace.name}"
    code, out = workspace.pkg("status", str(workspace.function_dir), capsys=capsys)
    assert "failed" in out and "the last deploy stopped at: create lambda-function" in out

    # The function exists without its reservation; the next deploy updates it and creates the rest.
    lam = moto_server.client("lambda")
    assert "ReservedConcurrentExecutions" not in lam.get_function(FunctionName=workspace.name).get("Concurrency", {})
    workspace.write_spec(TABLE.format(region="us-east-1", reserved=100, extra=""))
    code, out = deploy(workspace, capsys)
    assert code == 0, out
    assert "4 of 11 resources" in out, out  # the function's reservation, and the three resources after it
    assert lam.get_function(FunctionName=workspace.name)["Concurrency"]["ReservedConcurrentExecutions"] == 100
    assert len(lam.list_functions()["Functions"]) == 1
    code, out = deploy(workspace, capsys)
    assert code == 0 and "no changes" in out


def test_destroy_removes_what_a_failed_deploy_left(
    workspace: Workspace, moto_server: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace.write_spec(TABLE.format(region="us-east-1", reserved=950, extra=""))
    assert deploy(workspace, capsys)[0] == 1
    code, out = workspace.pkg("destroy", str(workspace.function_dir), "--target", "aws-lambda", capsys=capsys)
    assert code == 0 and f"lambda-function {workspace.name}" in out
    assert moto_server.client("lambda").list_functions()["Functions"] == []
    assert moto_server.client("sqs").list_queues().get("QueueUrls", []) == []
    code, out = workspace.pkg("destroy", str(workspace.function_dir), "--target", "aws-lambda", capsys=capsys)
    assert code == 0 and "nothing to do" in out
