"""The Lambda SQS handler, called with real SQS event records: messages sent to and received from moto."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from runtime.aws_lambda.handler import handler
from runtime.aws_lambda.sqs_batch import is_sqs_batch, process_sqs_batch
from tests.events.conftest import EngineUnderTest, LambdaContext, Queues, chat_envelope, queue_handler


def lambda_event(queues: Queues, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """What the SQS event source mapping hands a function: one record per received message."""
    arn = queues.sqs.get_queue_attributes(QueueUrl=queues.url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    records = []
    for m in messages:
        attributes = {
            name: {
                "stringValue": v.get("StringValue"),
                "stringListValues": [],
                "binaryListValues": [],
                "dataType": v["DataType"],
            }
            for name, v in m.get("MessageAttributes", {}).items()
        }
        records.append(
            {
                "messageId": m["MessageId"],
                "receiptHandle": m["ReceiptHandle"],
                "body": m["Body"],
                "attributes": m["Attributes"],
                "messageAttributes": attributes,
                "md5OfBody": m["MD5OfBody"],
                "eventSource": "aws:sqs",
                "eventSourceARN": arn,
                "awsRegion": "us-east-1",
            }
        )
    return {"Records": records}


def receive_all(queues: Queues, count: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    while len(messages) < count:
        batch = queues.receive(count=min(10, count - len(messages)), wait=1)
        assert batch, f"only {len(messages)} of {count} messages arrived"
        messages.extend(batch)
    return messages


def failures(response: dict[str, Any]) -> set[str]:
    return {item["itemIdentifier"] for item in response["batchItemFailures"]}


def s3_reply(queues: Queues, request_id: str) -> dict[str, str]:
    return {"s3": f"s3://{queues.bucket}/out/{request_id}.json"}


def test_a_batch_runs_concurrently_and_reports_exactly_the_failed_records(
    queues: Queues, engine_under_test: EngineUnderTest
) -> None:
    prompts = ["Name a colour.", "Name a fruit.", "Count to three.", "Say hello.", "Name a city.", "Say yes."]
    sent = {
        queues.send(chat_envelope(f"ok-{i}", s3_reply(queues, f"ok-{i}"), content=p)): f"ok-{i}"
        for i, p in enumerate(prompts)
    }
    sent[queues.send(chat_envelope("ok-mp", s3_reply(queues, "ok-mp"), max_tokens=6), as_msgpack=True)] = "ok-mp"
    sent[queues.send(chat_envelope("ok-sqs", {"sqs": queues.reply_url}))] = "ok-sqs"
    broken = queues.send_raw('{"request_id": "x", ')
    invalid = queues.send(chat_envelope("bad-temp", s3_reply(queues, "bad-temp"), temperature=5))
    event = lambda_event(queues, receive_all(queues, 10))
    steps_before = len(engine_under_test.batch_sizes)

    response = process_sqs_batch(event["Records"], queue_handler(engine_under_test, queues))

    assert failures(response) == {broken, invalid}
    assert max(engine_under_test.batch_sizes[steps_before:]) >= 4  # decoded together, not one by one
    for request_id in (r for r in sent.values() if r != "ok-sqs"):
        result = queues.result(f"out/{request_id}.json") if request_id != "ok-mp" else None
        if request_id == "ok-mp":
            continue
        assert result is not None and result.status == 200, request_id
        assert result.body["object"] == "chat.completion"
        assert result.body["choices"][0]["message"]["content"]
        assert result.body["usage"]["completion_tokens"] <= 4
    mp = queues.s3.get_object(Bucket=queues.bucket, Key="out/ok-mp.json")
    assert mp["ContentType"] == "application/msgpack"
    (reply,) = queues.drain(queues.reply_url)
    assert json.loads(reply["Body"])["body"]["object"] == "chat.completion"
    rejected = queues.result("out/bad-temp.json")
    assert rejected is not None and rejected.status == 400
    assert rejected.body["error"]["param"] == "temperature"
    errors = queues.versions("ledger/errors/")
    assert set(errors) == {f"ledger/errors/{broken}.json", f"ledger/errors/{invalid}.json"}


def test_a_record_whose_result_cannot_be_stored_is_reported_failed(
    queues: Queues, engine_under_test: EngineUnderTest
) -> None:
    good = queues.send(chat_envelope("fine", s3_reply(queues, "fine")))
    lost = queues.send(chat_envelope("lost", {"s3": "s3://no-such-bucket-here/out/lost.json"}))
    event = lambda_event(queues, receive_all(queues, 2))
    response = process_sqs_batch(event["Records"], queue_handler(engine_under_test, queues))
    assert failures(response) == {lost}
    assert good not in failures(response)


def test_a_redelivered_record_reuses_its_stored_result_without_generating(
    queues: Queues, engine_under_test: EngineUnderTest
) -> None:
    queues.send(chat_envelope("again", s3_reply(queues, "again"), temperature=1.0, max_tokens=8))
    handler_ = queue_handler(engine_under_test, queues)
    (first,) = receive_all(queues, 1)
    assert failures(process_sqs_batch(lambda_event(queues, [first])["Records"], handler_)) == set()
    stored = queues.result("out/again.json")
    # Lambda failed to delete it (say the function timed out after storing): SQS delivers it again.
    queues.sqs.change_message_visibility(QueueUrl=queues.url, ReceiptHandle=first["ReceiptHandle"], VisibilityTimeout=0)
    (second,) = receive_all(queues, 1)
    assert second["Attributes"]["ApproximateReceiveCount"] == "2"
    tokens_before = engine_under_test.engine.stats().tokens_out
    assert failures(process_sqs_batch(lambda_event(queues, [second])["Records"], handler_)) == set()
    assert engine_under_test.engine.stats().tokens_out == tokens_before
    assert queues.result("out/again.json") == stored
    assert queues.versions("out/") == {"out/again.json": 1}


def test_records_still_running_at_the_deadline_are_aborted_and_reported(
    queues: Queues, engine_under_test: EngineUnderTest
) -> None:
    slow = queues.send(chat_envelope("slow", s3_reply(queues, "slow"), max_tokens=400, ignore_eos=True))
    event = lambda_event(queues, receive_all(queues, 1))
    started = time.perf_counter()
    response = process_sqs_batch(event["Records"], queue_handler(engine_under_test, queues), time_left=0.5)
    assert time.perf_counter() - started < 5
    assert failures(response) == {slow}
    assert queues.result("out/slow.json") is None
    deadline = time.monotonic() + 5
    while engine_under_test.engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_under_test.engine.stats().running == 0


def test_the_lambda_entry_point_loads_from_its_environment(queues: Queues, lambda_environment: None) -> None:
    queues.send(chat_envelope("entry", s3_reply(queues, "entry")))
    event = lambda_event(queues, receive_all(queues, 1))
    assert is_sqs_batch(event)
    assert handler(event, LambdaContext()) == {"batchItemFailures": []}
    result = queues.result("out/entry.json")
    assert result is not None and result.status == 200
    with pytest.raises(ValueError, match="unsupported Lambda event: expected an SQS batch or an HTTP event"):
        handler({"detail-type": "Scheduled Event", "source": "aws.events"}, LambdaContext())
