"""The Lambda entry point under the real `awslambdaric`, in a fresh process, against the tests' local Runtime API.

On demand, the engine loads while the module is imported (the init phase), before the first `invocation/next`.
Under SnapStart, `awslambdaric` runs the registered before-snapshot hook (load and warm the engine), calls
`restore/next` (where Lambda snapshots, then resumes), runs the after-restore hook, and only then polls for
invocations. Either way one engine answers an HTTP event and an SQS batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from packager.processes import stop_process
from packager.targets.aws.lambda_function import decode_http_response, function_url_event
from runtime.aws_lambda.handler import BUNDLE_ENV, FLAGS_ENV, RUNTIME_API_ENV
from runtime.aws_lambda.snapstart import INIT_TYPE_ENV
from tests.deploy_aws.lambda_service import LambdaService, running_lambda_service
from tests.events.conftest import LAMBDA_MODEL, Queues, chat_envelope
from tests.events.test_lambda_handler import lambda_event, receive_all, s3_reply

HANDLER = "runtime.aws_lambda.handler.handler"


def invoke(service: LambdaService, event: dict[str, object]) -> tuple[str | None, dict[str, object]]:
    invocation = service.invoke("onnxfn-test", json.dumps(event).encode(), timeout=120)
    return invocation.error_type, json.loads(invocation.payload)


@pytest.mark.parametrize("init_type", ["on-demand", "snap-start"])
def test_awslambdaric_runs_the_entry_point_with_one_engine_for_http_and_sqs(
    init_type: str, demo_bundle: Path, queues: Queues, aws_env: dict[str, str], tmp_path: Path
) -> None:
    log_path = tmp_path / "function.log"
    with running_lambda_service() as service:
        env = {
            **os.environ, **aws_env, RUNTIME_API_ENV: service.address, INIT_TYPE_ENV: init_type,
            BUNDLE_ENV: str(demo_bundle), FLAGS_ENV: f"--no-verify --max-batch 4 --max-context 256 --temperature 0 "
            f"--model-name {LAMBDA_MODEL} --ledger s3://{queues.bucket}/ledger",
        }  # fmt: skip
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "awslambdaric", HANDLER], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            chat = {"model": LAMBDA_MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
            error, reply = invoke(service, function_url_event("/v1/chat/completions", chat))
            assert error is None, reply
            assert decode_http_response(reply)["object"] == "chat.completion"
            error, reply = invoke(service, function_url_event("/v1/chat/completions", {**chat, "n": 0}))
            assert error is None and reply["statusCode"] == 400, reply
            assert json.loads(str(reply["body"]))["error"]["param"] == "n"
            queues.send(chat_envelope("ric", s3_reply(queues, "ric")))
            error, reply = invoke(service, lambda_event(queues, receive_all(queues, 1)))
            assert (error, reply) == (None, {"batchItemFailures": []})
            error, reply = invoke(service, {"neither": "sqs nor http"})
            assert error == "Unhandled" and reply["errorType"] == "ValueError", reply
            assert "unsupported Lambda event" in str(reply["errorMessage"]) and isinstance(reply["stackTrace"], list)
        finally:
            stop_process(process)
    log = log_path.read_text(errors="replace")
    result = queues.result("out/ric.json")
    assert result is not None and result.status == 200, log[-3000:]
    assert service.init_errors == [] and service.restore_errors == [], log[-3000:]
    assert log.count("restored into the prefix cache") == 1  # the engine loaded once, for every event kind
    polls = [call for call in service.calls if call.startswith("GET ")]
    if init_type == "snap-start":
        assert polls[0] == "GET restore/next" and polls[1:] == ["GET invocation/next"] * (len(polls) - 1)
        warmed, restored = log.index("warmed before the snapshot"), log.index("restored from a snapshot")
        assert log.index("startup timeline") < warmed < restored
    else:
        assert set(polls) == {"GET invocation/next"} and "SnapStart" not in log


# What Lambda's managed Python runtime provides beside the function's zip (awslambdaric runs the handler; boto3 is
# the runtime's): copied from this environment into a folder of their own.
MANAGED_RUNTIME = ("awslambdaric", "simplejson", "boto3", "botocore", "s3transfer", "jmespath", "python-dateutil",
                   "six", "urllib3")  # fmt: skip


@pytest.fixture(scope="session")
def lambda_task_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The zip package `pkg deploy` builds, for this interpreter, unzipped as Lambda unzips it into /var/task; and
    the managed runtime's own packages (as /var/runtime)."""
    import shutil
    import zipfile
    from importlib import metadata

    from packager.paths import cache_root
    from packager.targets.aws.lambda_zip import build_zip

    root = tmp_path_factory.mktemp("lambda")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    package = build_zip(cache_root() / "lambda-zip", "x86_64", python=python)
    with zipfile.ZipFile(package.path) as archive:
        archive.extractall(root / "task")
    for name in MANAGED_RUNTIME:
        distribution = metadata.distribution(name)
        for file in distribution.files or []:
            if str(file).startswith(".."):
                continue
            target = root / "runtime" / str(file)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(distribution.locate_file(file), target)
    return root / "task", root / "runtime"


