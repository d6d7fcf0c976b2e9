"""Peak resident memory of this process and every process it started, sampled while a step runs.

A build step's memory is one of the figures `pkg build` reports (and the tests bound): the builder runs in a
child process, so the process tree's sum is what counts, sampled every few milliseconds from /proc.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def tree_rss(root: int | None = None) -> int:
    """Resident bytes of `root` (this process by default) and all its descendants; 0 where /proc is missing."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            pid = int(entry.name)
            children.setdefault(int(fields[1]), []).append(pid)  # fields[1]: the parent's pid
            rss[pid] = int(fields[21]) * _PAGE  # fields[21]: resident pages
        except (OSError, ValueError, IndexError):  # a process that ended while being read
            continue
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, ()))
    return total


class PeakRss:
    """`with PeakRss() as peak:` ... `peak.bytes`: the largest `tree_rss()` seen meanwhile."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)

    def __enter__(self) -> PeakRss:
        self.bytes = tree_rss()
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, tree_rss())

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.bytes = max(self.bytes, tree_rss())


@dataclass(frozen=True)
class SampledRun:
    returncode: int
    peak_rss: int  # bytes: the largest `tree_rss` of the command's process tree seen while it ran
    seconds: float


def run_sampled(
    command: Sequence[str],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | int | None = subprocess.STDOUT,
    interval: float = 0.05,
) -> SampledRun:
    """Run `command` to its end while sampling its process tree's resident memory: the figure `pkg build`,
    `pkg image` and `pkg push` are bounded by, measured from outside, children included. Output goes to files
    (`stdout`, and `stderr`: by default with stdout), never to a pipe this loop would have to drain."""
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True)
    peak = 0
    while process.poll() is None:
        peak = max(peak, tree_rss(process.pid))
        time.sleep(interval)
    return SampledRun(process.returncode, peak, time.monotonic() - started)
