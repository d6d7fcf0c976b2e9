"""Work on a daemon thread whose result or exception lands in a `Future`: the engine's background work and
the frontends' model loading both start this way; and a thread's CPU priority, lowered for such work.
Standard library only, so a frontend can start a load before it has imported anything heavy."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

# 10, not 19: still ~10 % of a core against busy threads, so a loaded engine gets the work done in seconds.
BACKGROUND_NICE = 10


def in_thread(work: Callable[[], T], name: str) -> Future[T]:
    """Start `work` on a daemon thread named `name` now; its result or exception lands in the future."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as exc:  # handed to whoever waits on the future
            done.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def lower_priority() -> None:
    """Lower the calling thread's CPU priority (Linux nice values are per thread; threads it creates inherit it)."""
    if hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