def test_the_zip_package_fetches_its_bundle_in_the_init_phase_and_serves_after_a_snapstart_restore(
    demo_bundle: Path,
    queues: Queues,
    aws_env: dict[str, str],
    tmp_path: Path,
    lambda_task_root: tuple[Path, Path],
) -> None:
    """The zip's own files and the managed runtime's packages only (`python -S`: no site-packages): awslambdaric
    imports the handler, the before-snapshot hook fetches the bundle from S3 (moto) and verifies it, loads and
    warms the engine; `restore/next`; the after-restore hook; then a function-URL chat and an SQS batch."""
    from runtime.aws_lambda.bundle_fetch import BUNDLE_DIGEST_ENV, BUNDLE_S3_ENV, CACHE_ENV
    from runtime.bundle import read_manifest

    task, managed = lambda_task_root
    manifest = read_manifest(demo_bundle)
    prefix = f"bundles/{manifest.digest.removeprefix('sha256:')}/"
    for name in [*sorted(manifest.files), "manifest.json"]:
        queues.s3.upload_file(str(demo_bundle / name), queues.bucket, prefix + name)
    log_path = tmp_path / "function.log"
    with running_lambda_service() as service:
        env = {
            "PATH": os.environ["PATH"], "PYTHONPATH": f"{task}{os.pathsep}{managed}", "LAMBDA_TASK_ROOT": str(task),
            **aws_env, RUNTIME_API_ENV: service.address, INIT_TYPE_ENV: "snap-start",
            BUNDLE_S3_ENV: f"s3://{queues.bucket}/{prefix}", BUNDLE_DIGEST_ENV: manifest.digest,
            CACHE_ENV: str(tmp_path / "tmp"), FLAGS_ENV: f"--max-batch 4 --max-context 256 --temperature 0 "
            f"--model-name {LAMBDA_MODEL} --ledger s3://{queues.bucket}/ledger",
        }  # fmt: skip
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-S", "-m", "awslambdaric", HANDLER],
                env=env, cwd=task, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            chat = {"model": LAMBDA_MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
            error, reply = invoke(service, function_url_event("/v1/chat/completions", chat))
            assert error is None, (reply, log_path.read_text(errors="replace")[-3000:])
            assert decode_http_response(reply)["object"] == "chat.completion"
            queues.send(chat_envelope("zip", s3_reply(queues, "zip")))
            error, reply = invoke(service, lambda_event(queues, receive_all(queues, 1)))
            assert (error, reply) == (None, {"batchItemFailures": []})
        finally:
            stop_process(process)
    log = log_path.read_text(errors="replace")
    result = queues.result("out/zip.json")
    assert result is not None and result.status == 200, log[-3000:]
    assert service.init_errors == [] and service.restore_errors == [], log[-3000:]
    polls = [call for call in service.calls if call.startswith("GET ")]
    assert polls[0] == "GET restore/next" and polls[1:] == ["GET invocation/next"] * (len(polls) - 1)
    fetched, warmed, restored = (log.index(s) for s in ("verified in", "warmed before the snapshot",
                                                         "restored from a snapshot"))  # fmt: skip
    assert fetched < warmed < restored, log[-3000:]
    # What the handler imported came from the zip, and boto3 and awslambdaric from the managed runtime's folder.
    where = subprocess.run(
        [sys.executable, "-S", "-c", "import onnxruntime, numpy, mangum, runtime, boto3, awslambdaric as a; "
         "print(onnxruntime.__file__, numpy.__file__, mangum.__file__, runtime.__file__, boto3.__file__, a.__file__)"],
        env={"PYTHONPATH": env["PYTHONPATH"]}, cwd=task, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert all(path.startswith(str(task)) for path in where[:4]), where
    assert all(path.startswith(str(managed)) for path in where[4:]), where
