"""Events with nulls where maps belong, sent to the Lambda entry point under the real `awslambdaric` (issue 47, row 10).

SQS records with `messageAttributes: null` made the whole batch an invocation error (every record retried, the good
ones too); an HTTP event with `headers: null` raised inside mangum. Now a null map is an empty one, a record that
cannot be read fails alone, and an HTTP event mangum cannot read is a 400 in Lambda's response format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from packager.processes import stop_process
from packager.targets.aws.lambda_function import function_url_event
from runtime.aws_lambda.handler import BUNDLE_ENV, FLAGS_ENV, RUNTIME_API_ENV
from runtime.aws_lambda.snapstart import INIT_TYPE_ENV
from tests.deploy_aws.lambda_service import running_lambda_service
from tests.events.conftest import LAMBDA_MODEL, Queues, chat_envelope
from tests.events.test_lambda_handler import failures, lambda_event, receive_all, s3_reply
from tests.events.test_lambda_runtime_client import HANDLER, invoke

CHAT = {"model": LAMBDA_MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def test_nulls_in_sqs_records_and_http_events_never_fail_the_invocation(
    demo_bundle: Path, queues: Queues, aws_env: dict[str, str], tmp_path: Path
) -> None:
    log_path = tmp_path / "function.log"
    with running_lambda_service() as service:
        env = {
            **os.environ, **aws_env, RUNTIME_API_ENV: service.address, INIT_TYPE_ENV: "on-demand",
            BUNDLE_ENV: str(demo_bundle), FLAGS_ENV: f"--no-verify --max-batch 4 --max-context 256 --temperature 0 "
            f"--model-name {LAMBDA_MODEL} --ledger s3://{queues.bucket}/ledger",
        }  # fmt: skip
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "awslambdaric", HANDLER], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            for name in ("null-attributes", "null-content-type", "null-body"):
                queues.send(chat_envelope(name, s3_reply(queues, name)))
            records: list[dict[str, Any]] = lambda_event(queues, receive_all(queues, 3))["Records"]
            by_name = {json.loads(r["body"])["request_id"]: r for r in records}
            by_name["null-attributes"]["messageAttributes"] = None  # the record
            by_name["null-content-type"]["messageAttributes"] = {"content-type": None}
            by_name["null-content-type"]["attributes"] = None
            by_name["null-body"]["body"] = None  # unreadable: fails alone
            error, reply = invoke(service, {"Records": records})
            assert error is None, reply
            assert failures(reply) == {by_name["null-body"]["messageId"]}, reply

            answered = invoke(service, {**function_url_event("/v1/chat/completions", CHAT), "headers": None})
            assert answered[0] is None and answered[1]["statusCode"] == 200, answered  # no headers: JSON, as curl's
            for broken in (
                {**function_url_event("/v1/chat/completions", CHAT), "body": 5},
                {**(event := function_url_event("/v1/models", None)), "requestContext": {**event["requestContext"],
                                                                                         "http": None}},
            ):  # fmt: skip
                error, reply = invoke(service, broken)
                assert error is None and reply["statusCode"] == 400, reply
                body = json.loads(str(reply["body"]))["error"]
                assert body["code"] == "invalid_http_event" and "malformed" in body["message"], body
        finally:
            stop_process(process)
    log = log_path.read_text(errors="replace")
    for name in ("null-attributes", "null-content-type"):
        result = queues.result(f"out/{name}.json")
        assert result is not None and result.status == 200, (name, log[-3000:])
    assert queues.result("out/null-body.json") is None
