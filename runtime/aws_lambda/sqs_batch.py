"""A Lambda SQS batch: every record through the queue handler at once, failures reported per record.

Every record is submitted to the engine at once, so the batch decodes together (continuous batching), and
the reply is the partial-batch response `{"batchItemFailures": [...]}` naming exactly the records whose
result was not stored (the event source mapping needs `ReportBatchItemFailures`). Lambda deletes the
others; the failed ones come back after their visibility timeout, and the redrive policy sends a record
that keeps failing to the DLQ.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from runtime.aws_lambda.invocation_loop import InvocationLoop
from runtime.events.handler import Handled, Outcome, QueueHandler
from runtime.events.schema import QueueMessage

log = logging.getLogger("runtime.aws_lambda")


def is_sqs_batch(event: Any) -> bool:
    records = event.get("Records") if isinstance(event, dict) else None
    return (
        isinstance(records, list)
        and bool(records)
        and all(isinstance(r, dict) and r.get("eventSource") == "aws:sqs" for r in records)
    )


def process_sqs_batch(
    records: Sequence[dict[str, Any]],
    queue_handler: QueueHandler,
    *,
    time_left: float | None = None,
    loop: InvocationLoop | None = None,
) -> dict[str, Any]:
    """Handle every record concurrently (on `loop`, else a loop of its own); the response names each record not
    finished with a stored result. Records still running after `time_left` seconds are cancelled and reported."""
    runner = loop or InvocationLoop()
    try:
        # One thread per record's storage calls, so a slow S3 put never queues another record's.
        return runner.run(_process(records, queue_handler, time_left), threads=len(records) + 2)
    finally:
        if loop is None:
            runner.close()


async def _process(
    records: Sequence[dict[str, Any]], queue_handler: QueueHandler, time_left: float | None
) -> dict[str, Any]:
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
