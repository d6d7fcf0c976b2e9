"""Progress bars and step timings for long packager steps (rich), kept out of the steps themselves.

A step reports through a callback `(done, total)`; the CLI decides how it looks. Every step's wall
time and whether it came from the cache end up in the final summary table.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


@dataclass
class StepRecord:
    name: str
    seconds: float = 0.0
    cached: bool = False
    detail: str = ""


class StepHandle:
    def __init__(self, progress: Progress, task_id: int, record: StepRecord) -> None:
        self._progress = progress
        self._task_id = task_id
        self.record = record

    def update(self, done: int, total: int) -> None:
        self._progress.update(self._task_id, completed=done, total=total)

    def cached(self, detail: str = "") -> None:
        self.record.cached = True
        self.record.detail = detail or self.record.detail


@dataclass
class StepProgress:
    console: Console = field(default_factory=lambda: Console(stderr=True))
    records: list[StepRecord] = field(default_factory=list)

    @contextmanager
    def step(self, name: str, description: str) -> Iterator[StepHandle]:
        record = StepRecord(name)
        self.records.append(record)
        start = time.perf_counter()
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        ) as progress:
            task_id = progress.add_task(description, total=None)
            handle = StepHandle(progress, task_id, record)
            yield handle
        record.seconds = time.perf_counter() - start
        mark = "[dim](cached)[/]" if record.cached else ""
        self.console.print(f"[green]✓[/] {description} {mark} [dim]{record.seconds:.1f}s[/]", highlight=False)
