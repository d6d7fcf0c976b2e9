"""The long-poll SQS worker: what containers and edge devices run to serve a queue.

It keeps up to `max_in_flight` messages (the engine's slots) in the engine at once, so queued requests
are batched continuously exactly like concurrent HTTP requests. While a message is in flight a
heartbeat keeps extending its visibility, so a generation longer than the visibility timeout is never
handed to a second consumer. A message is deleted only after its result is stored (`handler.py`).

`stop()` (SIGTERM, SIGINT) stops receiving at once, gives in-flight messages `drain_timeout` seconds to
finish, then cancels the rest in the engine and makes them visible again for another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from runtime.events.handler import Handled, Outcome, QueueHandler
from runtime.events.schema import CONTENT_TYPE_ATTRIBUTE, QueueMessage

log = logging.getLogger("runtime.events")

_SQS_MAX_BATCH = 10


@dataclass(frozen=True)
class WorkerConfig:
    queue_url: str
    max_in_flight: int = 8  # the engine's slots
    visibility_timeout: int = 60  # seconds a received message stays hidden; extended while it runs
    wait_time: int = 20  # long-poll seconds (SQS allows 0-20)
    drain_timeout: float = 30.0  # on stop, seconds in-flight messages get to finish
    retry_delay: int = 5  # seconds before a transiently failed message is visible again

    @property
    def heartbeat(self) -> float:
        """Extend well before expiry: a third of the timeout leaves two chances if one call is slow."""
        return max(self.visibility_timeout / 3, 0.2)


@dataclass
class _InFlight:
    message: QueueMessage
    receipt: str
    task: asyncio.Task[Handled] | None = None


@dataclass
class WorkerStats:
    received: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.perf_counter)


class Worker:
    def __init__(self, sqs: Any, handler: QueueHandler, config: WorkerConfig) -> None:
        self._sqs = sqs
        self._handler = handler
        self.config = config
        self.stats = WorkerStats()
        self._in_flight: dict[str, _InFlight] = {}  # received and not yet settled
        self._in_engine: set[str] = set()  # of those, the ones still generating
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """Begin a graceful shutdown; call from the worker's event loop (signal handlers run there)."""
        if not self._stopping.is_set():
            log.info("stopping: no new messages; %d in flight", len(self._in_flight))
        self._stopping.set()

    async def run(self) -> WorkerStats:
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            await self._receive_loop()
            await self._drain()
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        return self.stats

    async def _receive_loop(self) -> None:
        stop = asyncio.create_task(self._stopping.wait())
        try:
            while not self._stopping.is_set():
                free = self._free_slots()
                if free <= 0:
                    self._slot_freed.clear()
                    freed = asyncio.create_task(self._slot_freed.wait())
                    await asyncio.wait({stop, freed}, return_when="FIRST_COMPLETED")
                    freed.cancel()
                    continue
                poll = asyncio.create_task(asyncio.to_thread(self._receive, min(free, _SQS_MAX_BATCH)))
                await asyncio.wait({poll, stop}, return_when="FIRST_COMPLETED")
                try:
                    # A poll under way when the stop came still ends within `wait_time`: what it got is released.
                    messages = await poll
                except Exception as exc:
                    log.warning("receiving from %s failed: %r; retrying", self.config.queue_url, exc)
                    await asyncio.wait({stop}, timeout=1.0)
                    continue
                for raw in messages:
                    self._start(raw)
        finally:
            stop.cancel()

    def _free_slots(self) -> int:
        """Engine slots not taken by a received message; messages whose results are being stored no longer
        hold one, but at most as many again may be storing, so a slow store cannot pile up received messages."""
        limit = self.config.max_in_flight
        return min(limit - len(self._in_engine), 2 * limit - len(self._in_flight))

    def _left_engine(self, message_id: str) -> None:
        self._in_engine.discard(message_id)
        self._slot_freed.set()

    def _receive(self, count: int) -> list[dict[str, Any]]:
        response = self._sqs.receive_message(
            QueueUrl=self.config.queue_url,
            MaxNumberOfMessages=count,
            WaitTimeSeconds=self.config.wait_time,
            VisibilityTimeout=self.config.visibility_timeout,
            AttributeNames=["ApproximateReceiveCount"],
            MessageAttributeNames=[CONTENT_TYPE_ATTRIBUTE],
        )
        return list(response.get("Messages", []))

    def _start(self, raw: dict[str, Any]) -> None:
        message = QueueMessage.from_sqs(raw)
        self.stats.received += 1
        entry = _InFlight(message, raw["ReceiptHandle"])
        self._in_flight[message.message_id] = entry
        self._in_engine.add(message.message_id)
        if self._stopping.is_set():
            entry.task = asyncio.create_task(self._released(entry))
        else:
            entry.task = asyncio.create_task(self._process(entry))

    async def _released(self, entry: _InFlight) -> Handled:
        await self._settle(entry, Handled(Outcome.RETRY, error="the worker is stopping"), delay=0)
        return Handled(Outcome.RETRY)

    async def _process(self, entry: _InFlight) -> Handled:
        message_id = entry.message.message_id
        try:
            handled = await self._handler.handle(entry.message, left_engine=lambda: self._left_engine(message_id))
        except asyncio.CancelledError:
            # Cancelled by the drain: the engine aborted the generation; hand the message to another worker.
            await asyncio.shield(self._settle(entry, Handled(Outcome.RETRY, error="cancelled at shutdown"), delay=0))
            raise
        if handled.outcome is Outcome.RETRY:
            log.warning(
                "message %s: will retry in %d s: %s", entry.message.message_id, self.config.retry_delay, handled.error
            )
        delay = {Outcome.REJECTED: 0, Outcome.RETRY: self.config.retry_delay}.get(handled.outcome, 0)
        await self._settle(entry, handled, delay=delay)
        return handled

    async def _settle(self, entry: _InFlight, handled: Handled, *, delay: int) -> None:
        """Delete a done message; make any other visible again after `delay` seconds (0: at once, which for
        a rejected message means the next receive counts toward `maxReceiveCount` without waiting)."""
        queue = self.config.queue_url
        try:
            if handled.outcome is Outcome.DONE:
                await asyncio.to_thread(self._sqs.delete_message, QueueUrl=queue, ReceiptHandle=entry.receipt)
            else:
                await asyncio.to_thread(
                    self._sqs.change_message_visibility,
                    QueueUrl=queue,
                    ReceiptHandle=entry.receipt,
                    VisibilityTimeout=delay,
                )
        except Exception as exc:
            # The message reappears when its visibility runs out; its stored result makes the retry a no-op.
            log.warning(
                "message %s: settling it as %s failed: %r", entry.message.message_id, handled.outcome.value, exc
            )
        finally:
            self.stats.outcomes[handled.outcome.value] += 1
            self._in_flight.pop(entry.message.message_id, None)
            self._left_engine(entry.message.message_id)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat)
            entries = list(self._in_flight.values())
            for start in range(0, len(entries), _SQS_MAX_BATCH):
                batch = entries[start : start + _SQS_MAX_BATCH]
                try:
                    await asyncio.to_thread(self._extend, batch)
                except Exception as exc:
                    log.warning("extending visibility failed: %r", exc)

    def _extend(self, batch: list[_InFlight]) -> None:
        entries = [
            {"Id": str(i), "ReceiptHandle": e.receipt, "VisibilityTimeout": self.config.visibility_timeout}
            for i, e in enumerate(batch)
        ]
        response = self._sqs.change_message_visibility_batch(QueueUrl=self.config.queue_url, Entries=entries)
        for failure in response.get("Failed", []):
            message_id = batch[int(failure["Id"])].message.message_id
            if message_id in self._in_flight:  # otherwise it was settled meanwhile and its handle is spent
                log.warning("extending visibility of %s failed: %s", message_id, failure)

    async def _drain(self) -> None:
        tasks = [e.task for e in self._in_flight.values() if e.task is not None]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.config.drain_timeout)
        if pending:
            log.info("drain timeout: releasing %d unfinished messages", len(pending))
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
