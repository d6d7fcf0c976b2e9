"""Work the engine does after it is ready, on threads that leave the CPU to requests."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

# 10, not 19: still ~10 % of a core against busy threads, so a loaded engine gets the work done in seconds.
BACKGROUND_NICE = 10
QUIET_S = 0.5  # idle this long before background work that slows requests (huge pages) goes on
# ... but never wait longer than this for it: a loop busy from the start would otherwise keep the work
# waiting forever, though each piece costs a running batch only milliseconds.
PATIENCE_S = 1.0
# A session built in the background slows what runs beside it for seconds (measured: a first reply of 150
# tokens decoded at 44-46 tok/s with the build starting 1 s into it, 50-52 with it waiting 5 s), so it waits
# longer: a cold start's first reply, often seconds long, then runs alone.
BUILD_PATIENCE_S = 5.0


def lower_priority() -> None:
    """Lower the calling thread's CPU priority (Linux nice values are per thread; threads it creates inherit it)."""
    if hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def run_in_background(work: Callable[[], T], name: str) -> Future[T]:
    """Run `work` on a daemon thread at the background priority; its result or exception lands in the future."""
    done: Future[T] = Future()

    def run() -> None:
        lower_priority()
        try:
            done.set_result(work())
        except BaseException as exc:  # handed to whoever waits on the future
            done.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


class Idleness:
    """Whether the engine's step loop is waiting for work, and since when: background work waits for quiet."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()  # a loop not started yet is idle
        self._since = time.monotonic()

    def enter(self) -> None:
        """The loop waits for work."""
        if not self._idle.is_set():
            self._since = time.monotonic()
            self._idle.set()

    def leave(self) -> None:
        """The loop has work."""
        self._idle.clear()

    def wait_quiet(self, quiet_s: float = QUIET_S, patience_s: float = PATIENCE_S) -> bool:
        """Block until the loop has been idle for `quiet_s` in a row (True), or for at most `patience_s` (False)."""
        deadline = time.monotonic() + patience_s
        while True:
            now = time.monotonic()
            idle = self._idle.is_set()
            if idle and now - self._since >= quiet_s:
                return True
            if now >= deadline:
                return False
            if idle:
                time.sleep(min(quiet_s - (now - self._since), deadline - now))
            else:
                self._idle.wait(deadline - now)
