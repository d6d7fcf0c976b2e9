"""The hostile corpus as SQS messages: each gets its stored 400, as on HTTP, and is not retried as a crash.

Before issue 37, `"logit_bias": {"²": 1}` raised ValueError inside the handler: the message was retried on
every delivery with no result stored and ended in the DLQ silently.
"""

from __future__ import annotations

import json

import msgpack

from runtime.aws_lambda.sqs_batch import process_sqs_batch
from tests.events.conftest import EngineUnderTest, Queues, queue_handler
from tests.events.test_lambda_handler import failures, lambda_event, receive_all
from tests.reliability.hostile_corpus import CASES, MSGPACK_CASES


def test_every_hostile_message_gets_a_stored_400(queues: Queues, engine_under_test: EngineUnderTest) -> None:
    model = engine_under_test.state.settings.policy.model_name
    sent = {}
    for case in CASES:
        envelope = {
            "request_id": case.name,
            "kind": case.kind,
            "reply_to": {"s3": f"s3://{queues.bucket}/out/{case.name}"},
        }
        sent[queues.send_raw(case.raw(model, envelope).decode())] = case
    records = lambda_event(queues, receive_all(queues, len(sent)))["Records"]

    response = process_sqs_batch(records, queue_handler(engine_under_test, queues))

    # A rejection is reported failed (the DLQ keeps it after maxReceiveCount), with its reason stored first,
    # exactly as for any other invalid field; none of them went through the retry-on-exception path.
    assert failures(response) == set(sent)
    for message_id, case in sent.items():
        record = queues.s3.get_object(Bucket=queues.bucket, Key=f"ledger/errors/{message_id}.json")
        error = json.loads(record["Body"].read())["error"]
        assert (error["code"], error["param"]) == (case.code, case.param), (case.name, error)
        assert case.message in error["message"]
        result = queues.result(f"out/{case.name}")
        if case.code == "invalid_json":  # the envelope itself is not JSON: there is no reply_to to answer
            assert result is None
        else:
            assert result is not None and result.status == 400 and result.body["error"] == error, case.name


def test_msgpack_values_json_has_no_type_for_get_a_stored_400(
    queues: Queues, engine_under_test: EngineUnderTest
) -> None:
    """Issue 47, row 6, as queue messages: the envelope is read, so the 400 reaches `reply_to`."""
    model = engine_under_test.state.settings.policy.model_name
    sent = {}
    for case in MSGPACK_CASES:
        reply_to = {"s3": f"s3://{queues.bucket}/mp/{case.name}"}
        envelope = {"request_id": case.name, "kind": case.kind, "reply_to": reply_to, "body": case.body(model)}
        sent[queues.send(envelope, as_msgpack=True)] = case
    records = lambda_event(queues, receive_all(queues, len(sent)))["Records"]

    response = process_sqs_batch(records, queue_handler(engine_under_test, queues))

    assert failures(response) == set(sent)
    for case in sent.values():
        stored = queues.s3.get_object(Bucket=queues.bucket, Key=f"mp/{case.name}")["Body"].read()
        result = msgpack.unpackb(stored)  # written in the request's encoding
        assert result["status"] == 400, case.name
        error = result["body"]["error"]
        assert (error["code"], error["param"]) == (case.code, case.param), (case.name, error)
        assert case.message in error["message"]
