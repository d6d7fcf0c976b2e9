"""The one event loop every invocation of a Lambda execution environment runs on.

Mangum drives the ASGI app on the thread's current event loop and the SQS path runs its batch on the same
one, so asyncio state (the default executor's threads, the app's anyio resources) lives as long as the
execution environment instead of being rebuilt per invocation, as `asyncio.run` would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class InvocationLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._pool: ThreadPoolExecutor | None = None
        self._threads = 0

    def enter(self) -> asyncio.AbstractEventLoop:
        """Make this the thread's current loop (what mangum runs the app on) and return it."""
        asyncio.set_event_loop(self.loop)
        return self.loop

    def run(self, work: Coroutine[Any, Any, T], *, threads: int = 0) -> T:
        """Run `work` to completion with at least `threads` executor threads for its blocking calls."""
        self.enter()
        self.reserve_threads(threads)
        return self.loop.run_until_complete(work)

    def reserve_threads(self, count: int) -> None:
        """Grow the default executor to `count` threads (created lazily, so a large reserve costs nothing idle)."""
        if count <= self._threads:
            return
        previous = self._pool
        self._pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="onnxfn-aws")
        self.loop.set_default_executor(self._pool)
        self._threads = count
        if previous is not None:
            previous.shutdown(wait=False)  # idle between invocations: nothing of the last batch still runs

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.loop.close()
        asyncio.set_event_loop(None)
