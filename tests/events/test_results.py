"""Write-once results on the moto server: a second write never replaces or duplicates the first result."""

from __future__ import annotations

import argparse
import json

import pytest

from runtime.api.errors import APIError
from runtime.events.loading import aws_client
from runtime.events.results import Ledger, ResultStore
from runtime.events.schema import QueueMessage, Reply, Result, S3Target, SQSTarget
from tests.events.conftest import Queues, make_queues
from tests.fixtures.moto_server import MotoServer


def result(request_id: str, text: str) -> Result:
    return Result(request_id, 200, {"choices": [{"message": {"content": text}}]})


def test_an_s3_result_is_written_once_and_the_winner_is_returned(queues: Queues) -> None:
    store = ResultStore(queues.s3, queues.sqs)
    reply = Reply("r-1", S3Target(queues.bucket, "out/r-1.json"))
    first = result("r-1", "first")
    assert store.recorded(reply) is None
    assert store.deliver(reply, first) == first
    assert store.deliver(reply, result("r-1", "second")) == first  # a redelivery's different text loses
    assert store.recorded(reply) == first
    assert queues.versions("out/") == {"out/r-1.json": 1}


def test_msgpack_requests_get_msgpack_results(queues: Queues) -> None:
    store = ResultStore(queues.s3, queues.sqs)
    reply = Reply("r-2", S3Target(queues.bucket, "out/r-2"), msgpack=True)
    store.deliver(reply, result("r-2", "first"))
    stored = queues.s3.get_object(Bucket=queues.bucket, Key="out/r-2")
    assert stored["ContentType"] == "application/msgpack"
    assert store.recorded(reply) == result("r-2", "first")


def test_an_sqs_reply_goes_through_the_ledger_so_a_resend_is_identical(queues: Queues) -> None:
    store = ResultStore(queues.s3, queues.sqs, queues.ledger)
    reply = Reply("r-3", SQSTarget(queues.reply_url))
    store.deliver(reply, result("r-3", "first"))
    store.deliver(reply, result("r-3", "second"))  # a redelivery that generated other text
    recorded = store.recorded(reply)
    assert recorded == result("r-3", "first")
    store.deliver(reply, recorded, recorded=True)
    replies = queues.drain(queues.reply_url)
    assert len(replies) == 3
    assert {json.loads(m["Body"])["body"]["choices"][0]["message"]["content"] for m in replies} == {"first"}
    assert {m["MessageAttributes"]["request-id"]["StringValue"] for m in replies} == {"r-3"}
    assert queues.versions("ledger/") == {"ledger/results/r-3": 1}


def test_a_fifo_reply_queue_drops_resends_by_request_id(moto_server: MotoServer, aws_env: dict[str, str]) -> None:
    queues = make_queues(moto_server, fifo_reply=True)
    store = ResultStore(queues.s3, queues.sqs, queues.ledger)
    reply = Reply("r-4", SQSTarget(queues.reply_url))
    for _ in range(3):
        store.deliver(reply, result("r-4", "first"))
    replies = queues.drain(queues.reply_url)
    assert len(replies) == 1


def test_rejections_are_recorded_in_the_ledger_by_message_id(queues: Queues) -> None:
    store = ResultStore(queues.s3, queues.sqs, Ledger.from_uri(f"s3://{queues.bucket}/ledger"))
    message = QueueMessage("m-7", "{broken", None, 2)
    store.record_rejection(message, APIError(400, "the request body is not valid JSON", code="invalid_json"), None)
    note = json.loads(queues.s3.get_object(Bucket=queues.bucket, Key="ledger/errors/m-7.json")["Body"].read())
    assert note["error"]["code"] == "invalid_json"
    assert note["receive_count"] == 2
    assert note["body_excerpt"] == "{broken"


def test_ledger_uris() -> None:
    assert Ledger.from_uri("s3://b") == Ledger("b", "")
    assert Ledger.from_uri("s3://b/x/y/") == Ledger("b", "x/y/")
    assert Ledger.from_uri("s3://b/x").result_key("r") == S3Target("b", "x/results/r")


def test_the_queue_clients_take_aws_region_before_aws_default_region(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    args = argparse.Namespace(endpoint_url="http://127.0.0.1:9", region=None)
    assert aws_client("sqs", args).meta.region_name == "eu-west-3"
    chosen = argparse.Namespace(endpoint_url=None, region="ap-south-1")
    assert aws_client("sqs", chosen).meta.region_name == "ap-south-1"
    monkeypatch.delenv("AWS_REGION")
    assert aws_client("s3", args).meta.region_name == "us-east-1"
