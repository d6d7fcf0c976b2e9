"""Micro-batching: rows of all waiting requests share forwards, grouped by length, on one worker thread.

On a CPU the encoder is compute-bound, so every padding token is paid in full: a batch of 32 mixed
lengths padded to its longest row ran 2x slower than 32 single forwards. Each forward therefore takes
the oldest waiting row and the rows closest to it in length (from any request), up to `max_rows` and
as long as padding stays under `max_padding` of the tokens computed. The oldest row always goes next,
so a long input is never starved by a stream of short ones. No forward waits for more rows to arrive:
rows that come in while one runs form the next.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from runtime.engine.request import EngineOverloadedError

Embed = Callable[[Sequence[Sequence[int]]], np.ndarray]


@dataclass
class _Job:
    rows: list[list[int]]
    future: Future[np.ndarray]
    vectors: list[np.ndarray | None] = field(default_factory=list)
    remaining: int = 0


@dataclass(frozen=True)
class _Row:
    job: _Job
    index: int

    @property
    def length(self) -> int:
        return len(self.job.rows[self.index])


@dataclass(frozen=True)
class BatcherStats:
    queued_requests: int
    queued_rows: int
    forwards: int
    rows: int
    tokens: int  # real tokens embedded (padding excluded)
    padded_tokens: int  # tokens computed, padding included
    last_batch_size: int


class LengthBatcher:
    def __init__(self, embed: Embed, *, max_rows: int = 8, max_queue: int = 64, max_padding: float = 0.25) -> None:
        self._embed = embed
        self._max_rows = max_rows
        self._max_queue = max_queue
        self._max_padding = max_padding
        self._pending: list[_Row] = []  # arrival order
        self._jobs = 0
        self._wake = threading.Condition()
        self._closed = False
        self._forwards = self._rows = self._tokens = self._padded = self._last = 0
        self._thread = threading.Thread(target=self._loop, name="onnxfn-encoder", daemon=True)
        self._thread.start()

    def submit(self, rows: list[list[int]]) -> Future[np.ndarray]:
        """Embed `rows` (token ids, special tokens included); the future yields `[len(rows), dims]`."""
        job = _Job(rows=rows, future=Future(), vectors=[None] * len(rows), remaining=len(rows))
        with self._wake:
            if self._closed:
                raise RuntimeError("the encoder is shut down")
            if self._jobs >= self._max_queue:
                # A forward of a few rows takes milliseconds; a second is ample for the queue to drain.
                raise EngineOverloadedError(
                    f"{self._jobs} requests are waiting (the limit); retry shortly", retry_after=1.0
                )
            self._jobs += 1
            self._pending.extend(_Row(job, i) for i in range(len(rows)))
            self._wake.notify()
        return job.future

    def stats(self) -> BatcherStats:
        with self._wake:
            return BatcherStats(
                self._jobs, len(self._pending), self._forwards, self._rows, self._tokens, self._padded, self._last
            )

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    for row in self._pending:
                        if not row.job.future.done():
                            row.job.future.set_exception(RuntimeError("the encoder shut down"))
                    return
                group = self._next_group()
            self._run(group)

    def _next_group(self) -> list[_Row]:
        """The oldest row and its nearest neighbours in length, within the row and padding limits."""
        anchor = self._pending[0]
        nearest = sorted(self._pending[1:], key=lambda r: abs(r.length - anchor.length))
        group, width, real = [anchor], anchor.length, anchor.length
        for row in nearest:
            if len(group) == self._max_rows:
                break
            new_width = max(width, row.length)
            computed = new_width * (len(group) + 1)
            if computed - (real + row.length) <= self._max_padding * computed:
                group.append(row)
                width, real = new_width, real + row.length
        taken = {id(r) for r in group}
        self._pending = [r for r in self._pending if id(r) not in taken]
        return group

    def _run(self, group: list[_Row]) -> None:
        rows = [r.job.rows[r.index] for r in group]
        try:
            vectors = self._embed(rows)
        except Exception as exc:  # the session failed: every request with a row here fails with it
            failed = {id(r.job): r.job for r in group}
            with self._wake:
                self._pending = [r for r in self._pending if id(r.job) not in failed]
                self._jobs -= sum(1 for job in failed.values() if not job.future.done())
            for job in failed.values():
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        finished: list[_Job] = []
        with self._wake:
            self._forwards += 1
            self._rows += len(rows)
            self._tokens += sum(map(len, rows))
            self._padded += max(map(len, rows)) * len(rows)
            self._last = len(rows)
            for row, vector in zip(group, vectors, strict=True):
                row.job.vectors[row.index] = vector
                row.job.remaining -= 1
                if row.job.remaining == 0:
                    finished.append(row.job)
            self._jobs -= len(finished)
        for job in finished:
            job.future.set_result(np.stack(job.vectors))  # type: ignore[arg-type]
