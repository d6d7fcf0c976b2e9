"""The image's entry script in its queue modes, run by `sh` as the image runs it (with this environment's python):
`worker` and `lambda` read `$ONNXFN_FLAGS` after the function's own flags, and command-line flags come last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from packager.image.app_layer import render_entrypoint
from packager.processes import stop_process
from packager.targets.aws.lambda_function import decode_http_response, function_url_event
from runtime.aws_lambda.handler import RUNTIME_API_ENV
from tests.deploy_aws.lambda_service import running_lambda_service
from tests.events.conftest import Queues, chat_envelope
from tests.events.test_lambda_handler import s3_reply

# The function's settings, baked into the script; `--max-tokens 5` is overridden by $ONNXFN_FLAGS below.
FUNCTION_FLAGS = [
    "--model-name", "fn-model", "--max-tokens", "5", "--temperature", "0", "--max-batch", "2",
    "--max-context", "256", "--system-prompt", "You're brief; say one word.",
]  # fmt: skip
ENV_FLAGS = "--max-tokens 3 --no-verify"
CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "ignore_eos": True}


@pytest.fixture
def entrypoint(demo_bundle: Path, tmp_path: Path) -> Path:
    script = tmp_path / "entrypoint.sh"
    script.write_text(render_entrypoint("fn", FUNCTION_FLAGS, ["--api-key-env", "KEY"], bundle_dir=str(demo_bundle)))
    return script


def script_env(aws_env: dict[str, str], tmp_path: Path, **extra: str) -> dict[str, str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python3` is this environment's
    return {**os.environ, **aws_env, "PATH": path, "ONNXFN_STATE_DIR": str(tmp_path / "state"), **extra}


def test_worker_mode_merges_function_flags_onnxfn_flags_and_its_arguments(
    entrypoint: Path, queues: Queues, aws_env: dict[str, str], tmp_path: Path
) -> None:
    env = script_env(aws_env, tmp_path, ONNXFN_FLAGS=f"{ENV_FLAGS} --ledger s3://{queues.bucket}/ledger")
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            ["sh", str(entrypoint), "worker", "--queue-url", queues.url, "--wait-time", "1"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        queues.send({**chat_envelope("w-1", s3_reply(queues, "w-1")), "body": CHAT})
        deadline = time.monotonic() + 90
        while (result := queues.result("out/w-1.json")) is None and time.monotonic() < deadline:
            assert worker.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        stop_process(worker)
    assert result is not None, log_path.read_text()[-3000:]
    assert result.body["model"] == "fn-model"  # the function's flag
    assert result.body["usage"]["completion_tokens"] == 3  # $ONNXFN_FLAGS' --max-tokens 3 beat the function's 5


def test_lambda_mode_reads_onnxfn_flags_after_the_function_flags(
    entrypoint: Path, aws_env: dict[str, str], tmp_path: Path
) -> None:
    log_path = tmp_path / "lambda.log"
    with running_lambda_service() as service:
        env = script_env(aws_env, tmp_path, ONNXFN_FLAGS=ENV_FLAGS, **{RUNTIME_API_ENV: service.address})
        with log_path.open("wb") as log:
            runtime = subprocess.Popen(["sh", str(entrypoint), "lambda"], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            event = function_url_event("/v1/chat/completions", {**CHAT, "model": "fn-model"})
            invocation = service.invoke("fn", json.dumps(event).encode(), timeout=90)
        finally:
            stop_process(runtime)
    assert invocation.error_type is None and service.init_errors == [], log_path.read_text()[-3000:]
    completion = decode_http_response(json.loads(invocation.payload))
    assert completion["usage"]["completion_tokens"] == 3


def test_lambda_mode_refuses_arguments(entrypoint: Path, aws_env: dict[str, str], tmp_path: Path) -> None:
    done = subprocess.run(
        ["sh", str(entrypoint), "lambda", "--max-batch", "4"], env=script_env(aws_env, tmp_path),
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "put flags in $ONNXFN_FLAGS" in done.stderr


def test_lambda_flags_are_checked_with_a_precise_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.aws_lambda.handler import lambda_arguments

    with pytest.raises(ValueError, match=r"\$ONNXFN_FLAGS: argument --max-batch: invalid int value: 'many'"):
        lambda_arguments(["--max-batch", "many"])
    with pytest.raises(ValueError, match=r"\$ONNXFN_FLAGS: unrecognized arguments: --queue-url"):
        lambda_arguments(["--queue-url", "https://sqs/q"])
