"""AWS Lambda entry point (`runtime.events.lambda_handler.handler`), run by `awslambdaric`.

An SQS batch is processed concurrently: every record is submitted to the engine at once, so the batch
decodes together (continuous batching), and the reply is the partial-batch response
`{"batchItemFailures": [...]}` naming exactly the records whose result was not stored (the event
source mapping needs `ReportBatchItemFailures`). Lambda deletes the others; the failed ones come back
after their visibility timeout, and the redrive policy sends a record that keeps failing to the DLQ.

Configuration is the environment: `ONNXFN_BUNDLE` (default `/opt/onnxfn/bundle`, where the image puts
it) and `ONNXFN_FLAGS`, the worker's model and AWS flags as one shell-quoted string. The engine loads once
per execution environment, on the first invocation, and serves every later one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from runtime.events.handler import Handled, Outcome, QueueHandler
from runtime.events.schema import QueueMessage

log = logging.getLogger("runtime.events")

BUNDLE_ENV = "ONNXFN_BUNDLE"
FLAGS_ENV = "ONNXFN_FLAGS"
DEFAULT_BUNDLE = "/opt/onnxfn/bundle"
# Seconds kept back from the invocation's deadline to cancel unfinished records and report them as failed.
DEADLINE_MARGIN = 5.0

_queue_handler: QueueHandler | None = None


def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    if is_sqs_batch(event):
        time_left = _time_left(context)
        return process_sqs_batch(event["Records"], _loaded_handler(), time_left=time_left)
    # API Gateway and Function URL HTTP events will be dispatched here into the ASGI app (through mangum).
    raise ValueError(f"unsupported Lambda event: expected an SQS batch, got keys {sorted(event)[:10]}")


def is_sqs_batch(event: Any) -> bool:
    records = event.get("Records") if isinstance(event, dict) else None
    return bool(records) and all(isinstance(r, dict) and r.get("eventSource") == "aws:sqs" for r in records)


def process_sqs_batch(
    records: Sequence[dict[str, Any]], queue_handler: QueueHandler, *, time_left: float | None = None
) -> dict[str, Any]:
    """Handle every record concurrently; the response names each record not finished with a stored result."""
    return asyncio.run(_process(records, queue_handler, time_left))


async def _process(
    records: Sequence[dict[str, Any]], queue_handler: QueueHandler, time_left: float | None
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=len(records) + 2, thread_name_prefix="onnxfn-aws"))
    tasks: dict[str, asyncio.Task[Handled]] = {}
    failed: list[str] = []
    for record in records:
        try:
            message = QueueMessage.from_lambda_record(record)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("unreadable SQS record %s: %r", record.get("messageId"), exc)
            failed.append(str(record.get("messageId")))
            continue
        tasks[message.message_id] = asyncio.create_task(queue_handler.handle(message))
    if tasks:
        _, pending = await asyncio.wait(tasks.values(), timeout=time_left)
        for task in pending:
            task.cancel()  # aborts its generation in the engine; the record is retried
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    for message_id, task in tasks.items():
        if not _stored(task):
            failed.append(message_id)
    return {"batchItemFailures": [{"itemIdentifier": message_id} for message_id in failed]}


def _stored(task: asyncio.Task[Handled]) -> bool:
    if task.cancelled():
        return False
    if task.exception() is not None:
        log.error("a record's handler failed", exc_info=task.exception())
        return False
    return task.result().outcome is Outcome.DONE


def _time_left(context: Any) -> float | None:
    remaining = getattr(context, "get_remaining_time_in_millis", None)
    return None if remaining is None else max(remaining() / 1000 - DEADLINE_MARGIN, 1.0)


def _loaded_handler() -> QueueHandler:
    global _queue_handler
    if _queue_handler is None:
        from runtime.events.loading import load_handler

        logging.basicConfig(level=logging.INFO)
        args = lambda_arguments(shlex.split(os.environ.get(FLAGS_ENV, "")))
        _queue_handler = load_handler(Path(os.environ.get(BUNDLE_ENV, DEFAULT_BUNDLE)), args)
    return _queue_handler


def lambda_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """`ONNXFN_FLAGS` parsed with the same flags the worker takes for the model and AWS."""
    from runtime.events.loading import add_aws_arguments
    from runtime.server.serve import add_model_arguments

    parser = argparse.ArgumentParser(prog=FLAGS_ENV, description="flags for the Lambda handler")
    add_aws_arguments(parser)
    add_model_arguments(parser)
    return parser.parse_args(argv)
