"""A rich progress bar per device, and the per-device result table."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn
from rich.table import Table

from packager.edge.fleet import DeviceResult
from packager.errors import UserError

_STYLES = {"installed": "green", "rolled_back": "green", "unchanged": "dim", "refused": "red"}


class DeviceProgress:
    def __init__(self, console: Console, devices: Sequence[str]) -> None:
        self._progress = Progress(
            TextColumn("{task.fields[device]}"),
            TextColumn("[cyan]{task.fields[phase]:<10}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=console,
        )
        self._tasks: dict[str, TaskID] = {
            device: self._progress.add_task("", total=None, device=device, phase="waiting") for device in devices
        }
        self._lock = threading.Lock()  # updates arrive from one thread per device

    def update(self, device: str, phase: str, done: int, total: int) -> None:
        with self._lock:
            self._progress.update(self._tasks[device], completed=done, total=total, phase=phase)

    def __enter__(self) -> DeviceProgress:
        self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._progress.stop()


def print_results(console: Console, title: str, results: list[DeviceResult], *, footer: str = "") -> int:
    """The table, each device's detail, then `footer`; raises `UserError` naming every device that failed."""
    table = Table(title=title)
    for column in ("device", "result", "serving", "sent MB", "resumed at MB", "upload s", "install s"):
        table.add_column(column, overflow="fold")
    for r in results:
        style = _STYLES.get(r.outcome, "red")
        table.add_row(
            r.device,
            f"[{style}]{r.outcome}[/]",
            r.digest[7:19] if r.digest else "-",
            f"{r.sent / 1e6:.1f}",
            f"{r.resumed_from / 1e6:.1f}",
            f"{r.upload_seconds:.2f}",
            f"{r.install_seconds:.2f}",
        )
    console.print(table)
    for r in results:
        if r.ok and r.detail:
            console.print(f"[dim]{r.device}: {r.detail}[/]", highlight=False)
    if footer:
        console.print(f"[dim]{footer}[/]", highlight=False)
    failed = [r for r in results if not r.ok]
    if failed:
        reasons = "\n".join(f"  - {r.device} ({r.outcome}): {r.detail}" for r in failed)
        raise UserError(f"{len(failed)} of {len(results)} device(s) failed:\n{reasons}")
    return 0
