"""The queue's wire contract: a request envelope in, a result record out, JSON or msgpack.

A request message's body is an envelope:

    {"request_id": "r-123",                       # 1-128 of [A-Za-z0-9._:-]; results are keyed by it
     "kind": "chat" | "completion" | "embedding" | "classification",   # the bundle's task says which
     "body": {...},                               # the OpenAI request body, exactly as sent over HTTP
     "reply_to": {"s3": "s3://bucket/key"} | {"sqs": "https://sqs.../queue"}}

SQS bodies are text, so a msgpack envelope travels base64-encoded with the message attribute
`content-type: application/msgpack`; without that attribute the body is JSON. The result record is
written in the request's encoding:

    {"request_id": "r-123", "status": 200, "body": {...}}   # the HTTP status and body the same request gets
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from runtime.api.encoding import JSON_TYPE, MSGPACK_TYPE, check_text, decode_body, dump_json, is_msgpack
from runtime.api.errors import APIError
from runtime.api.fields import show

CONTENT_TYPE_ATTRIBUTE = "content-type"
REQUEST_ID_ATTRIBUTE = "request-id"
KINDS = ("chat", "completion", "embedding", "classification")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ENVELOPE_FIELDS = ("request_id", "kind", "body", "reply_to")


@dataclass(frozen=True)
class S3Target:
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


@dataclass(frozen=True)
class SQSTarget:
    queue_url: str

    @property
    def fifo(self) -> bool:
        return self.queue_url.endswith(".fifo")

    def __str__(self) -> str:
        return self.queue_url


ReplyTo = S3Target | SQSTarget


@dataclass(frozen=True)
class Reply:
    """Where one request's result goes, and in which encoding (the request's own)."""

    request_id: str
    reply_to: ReplyTo
    msgpack: bool = False


@dataclass(frozen=True)
class Envelope:
    request_id: str
    kind: Literal["chat", "completion", "embedding", "classification"]
    body: dict[str, Any]
    reply_to: ReplyTo
    msgpack: bool = False

    @property
    def reply(self) -> Reply:
        return Reply(self.request_id, self.reply_to, self.msgpack)


@dataclass(frozen=True)
class QueueMessage:
    """One received SQS message, from a worker's ReceiveMessage or a Lambda event record alike."""

    message_id: str
    body: str
    content_type: str | None
    receive_count: int  # 1 on the first delivery

    @classmethod
    def from_sqs(cls, message: dict[str, Any]) -> QueueMessage:
        return cls._read(message, ("MessageId", "Body", "MessageAttributes", "StringValue", "Attributes"))

    @classmethod
    def from_lambda_record(cls, record: dict[str, Any]) -> QueueMessage:
        return cls._read(record, ("messageId", "body", "messageAttributes", "stringValue", "attributes"))

    @classmethod
    def _read(cls, message: dict[str, Any], keys: tuple[str, str, str, str, str]) -> QueueMessage:
        """`keys`: the id, body, attributes map, attribute value and system attributes fields, as the source spells
        them. A map that is absent or null (SQS events carry `messageAttributes: null`) is an empty one; a field of
        the wrong type is a `ValueError`, which fails this message alone."""
        message_id, body, attributes, value, system = keys
        if not isinstance(message.get(message_id), str) or not isinstance(message.get(body), str):
            raise ValueError(f"an SQS message needs {message_id} and {body} strings")
        attribute = _mapping(_mapping(message.get(attributes)).get(CONTENT_TYPE_ATTRIBUTE))
        content_type = attribute.get(value)
        return cls(
            message_id=message[message_id],
            body=message[body],
            content_type=content_type if isinstance(content_type, str) else None,
            receive_count=int(_mapping(message.get(system)).get("ApproximateReceiveCount") or "1"),
        )


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


class MalformedMessage(Exception):
    """A message that can never succeed; carries what could still be read, so the error can be reported there."""

    def __init__(self, error: APIError, *, request_id: str | None = None, reply: Reply | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.request_id = request_id
        self.reply = reply


@dataclass(frozen=True)
class Result:
    request_id: str
    status: int
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.status == 200

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "status": self.status, "body": self.body}

    @classmethod
    def from_json(cls, data: Any) -> Result:
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("status"), int)
            or not isinstance(data.get("body"), dict)
        ):
            raise ValueError(f"not a result record: {show(data)}")
        return cls(request_id=str(data["request_id"]), status=data["status"], body=data["body"])


