"""The deployed function's image runs its Lambda entry point (`IMAGE lambda`: the real `awslambdaric`) against a
local Lambda service; `pkg invoke --target aws-lambda` and boto3 reach it through Lambda's Invoke API.

The image is the one `pkg deploy` pushed (pulled by the digest the function names), started with the
function's own environment as read back from the AWS endpoint.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from packager.image.run import Podman, pull_registry
from packager.processes import stop_process
from packager.targets.aws.lambda_function import function_url_event
from runtime.events.schema import message_body
from tests.deploy_aws.conftest import Workspace
from tests.deploy_aws.lambda_service import LambdaService, running_lambda_service
from tests.fixtures.moto_server import MotoServer
from tests.image.conftest import podman as podman  # (fixture)

TABLE = '[targets.aws-lambda]\nregion = "us-east-1"\nbatch_size = 4\n'
QUESTION = "What is the capital of France?"


@contextmanager
def function_container(
    podman: Podman, image: str, env: dict[str, str], command: list[str], log: Path
) -> Iterator[None]:
    flags = [f"--env={name}={value}" for name, value in env.items()]
    process = podman.start("run", "--rm", "--network", "host", *flags, image, *command, log=log)
    try:
        yield
    finally:
        stop_process(process, grace=20)


def sqs_event(moto_server: MotoServer, queue_url: str, count: int) -> dict[str, Any]:
    """What the event source mapping hands the function: the received messages as records."""
    sqs = moto_server.client("sqs")
    arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    messages: list[dict[str, Any]] = []
    while len(messages) < count:
        batch = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, AttributeNames=["All"],
                                    MessageAttributeNames=["All"], WaitTimeSeconds=1).get("Messages", [])  # fmt: skip
        messages += batch
    records = [
        {
            "messageId": m["MessageId"], "receiptHandle": m["ReceiptHandle"], "body": m["Body"],
            "attributes": m["Attributes"], "messageAttributes": {}, "md5OfBody": m["MD5OfBody"],
            "eventSource": "aws:sqs", "eventSourceARN": arn, "awsRegion": "us-east-1",
        }
        for m in messages
    ]  # fmt: skip
    return {"Records": records}


def invoke(client: Any, name: str, event: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    response = client.invoke(FunctionName=name, Qualifier="live", Payload=json.dumps(event))
    return response.get("FunctionError"), json.loads(response["Payload"].read())


def test_the_image_entry_point_answers_sqs_batches_http_events_and_errors_in_lambda_format(
    workspace: Workspace,
    moto_server: MotoServer,
    podman: Podman,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workspace.write_spec(TABLE)
    name = workspace.name
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-lambda", capsys=capsys)
    assert code == 0, out
    function = moto_server.client("lambda").get_function(FunctionName=name)
    repository, digest = function["Code"]["ImageUri"].split("/", 1)[1].split("@")
    registry = workspace.env["ONNXFN_ECR_REGISTRY_URL"].removeprefix("http://")
    image = f"{registry}/{repository}@{digest}"
    started = time.perf_counter()
    pull_registry(podman, image, insecure=True)
    pulled = time.perf_counter() - started

    config = function["Configuration"]
    with running_lambda_service() as service:
        env = {
            **config["Environment"]["Variables"],  # ONNXFN_FLAGS, exactly as deployed
            "AWS_LAMBDA_RUNTIME_API": service.address, "AWS_LAMBDA_FUNCTION_NAME": name,
            "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(config["MemorySize"]), "AWS_REGION": "us-east-1",
            **{k: v for k, v in moto_server.env.items() if k.startswith("AWS_")},
        }  # fmt: skip
        command = config["ImageConfigResponse"]["ImageConfig"]["Command"]
        log = workspace.root / "lambda-container.log"
        monkeypatch.setenv("AWS_ENDPOINT_URL_LAMBDA", f"http://{service.address}")
        client = boto3.client(
            "lambda", region_name="us-east-1", config=Config(read_timeout=300, retries={"max_attempts": 1})
        )
        with function_container(podman, image, env, command, log):
            answer = check_sqs_batch(service, client, moto_server, workspace)
            check_error_format(client, name, log)
            check_http_event(workspace, client, answer, capsys, log)
    print(f"\nlambda runtime: podman pull {pulled:.1f} s")


def check_sqs_batch(service: LambdaService, client: Any, moto_server: MotoServer, workspace: Workspace) -> str:
    """Two chats and a malformed record in one batch; returns the (greedy) answer the chats got."""
    sqs, s3 = moto_server.client("sqs"), moto_server.client("s3")
    bucket = next(b["Name"] for b in s3.list_buckets()["Buckets"] if workspace.name in b["Name"])
    # moto runs a queue's Lambda trigger itself on SendMessage (and crashes on image functions), so the batch is
    # drawn from a queue of its own: the handler reads the records, not the queue they came from.
    queue_url = sqs.create_queue(QueueName=f"{workspace.name}-batch")["QueueUrl"]
    for index in range(2):
        envelope = {"request_id": f"r-{index}", "kind": "chat", "reply_to": {"s3": f"s3://{bucket}/results/r-{index}"},
                    "body": {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8}}  # fmt: skip
        body, attributes = message_body(envelope, as_msgpack=False)
        sqs.send_message(QueueUrl=queue_url, MessageBody=body, MessageAttributes=attributes)
    malformed = sqs.send_message(QueueUrl=queue_url, MessageBody="{not json")["MessageId"]
    error, payload = invoke(client, workspace.name, sqs_event(moto_server, queue_url, 3))
    assert error is None, payload
    assert payload == {"batchItemFailures": [{"itemIdentifier": malformed}]}
    answers = set()
    for index in range(2):
        result = json.loads(s3.get_object(Bucket=bucket, Key=f"results/r-{index}")["Body"].read())
        assert result["status"] == 200
        answers.add(result["body"]["choices"][0]["message"]["content"])
    assert service.init_errors == []
    (answer,) = answers  # the function's temperature is 0
    return str(answer)


def check_error_format(client: Any, name: str, log: Path) -> None:
    error, payload = invoke(client, name, {"neither": "sqs nor http"})
    assert error == "Unhandled", payload
    assert payload["errorType"] == "ValueError" and "unsupported Lambda event" in payload["errorMessage"]
    assert isinstance(payload["stackTrace"], list), log.read_text()[-2000:]


def check_http_event(
    workspace: Workspace, client: Any, answer: str, capsys: pytest.CaptureFixture[str], log: Path
) -> None:
    """`pkg invoke` sends a function-URL event through boto3's Invoke; the reply is the chat completion the queue
    got for the same question. A client mistake comes back as the HTTP server's OpenAI-style 4xx, in the function
    URL response format."""
    code, out = workspace.pkg(
        "invoke", str(workspace.function_dir), QUESTION, "--target", "aws-lambda", "--max-tokens", "8", capsys=capsys
    )
    assert code == 0, out + log.read_text()[-2000:]
    assert out.startswith(answer) and "8 completion tokens" in out
    body = {"model": workspace.name, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 100_000}
    error, reply = invoke(client, workspace.name, function_url_event("/v1/chat/completions", body))
    assert error is None and reply["statusCode"] == 400, reply
    assert json.loads(reply["body"])["error"]["param"] == "max_tokens"
