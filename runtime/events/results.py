"""Results keyed by request id and written once, so at-least-once delivery yields exactly one result.

SQS delivers a message at least once: a worker can die after storing a result and before deleting the
message, or a long generation can outlive its visibility timeout and run twice at once. Whatever
happens, a request id gets one result, the first one stored:

- S3 reply (`reply_to.s3`): the result is the object, written with `If-None-Match: *` (a conditional
  put; S3 refuses it with 412 once the key exists). A second writer loses and reads back the winner, so
  a redelivered message never replaces a result, even when sampling would have produced other text.
- SQS reply (`reply_to.sqs`): a queue has no conditional write, so the result is first written to the
  ledger (`results/REQUEST_ID` under the worker's ledger S3 prefix, same conditional put) and the
  ledger's copy is what gets sent. A redelivery re-sends those same bytes: the reply queue may hold
  duplicates, but never two different results. Every reply carries the `request-id` message attribute
  for consumers to deduplicate by; on a FIFO reply queue the request id is also the
  `MessageDeduplicationId`, so SQS itself drops re-sends within its 5-minute window.
  Without a ledger, the queue path still seeds sampling from the request id (see `handler.py`), which
  makes a repeat generation reproduce the first one, but only the ledger guarantees it.

The ledger also keeps why each rejected message failed (`errors/MESSAGE_ID.json`); SQS keeps the message
id when the redrive policy moves a message to the DLQ, so the two can be joined.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from runtime.api.encoding import decode_body
from runtime.api.errors import APIError
from runtime.events.schema import (
    REQUEST_ID_ATTRIBUTE,
    QueueMessage,
    Reply,
    Result,
    S3Target,
    SQSTarget,
    encode,
    media_type,
    message_body,
)

# S3 answers 409 while another conditional write of the same key is in progress; it says to retry.
_CONFLICT_RETRIES = 5
_CONFLICT_BACKOFF = 0.1
_ERROR_BODY_EXCERPT = 4096


@dataclass(frozen=True)
class Ledger:
    bucket: str
    prefix: str  # "" or ending with "/"

    @classmethod
    def from_uri(cls, uri: str) -> Ledger:
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not uri.startswith("s3://") or not bucket:
            raise ValueError(f"a ledger is an S3 prefix s3://BUCKET[/PREFIX], got {uri!r}")
        return cls(bucket, prefix.rstrip("/") + "/" if prefix else "")

    def result_key(self, request_id: str) -> S3Target:
        return S3Target(self.bucket, f"{self.prefix}results/{request_id}")

    def error_key(self, message_id: str) -> S3Target:
        return S3Target(self.bucket, f"{self.prefix}errors/{message_id}.json")


class ResultStore:
    """Write-once results over boto3 S3 and SQS clients (thread-safe; every method blocks on the network)."""

    def __init__(self, s3: Any, sqs: Any, ledger: Ledger | None = None) -> None:
        self._s3 = s3
        self._sqs = sqs
        self.ledger = ledger

    def recorded(self, reply: Reply) -> Result | None:
        """The result already stored for this request, if any."""
        record = self._record_location(reply)
        return None if record is None else self._get(record)

    def deliver(self, reply: Reply, result: Result, *, recorded: bool = False) -> Result:
        """Store `result` unless one exists and send SQS replies; returns the result that is stored.

        `recorded` says `result` came from `recorded()`: an S3 reply is then already in place, and an
        SQS reply is sent again in case the previous attempt stopped between the ledger and the send.
        """
        record = self._record_location(reply)
        stored = result
        if record is not None and not recorded:
            stored = self._put_once(record, result, reply.msgpack)
        if isinstance(reply.reply_to, SQSTarget):
            self._send(reply.reply_to, reply.request_id, stored, reply.msgpack)
        return stored

    def record_rejection(self, message: QueueMessage, error: APIError, request_id: str | None) -> None:
        """Keep why a message was rejected next to the other records (nothing without a ledger)."""
        if self.ledger is None:
            return
        where = self.ledger.error_key(message.message_id)
        note = {
            "message_id": message.message_id,
            "request_id": request_id,
            "receive_count": message.receive_count,
            "error": error.body()["error"],
            "body_excerpt": message.body[:_ERROR_BODY_EXCERPT],
        }
        self._s3.put_object(
            Bucket=where.bucket, Key=where.key, Body=json.dumps(note).encode(), ContentType="application/json"
        )

    def _record_location(self, reply: Reply) -> S3Target | None:
        if isinstance(reply.reply_to, S3Target):
            return reply.reply_to
        return None if self.ledger is None else self.ledger.result_key(reply.request_id)

    def _put_once(self, where: S3Target, result: Result, as_msgpack: bool) -> Result:
        data = encode(result.to_json(), as_msgpack=as_msgpack)
        for attempt in range(_CONFLICT_RETRIES):
            try:
                self._s3.put_object(
                    Bucket=where.bucket, Key=where.key, Body=data, ContentType=media_type(as_msgpack), IfNoneMatch="*"
                )
                return result
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code == "PreconditionFailed":
                    existing = self._get(where)
                    if existing is not None:
                        return existing
                elif code != "ConditionalRequestConflict":
                    raise
            time.sleep(_CONFLICT_BACKOFF * (attempt + 1))
        raise RuntimeError(f"{where} kept conflicting with another writer; the message will be retried")

    def _get(self, where: S3Target) -> Result | None:
        try:
            response = self._s3.get_object(Bucket=where.bucket, Key=where.key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        data = response["Body"].read()
        return Result.from_json(decode_body(data, response.get("ContentType")))

    def _send(self, target: SQSTarget, request_id: str, result: Result, as_msgpack: bool) -> None:
        body, attributes = message_body(result.to_json(), as_msgpack=as_msgpack)
        attributes[REQUEST_ID_ATTRIBUTE] = {"DataType": "String", "StringValue": request_id}
        extra = {"MessageGroupId": request_id, "MessageDeduplicationId": request_id} if target.fifo else {}
        self._sqs.send_message(QueueUrl=target.queue_url, MessageBody=body, MessageAttributes=attributes, **extra)
