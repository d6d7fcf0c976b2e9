"""Work the engine does after it is ready, on threads that leave the CPU to requests."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, TypeVar

from runtime.engine.heap import release_free_memory
from runtime.engine.huge_pages import CollapseReport, collapse, merged
from runtime.threads import in_thread, lower_priority

if TYPE_CHECKING:
    from runtime.engine.session_build import SessionBuild

log = logging.getLogger("runtime.engine")

T = TypeVar("T")

QUIET_S = 0.5  # idle this long before background work that slows requests (huge pages) goes on
# ... but never wait longer than this for it: a loop busy from the start would otherwise keep the work
# waiting forever, though each piece costs a running batch only milliseconds.
PATIENCE_S = 1.0
# A session built in the background slows what runs beside it for seconds (measured: a first reply of 150
# tokens decoded at 44-46 tok/s with the build starting 1 s into it, 50-52 with it waiting 5 s), so it waits
# longer: a cold start's first reply, often seconds long, then runs alone.
BUILD_PATIENCE_S = 5.0


def run_in_background(work: Callable[[], T], name: str) -> Future[T]:
    """Run `work` on a daemon thread at the background priority; its result or exception lands in the future."""

    def lowered() -> T:
        lower_priority()
        return work()

    return in_thread(lowered, name)


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


class StartupWork:
    """What an engine finishes while it already serves: a deferred prefill graph's build, then huge pages.

    The prefill graph builds once the step loop has been quiet (a cold start's first request runs without the
    build beside it on the same cores); the engine takes it between steps (`take_prefill`). Huge pages come
    after every session is built: moving pages would slow the builds.
    """

    def __init__(
        self,
        prefill: SessionBuild | None,
        built: Sequence[SessionBuild],
        huge_pages: bool,
        idleness: Idleness,
        wake: Callable[[], None],
    ) -> None:
        """`built`: the builds of the sessions in use (a deferred prefill graph's joins once taken); the memory
        they added is what moves to huge pages. `wake` is called once the prefill graph is built: an idle
        loop must wake to switch to it."""
        self._prefill = prefill
        self._builds = list(built)
        self._huge_pages_on = huge_pages
        self._idleness = idleness
        self.huge_pages: Future[CollapseReport] | None = None
        if prefill is None:
            self._move_to_huge_pages()
        else:
            run_in_background(lambda: self._start_when_quiet(prefill), "onnxfn-prefill-wait")
            prefill.when_done(wake)

    @property
    def prefill_loading(self) -> bool:
        """A deferred prefill graph is still to be taken."""
        return self._prefill is not None

    @property
    def prefill_built(self) -> bool:
        """The deferred prefill graph is built and waits to be taken."""
        return self._prefill is not None and self._prefill.done

    @property
    def done(self) -> bool:
        return self._prefill is None and (self.huge_pages is None or self.huge_pages.done())

    def take_prefill(self, wait: bool) -> SessionBuild | None:
        """The deferred build, handed over once: when it is built, or at once with `wait` (the caller then
        waits on its result). The caller says `prefill_switched` once it has switched to it, or failed to."""
        build = self._prefill
        if build is None or not (wait or build.done):
            return None
        self._prefill = None
        self._builds.append(build)
        return build

    def prefill_switched(self) -> None:
        """Every session is built: hand back what the build freed, then move the graphs' weights."""
        release_free_memory()
        self._move_to_huge_pages()

    def _start_when_quiet(self, build: SessionBuild) -> None:
        self._idleness.wait_quiet(patience_s=BUILD_PATIENCE_S)
        build.start()

    def _move_to_huge_pages(self) -> None:
        if self._huge_pages_on:
            # Builds that ran at the same time each saw some of the other's memory appear.
            weights = merged([interval for build in self._builds for interval in build.allocated])
            # Preferably while no request runs: moving pages stalls the engine's page faults (measured: a
            # first request's TTFT 130 -> 294 ms when it ran beside the collapse). A loop never idle gets a
            # chunk (~10 ms of stalls at most) every `PATIENCE_S`.
            self.huge_pages = run_in_background(
                lambda: collapse(weights, before_each=self._idleness.wait_quiet), "onnxfn-huge-pages"
            )
            self.huge_pages.add_done_callback(lambda done: log.info(done.result().describe()))