def encode(obj: Any, *, as_msgpack: bool) -> bytes:
    return msgpack.packb(obj, use_bin_type=True) if as_msgpack else dump_json(obj)


def media_type(as_msgpack: bool) -> str:
    return MSGPACK_TYPE if as_msgpack else JSON_TYPE


def message_body(obj: Any, *, as_msgpack: bool) -> tuple[str, dict[str, Any]]:
    """An SQS message body (text) and its attributes for `obj`."""
    if not as_msgpack:
        return dump_json(obj).decode(), {}
    packed = base64.b64encode(encode(obj, as_msgpack=True)).decode()
    return packed, {CONTENT_TYPE_ATTRIBUTE: {"DataType": "String", "StringValue": MSGPACK_TYPE}}


def read_message_body(body: str, content_type: str | None) -> Any:
    """The object an SQS message body holds; a malformed one is an `APIError` 400 naming the format."""
    if not is_msgpack(content_type):
        # A lone surrogate in the str SQS handed us: invalid UTF-8, so a 400, not a UnicodeEncodeError. Escaped
        # ones are checked field by field in `decode_envelope`, so the rejection can still reach `reply_to`.
        return decode_body(body.encode(errors="surrogatepass"), JSON_TYPE, text=False)
    try:
        raw = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise APIError(400, f"a msgpack message body must be base64: {exc}", code="invalid_msgpack") from exc
    return decode_body(raw, MSGPACK_TYPE, text=False)  # checked part by part, as a JSON envelope is


def decode_envelope(message: QueueMessage, model_name: str) -> Envelope:
    """Validate a message into an `Envelope`; raises `MalformedMessage` (never retried) when it cannot be one.

    A body without `model` gets the served model's name: a queue serves one model, as a SageMaker endpoint does.
    """
    try:
        data = read_message_body(message.body, message.content_type)
    except APIError as err:
        raise MalformedMessage(err) from err
    if not isinstance(data, dict):
        raise MalformedMessage(_invalid(None, f"a queue message must be an envelope object, got {show(data)}"))
    unknown = sorted(set(data) - set(_ENVELOPE_FIELDS), key=str)
    if unknown:
        error = _invalid(str(unknown[0]), f"unknown envelope field {show(unknown[0])}; allowed: {_ENVELOPE_FIELDS}")
        raise MalformedMessage(error)
    request_id = data.get("request_id")
    if not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id):
        raise MalformedMessage(
            _invalid("request_id", f"'request_id' must be 1-128 of [A-Za-z0-9._:-], got {show(request_id)}")
        )
    try:
        check_text(data.get("reply_to"))
        reply_to = parse_reply_to(data.get("reply_to"))
    except APIError as err:
        raise MalformedMessage(err, request_id=request_id) from err
    reply = Reply(request_id, reply_to, is_msgpack(message.content_type))
    kind, body = data.get("kind"), data.get("body")
    if kind not in KINDS:
        error = _invalid("kind", f"'kind' must be one of {', '.join(KINDS)}, got {show(kind)}")
        raise MalformedMessage(error, request_id=request_id, reply=reply)
    if not isinstance(body, dict):
        error = _invalid("body", f"'body' must be an OpenAI {kind} request object, got {show(body)}")
        raise MalformedMessage(error, request_id=request_id, reply=reply)
    try:
        check_text(body)  # the same 400, naming the same field, as the HTTP endpoint's
    except APIError as err:
        raise MalformedMessage(err, request_id=request_id, reply=reply) from err
    body.setdefault("model", model_name)
    return Envelope(request_id, kind, body, reply_to, msgpack=reply.msgpack)


def parse_reply_to(value: Any) -> ReplyTo:
    if isinstance(value, dict) and len(value) == 1:
        ((kind, where),) = value.items()
        if kind == "s3" and isinstance(where, str):
            return parse_s3_uri(where, "reply_to.s3")
        if kind == "sqs" and isinstance(where, str) and where.startswith(("https://", "http://")):
            return SQSTarget(where)
    raise _invalid(
        "reply_to", f"'reply_to' must be {{'s3': 's3://BUCKET/KEY'}} or {{'sqs': 'QUEUE_URL'}}, got {show(value)}"
    )


def parse_s3_uri(uri: str, param: str) -> S3Target:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket or not key:
        raise _invalid(param, f"'{param}' must be an S3 URI s3://BUCKET/KEY, got {show(uri)}")
    return S3Target(bucket, key)


def _invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_envelope")
