"""`pkg logs --target aws-*` reads the deployment's CloudWatch log group from a real local AWS endpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from packager.targets.aws.common import AwsDeployment, save_state
from tests.fixtures.moto_server import REGION, MotoServer, running_moto_server

GROUP = "/aws/lambda/logfn"


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    with running_moto_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def deployed(tmp_path: Path, moto: MotoServer) -> Iterator[Path]:
    """A function folder whose aws-lambda state names a log group holding three events."""
    moto.reset()
    folder = tmp_path / "functions" / "logfn"
    folder.mkdir(parents=True)
    (folder / "function.toml").write_text('name = "logfn"\n[model]\nsource = "gguf:m.gguf"\n')
    account = moto.client("sts").get_caller_identity()["Account"]
    state = AwsDeployment(
        target="aws-lambda", function="logfn", region=REGION, endpoint_url=moto.endpoint_url, account=account,
        url="", bundle_digest="sha256:0", resources=[["log-group", GROUP]], outcome="applied",
    )  # fmt: skip
    save_state(tmp_path / "build" / "logfn" / "aws-lambda", state)
    assert asdict(state)["resources"] == [["log-group", GROUP]]
    put_events(moto, "2026/11/22/[$LATEST]a", ["INIT_START Runtime Version: python:3.11", "engine ready", "END"])
    yield folder


def put_events(moto: MotoServer, stream: str, messages: list[str]) -> None:
    logs = moto.client("logs")
    if not logs.describe_log_groups(logGroupNamePrefix=GROUP)["logGroups"]:
        logs.create_log_group(logGroupName=GROUP)
    if not logs.describe_log_streams(logGroupName=GROUP, logStreamNamePrefix=stream)["logStreams"]:
        logs.create_log_stream(logGroupName=GROUP, logStreamName=stream)
    now = int(time.time() * 1000)
    events = [{"timestamp": now + i, "message": m} for i, m in enumerate(messages)]
    logs.put_log_events(logGroupName=GROUP, logStreamName=stream, logEvents=events)


def pkg(moto: MotoServer, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **moto.env, "AWS_EC2_METADATA_DISABLED": "true", "COLUMNS": "200"}
    command = [sys.executable, "-m", "packager.cli", "logs", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_logs_prints_the_log_group_in_time_order(deployed: Path, moto: MotoServer) -> None:
    root = deployed.parents[1]
    result = pkg(moto, root, "functions/logfn", "--target", "aws-lambda")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    expected = ["INIT_START Runtime Version: python:3.11", "engine ready", "END"]
    assert [line.split(" ", 2)[2] for line in lines] == expected
    tail = pkg(moto, root, "functions/logfn", "--target", "aws-lambda", "--tail", "1")
    assert tail.stdout.splitlines()[0].endswith(" END")
    assert len(tail.stdout.splitlines()) == 1


def test_follow_prints_events_as_they_arrive_once_each(deployed: Path, moto: MotoServer) -> None:
    env = {**os.environ, **moto.env, "AWS_EC2_METADATA_DISABLED": "true"}
    command = [sys.executable, "-m", "packager.cli", "logs", "functions/logfn", "--target", "aws-lambda", "-f"]
    process = subprocess.Popen(command, cwd=deployed.parents[1], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        seen = [process.stdout.readline() for _ in range(3)]
        assert seen[-1].rstrip().endswith(" END")
        put_events(moto, "2026/11/22/[$LATEST]b", ["request 1 done"])
        assert process.stdout.readline().rstrip().endswith("request 1 done")
        put_events(moto, "2026/11/22/[$LATEST]a", ["request 2 done"])
        assert process.stdout.readline().rstrip().endswith("request 2 done")
    finally:
        process.kill()
        process.wait()


def test_logs_errors_name_the_fix(deployed: Path, moto: MotoServer, tmp_path: Path) -> None:
    root = deployed.parents[1]
    not_deployed = pkg(moto, root, "functions/logfn", "--target", "aws-sagemaker")
    assert not_deployed.returncode == 1 and "pkg deploy functions/logfn --target aws-sagemaker" in not_deployed.stderr
    never_local = pkg(moto, root, "functions/logfn")
    assert never_local.returncode == 1 and "never deployed locally" in never_local.stderr
    bad_age = pkg(moto, root, "functions/logfn", "--target", "aws-lambda", "--since", "ten minutes")
    assert bad_age.returncode == 2 and "e.g. 10m" in bad_age.stderr
    moto.client("logs").delete_log_group(logGroupName=GROUP)
    gone = pkg(moto, root, "functions/logfn", "--target", "aws-lambda")
    assert gone.returncode == 1 and "does not exist" in gone.stderr
    for result in (not_deployed, never_local, bad_age, gone):
        assert "Traceback" not in result.stderr
