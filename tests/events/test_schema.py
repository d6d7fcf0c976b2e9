"""The envelope and result contract, without AWS: every malformed message names what is wrong."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgpack
import pytest

from runtime.events.schema import (
    MalformedMessage,
    QueueMessage,
    Result,
    S3Target,
    SQSTarget,
    decode_envelope,
    message_body,
    read_message_body,
)

MODEL = "smollm2-chat"
GOOD: dict[str, Any] = {
    "request_id": "r-1",
    "kind": "chat",
    "body": {"messages": [{"role": "user", "content": "hi"}]},
    "reply_to": {"s3": "s3://bucket/results/r-1.json"},
}


def message(body: str, content_type: str | None = None) -> QueueMessage:
    return QueueMessage(message_id="m-1", body=body, content_type=content_type, receive_count=1)


def decode(envelope: Any) -> Any:
    return decode_envelope(message(json.dumps(envelope)), MODEL)


def test_json_envelope_fills_in_the_served_model() -> None:
    envelope = decode(GOOD)
    assert envelope.request_id == "r-1"
    assert envelope.kind == "chat"
    assert envelope.reply_to == S3Target("bucket", "results/r-1.json")
    assert envelope.body["model"] == MODEL
    assert envelope.msgpack is False


def test_msgpack_envelope_travels_base64_with_its_content_type() -> None:
    envelope_json = {**GOOD, "reply_to": {"sqs": "http://127.0.0.1:1/123/replies.fifo"}}
    body, attributes = message_body(envelope_json, as_msgpack=True)
    assert msgpack.unpackb(base64.b64decode(body)) == envelope_json
    content_type = attributes["content-type"]["StringValue"]
    envelope = decode_envelope(message(body, content_type), MODEL)
    assert envelope.msgpack is True
    assert envelope.reply_to == SQSTarget("http://127.0.0.1:1/123/replies.fifo")
    assert envelope.reply_to.fifo


@pytest.mark.parametrize(
    ("raw", "content_type", "param", "fragment"),
    [
        ("{not json", None, None, "not valid JSON"),
        ("", None, None, "empty"),
        ("!!!", "application/msgpack", None, "base64"),
        (base64.b64encode(b"\xc1").decode(), "application/msgpack", None, "not valid msgpack"),
        ("[1, 2]", None, None, "envelope object"),
        (json.dumps({**GOOD, "extra": 1}), None, "extra", "unknown envelope field"),
        (json.dumps({**GOOD, "request_id": "has space"}), None, "request_id", "[A-Za-z0-9._:-]"),
        (json.dumps({**GOOD, "request_id": "x" * 129}), None, "request_id", "1-128"),
        (json.dumps({**GOOD, "reply_to": {"s3": "bucket/key"}}), None, "reply_to.s3", "s3://BUCKET/KEY"),
        (json.dumps({**GOOD, "reply_to": {"s3": "s3://bucket/"}}), None, "reply_to.s3", "s3://BUCKET/KEY"),
        (json.dumps({**GOOD, "reply_to": {"ftp": "x"}}), None, "reply_to", "'sqs'"),
        (json.dumps({**GOOD, "kind": "rerank"}), None, "kind", "chat, completion, embedding, classification"),
        (json.dumps({**GOOD, "body": "hi"}), None, "body", "OpenAI chat request object"),
    ],
)
def test_malformed_messages_are_rejected_with_the_field_named(
    raw: str, content_type: str | None, param: str | None, fragment: str
) -> None:
    with pytest.raises(MalformedMessage) as caught:
        decode_envelope(message(raw, content_type), MODEL)
    error = caught.value.error
    assert error.status == 400
    assert error.param == param
    assert fragment in error.message


def test_a_malformed_envelope_keeps_what_is_needed_to_report_the_error() -> None:
    with pytest.raises(MalformedMessage) as caught:
        decode({**GOOD, "kind": "rerank"})
    assert caught.value.request_id == "r-1"
    assert caught.value.reply is not None
    assert caught.value.reply.reply_to == S3Target("bucket", "results/r-1.json")
    with pytest.raises(MalformedMessage) as caught:
        decode({**GOOD, "reply_to": None})
    assert caught.value.request_id == "r-1"
    assert caught.value.reply is None


def test_lambda_records_and_sqs_messages_read_alike() -> None:
    from_sqs = QueueMessage.from_sqs(
        {
            "MessageId": "m-9",
            "Body": "b",
            "Attributes": {"ApproximateReceiveCount": "3"},
            "MessageAttributes": {"content-type": {"StringValue": "application/msgpack", "DataType": "String"}},
        }
    )
    from_lambda = QueueMessage.from_lambda_record(
        {
            "messageId": "m-9",
            "body": "b",
            "attributes": {"ApproximateReceiveCount": "3"},
            "messageAttributes": {"content-type": {"stringValue": "application/msgpack", "dataType": "String"}},
            "eventSource": "aws:sqs",
        }
    )
    assert from_sqs == from_lambda == QueueMessage("m-9", "b", "application/msgpack", 3)


def test_result_records_round_trip_and_refuse_other_objects() -> None:
    result = Result("r-1", 200, {"object": "chat.completion"})
    assert Result.from_json(read_message_body(*_as_message(result.to_json()))) == result
    with pytest.raises(ValueError, match="not a result record"):
        Result.from_json({"request_id": "r-1", "status": "200", "body": {}})


def _as_message(obj: Any) -> tuple[str, str]:
    body, attributes = message_body(obj, as_msgpack=True)
    return body, attributes["content-type"]["StringValue"]
