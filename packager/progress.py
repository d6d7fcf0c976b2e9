"""Progress bars and step timings for long packager steps (rich), kept out of the steps themselves.

A step reports through a callback `(done, total)`; the CLI decides how it looks. Every step's wall
time and whether it came from the cache end up in the final summary table.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from packager.memory import PeakRss
from packager.spec import FunctionSpec


@dataclass
class StepRecord:
    name: str
    seconds: float = 0.0
    cached: bool = False
    detail: str = ""
    peak_rss: int = 0  # bytes: this process and its children, the largest sum sampled during the step


class _Count(ProgressColumn):
    """`done/total` once a step reports a total; nothing while it is unknown (a spinner step)."""

    def render(self, task: Task) -> Text:
        return Text("" if task.total is None else f"{int(task.completed)}/{int(task.total)}")


class StepHandle:
    def __init__(self, progress: Progress | None, task_id: TaskID | None, record: StepRecord) -> None:
        self._progress = progress  # None: no live display (stderr is not a terminal)
        self._task_id = task_id
        self.record = record

    def update(self, done: int, total: int) -> None:
        if self._progress is not None and self._task_id is not None:
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
        with PeakRss() as peak, self._display(description, record) as handle:
            yield handle
        record.seconds = time.perf_counter() - start
        record.peak_rss = peak.bytes
        mark = "[dim](cached)[/]" if record.cached else ""
        memory = f", peak RSS {record.peak_rss / 2**30:.2f} GiB" if not record.cached else ""
        self.console.print(f"[green]✓[/] {description} {mark} [dim]{record.seconds:.1f}s{memory}[/]", highlight=False)

    @contextmanager
    def _display(self, description: str, record: StepRecord) -> Iterator[StepHandle]:
        if not self.console.is_terminal:  # a log or a pipe: the ✓ line alone, no spinner frames or blank lines
            yield StepHandle(None, None, record)
        else:
            with Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                _Count(),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            ) as progress:
                yield StepHandle(progress, progress.add_task(description, total=None), record)


class _Candidate(Protocol):
    @property
    def precision(self) -> str: ...
    @property
    def failures(self) -> Sequence[str]: ...


class _Built(Protocol):
    """What every build result (decoder or encoder) offers the summary's last lines (read-only: results are frozen)."""

    @property
    def spec(self) -> FunctionSpec: ...
    @property
    def candidates(self) -> Sequence[_Candidate]: ...
    @property
    def bundle(self) -> Path: ...
    @property
    def bundle_reused(self) -> bool: ...


def print_build_outcome(console: Console, result: _Built, progress: StepProgress, elapsed: float) -> None:
    """The tail of every `pkg build` summary: why candidates failed, the steps with their cache use, the bundle."""
    for candidate in result.candidates:
        for failure in candidate.failures:
            console.print(f"  [red]{candidate.precision}[/]: {failure}", highlight=False)
    steps = Table(title="steps")
    for column in ("step", "seconds", "share", "peak RSS GiB", "cache"):
        steps.add_column(column)
    for record in progress.records:
        share = f"{100 * record.seconds / elapsed:.0f}%" if elapsed > 0 else ""
        memory = "" if record.cached else f"{record.peak_rss / 2**30:.2f}"
        steps.add_row(record.name, f"{record.seconds:.1f}", share, memory, "reused" if record.cached else "built")
    peak = max((r.peak_rss for r in progress.records), default=0)
    steps.add_row("[bold]total[/]", f"[bold]{elapsed:.1f}[/]", "", f"[bold]{peak / 2**30:.2f}[/]", "")
    console.print(steps)
    state = "reused unchanged" if result.bundle_reused else "written"
    console.print(f"bundle {state}: [bold]{result.bundle}[/]", highlight=False)
    console.print(f"serve it with: pkg deploy {result.spec.directory} --target local", highlight=False)
