"""Queue tests run against a real moto server and the real demo model; helpers to build queues and read results."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from runtime.api.protocol import RequestPolicy
from runtime.aws_lambda import handler as lambda_handler
from runtime.bundle import open_bundle, read_manifest
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.reports import StepReport
from runtime.events.handler import QueueHandler
from runtime.events.results import Ledger, ResultStore
from runtime.events.schema import Result, message_body
from runtime.http.state import ServerSettings, ServerState
from tests.fixtures.moto_server import MotoServer, aws_env, moto_server  # noqa: F401  (fixtures)

MAX_BATCH = 8
MAX_CONTEXT = 512
LAMBDA_MODEL = "lambda-demo"


@dataclass
class Queues:
    """A request queue with a DLQ behind its redrive policy, a versioned results bucket and a reply queue."""

    sqs: Any
    s3: Any
    url: str
    dlq_url: str
    bucket: str
    reply_url: str
    max_receive_count: int

    @property
    def ledger(self) -> Ledger:
        return Ledger(self.bucket, "ledger/")

    def send(self, envelope: dict[str, Any], *, as_msgpack: bool = False) -> str:
        body, attributes = message_body(envelope, as_msgpack=as_msgpack)
        return str(
            self.sqs.send_message(QueueUrl=self.url, MessageBody=body, MessageAttributes=attributes)["MessageId"]
        )

    def send_raw(self, body: str) -> str:
        return str(self.sqs.send_message(QueueUrl=self.url, MessageBody=body)["MessageId"])

    def receive(self, url: str | None = None, *, count: int = 10, wait: int = 0) -> list[dict[str, Any]]:
        response = self.sqs.receive_message(
            QueueUrl=url or self.url, MaxNumberOfMessages=count, WaitTimeSeconds=wait,
            AttributeNames=["All"], MessageAttributeNames=["All"],
        )  # fmt: skip
        return list(response.get("Messages", []))

    def drain(self, url: str) -> list[dict[str, Any]]:
        """Every message now visible on `url` (received and left in flight)."""
        messages: list[dict[str, Any]] = []
        while batch := self.receive(url, count=10):
            messages.extend(batch)
        return messages

    def depth(self, url: str | None = None) -> int:
        names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
        attributes = self.sqs.get_queue_attributes(QueueUrl=url or self.url, AttributeNames=names)["Attributes"]
        return sum(int(attributes[n]) for n in names)

    def result(self, key: str) -> Result | None:
        try:
            data = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None
        return Result.from_json(json.loads(data))

    def versions(self, prefix: str) -> dict[str, int]:
        """How many times each key under `prefix` was written (the bucket is versioned)."""
        counts: dict[str, int] = {}
        for page in self.s3.get_paginator("list_object_versions").paginate(Bucket=self.bucket, Prefix=prefix):
            for version in page.get("Versions", []):
                counts[version["Key"]] = counts.get(version["Key"], 0) + 1
        return counts


def make_queues(
    server: MotoServer, *, visibility_timeout: int = 30, max_receive_count: int = 2, fifo_reply: bool = False
) -> Queues:
    sqs, s3 = server.client("sqs"), server.client("s3")
    name = f"q{uuid.uuid4().hex[:12]}"
    dlq_url = sqs.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    redrive = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(max_receive_count)})
    attributes = {"VisibilityTimeout": str(visibility_timeout), "RedrivePolicy": redrive}
    url = sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
    reply_name, reply_attributes = (
        (f"{name}-reply.fifo", {"FifoQueue": "true"}) if fifo_reply else (f"{name}-reply", {})
    )
    reply_url = sqs.create_queue(QueueName=reply_name, Attributes=reply_attributes)["QueueUrl"]
    bucket = f"results-{name}"
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    return Queues(sqs, s3, url, dlq_url, bucket, reply_url, max_receive_count)


def chat_envelope(
    request_id: str, reply_to: dict[str, str], *, content: str = "Say hi.", **body: Any
) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "kind": "chat",
        "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **body},
        "reply_to": reply_to,
    }


@pytest.fixture
def queues(moto_server: MotoServer, aws_env: dict[str, str]) -> Queues:  # noqa: F811
    return make_queues(moto_server)


def engine_config() -> EngineConfig:
    return EngineConfig(max_batch=MAX_BATCH, max_context=MAX_CONTEXT, kv_memory_bytes=200 << 20)


def request_policy(bundle: Path) -> RequestPolicy:
    manifest = read_manifest(bundle)
    return RequestPolicy(
        model_name=manifest.function,
        vocab_size=manifest.model.vocab_size,
        default_temperature=0.0,
        default_max_tokens=16,
        max_tokens_limit=512,
    )


@dataclass
class EngineUnderTest:
    engine: Engine
    state: ServerState
    batch_sizes: list[int]


@pytest.fixture(scope="module")
def engine_under_test(demo_bundle: Path) -> Iterator[EngineUnderTest]:
    """A started engine behind the HTTP handlers' state; records every step's batch size."""
    batch_sizes: list[int] = []

    def on_step(report: StepReport) -> None:
        batch_sizes.append(report.batch_size)

    engine = Engine(open_bundle(demo_bundle, verify=False), engine_config(), on_step=on_step)
    engine.start()
    state = ServerState(ServerSettings(policy=request_policy(demo_bundle)))
    state.engine = engine
    yield EngineUnderTest(engine, state, batch_sizes)
    engine.shutdown()


def queue_handler(under_test: EngineUnderTest, queues: Queues, *, ledger: bool = True) -> QueueHandler:
    results = ResultStore(queues.s3, queues.sqs, queues.ledger if ledger else None)
    return QueueHandler(under_test.state, results)


class LambdaContext:
    """The parts of Lambda's context object the handler and mangum read."""

    aws_request_id = "test-invocation"

    def get_remaining_time_in_millis(self) -> int:
        return 60_000


@pytest.fixture
def lambda_environment(demo_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The Lambda entry point configured as the image configures it, loading on its first call."""
    monkeypatch.setenv(lambda_handler.BUNDLE_ENV, str(demo_bundle))
    flags = f"--no-verify --max-batch 4 --max-context 256 --temperature 0 --model-name {LAMBDA_MODEL}"
    monkeypatch.setenv(lambda_handler.FLAGS_ENV, flags)
    monkeypatch.setattr(lambda_handler, "_function", None)
    yield
    loaded = lambda_handler._function
    if loaded is not None:
        loaded.shutdown()
