"""Work the engine does after it is ready, on threads that leave the CPU to requests."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

# 10, not 19: still ~10 % of a core against busy threads, so a loaded engine gets the work done in seconds.
BACKGROUND_NICE = 10


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
