"""`pkg invoke --queue`: the real CLI sends an envelope through moto's SQS and waits for the worker's result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DEMO_FUNCTION
from tests.events.conftest import make_queues
from tests.events.workers import worker_process
from tests.fixtures.moto_server import MotoServer


def pkg(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "packager.cli", "invoke", str(DEMO_FUNCTION), *args]
    return subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


@pytest.mark.real_model
def test_pkg_invoke_queue_waits_for_the_result(
    demo_bundle: Path, moto_server: MotoServer, aws_env: dict[str, str], tmp_path: Path
) -> None:
    queues = make_queues(moto_server)
    with worker_process(demo_bundle, queues, aws_env, tmp_path) as worker:
        worker.wait_warm()  # the two greedy answers below must come from one prefill graph
        replied = pkg(aws_env, "What is 2 + 2?", "--queue", queues.url, "--max-tokens", "6")
        assert replied.returncode == 0, replied.stderr + worker.log()[-2000:]
        assert replied.stdout.strip()
        assert "completion tokens" in replied.stderr and "via the queue" in replied.stderr
        assert queues.sqs.list_queues(QueueNamePrefix="onnxfn-reply-").get("QueueUrls", []) == []  # cleaned up

        key = f"s3://{queues.bucket}/cli/answer.json"
        stored = pkg(aws_env, "What is 2 + 2?", "--queue", queues.url, "--max-tokens", "6", "--reply-to", key)
        assert stored.returncode == 0, stored.stderr
        assert stored.stdout == replied.stdout  # greedy: the same answer whichever way it travelled
        assert queues.result("cli/answer.json") is not None

        refused = pkg(aws_env, "Hi", "--queue", queues.url, "--temperature", "5")
        assert refused.returncode == 1
        assert "400" in refused.stderr and "temperature" in refused.stderr
