"""A client for queue invocation: send one request envelope to a function's SQS queue and wait for its result.

The result goes where the envelope's `reply_to` says: an S3 key (polled until it exists) or an SQS queue
(long-polled for the message whose `request-id` attribute matches). Without an explicit `reply_to`, a
temporary reply queue is created for this one request and deleted afterwards. The AWS endpoint comes
from boto3's usual configuration (`AWS_ENDPOINT_URL`, region and credentials from the environment).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from packager.errors import UserError
from runtime.api.errors import APIError
from runtime.events.schema import (
    REQUEST_ID_ATTRIBUTE,
    Reply,
    Result,
    S3Target,
    SQSTarget,
    message_body,
    parse_reply_to,
    parse_s3_uri,
    read_message_body,
)

_S3_POLL_SECONDS = 0.5


def invoke_via_queue(
    queue_url: str, kind: str, body: dict[str, Any], *, reply_to: str | None = None, timeout: float = 300.0
) -> Result:
    """Send `body` (an OpenAI chat or completion body) through `queue_url` and return its result record."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    sqs, s3 = boto3.client("sqs"), boto3.client("s3")
    request_id = f"invoke-{uuid.uuid4().hex}"
    try:
        with _reply_target(sqs, reply_to, request_id) as target:
            where = {"s3": str(target)} if isinstance(target, S3Target) else {"sqs": target.queue_url}
            envelope = {"request_id": request_id, "kind": kind, "body": body, "reply_to": where}
            text, attributes = message_body(envelope, as_msgpack=False)
            sqs.send_message(QueueUrl=queue_url, MessageBody=text, MessageAttributes=attributes)
            deadline = time.monotonic() + timeout
            if isinstance(target, S3Target):
                return _wait_s3(s3, target, deadline)
            return _wait_sqs(sqs, target, request_id, deadline)
    except (BotoCoreError, ClientError) as exc:
        raise UserError(f"queue invocation through {queue_url} failed: {exc}") from exc


@contextmanager
def _reply_target(sqs: Any, reply_to: str | None, request_id: str) -> Iterator[S3Target | SQSTarget]:
    if reply_to is not None:
        try:
            given = (
                parse_s3_uri(reply_to, "--reply-to")
                if reply_to.startswith("s3://")
                else parse_reply_to({"sqs": reply_to})
            )
        except APIError as err:
            raise UserError(f"--reply-to: {err.message}", exit_code=2) from err
        yield given
        return
    url = sqs.create_queue(QueueName=f"onnxfn-reply-{request_id.removeprefix('invoke-')[:32]}")["QueueUrl"]
    try:
        yield SQSTarget(url)
    finally:
        sqs.delete_queue(QueueUrl=url)


def _wait_s3(s3: Any, target: S3Target, deadline: float) -> Result:
    from runtime.events.results import ResultStore

    store = ResultStore(s3, None)
    reply = Reply("", target)
    while time.monotonic() < deadline:
        recorded = store.recorded(reply)
        if recorded is not None:
            return recorded
        time.sleep(_S3_POLL_SECONDS)
    raise UserError(f"no result at {target} yet; is a worker or the Lambda function consuming the queue?")


def _wait_sqs(sqs: Any, target: SQSTarget, request_id: str, deadline: float) -> Result:
    while (left := deadline - time.monotonic()) > 0:
        response = sqs.receive_message(
            QueueUrl=target.queue_url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=max(0, min(20, int(left))),
            MessageAttributeNames=["All"],
        )
        for message in response.get("Messages", []):
            attributes = message.get("MessageAttributes", {})
            if attributes.get(REQUEST_ID_ATTRIBUTE, {}).get("StringValue") != request_id:
                # Another client's reply on a shared queue: hand it back at once.
                sqs.change_message_visibility(
                    QueueUrl=target.queue_url, ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=0
                )
                continue
            sqs.delete_message(QueueUrl=target.queue_url, ReceiptHandle=message["ReceiptHandle"])
            content_type = attributes.get("content-type", {}).get("StringValue")
            return Result.from_json(read_message_body(message["Body"], content_type))
    raise UserError(f"no reply on {target.queue_url} yet; is a worker or the Lambda function consuming the queue?")
