"""Background work waits for an idle engine loop, but not forever."""

from __future__ import annotations

import threading
import time

from runtime.engine.background import Idleness


def test_a_loop_idle_long_enough_is_quiet_at_once() -> None:
    idleness = Idleness()
    time.sleep(0.3)
    started = time.monotonic()
    assert idleness.wait_quiet(quiet_s=0.25, patience_s=5)
    assert time.monotonic() - started < 0.2


def test_a_busy_loop_keeps_background_work_waiting_only_for_the_patience() -> None:
    idleness = Idleness()
    idleness.leave()
    started = time.monotonic()
    assert not idleness.wait_quiet(quiet_s=0.05, patience_s=0.3)
    assert 0.3 <= time.monotonic() - started < 1.0


def test_quiet_counts_from_when_the_loop_last_became_idle() -> None:
    idleness = Idleness()
    idleness.leave()
    threading.Timer(0.2, idleness.enter).start()
    started = time.monotonic()
    assert idleness.wait_quiet(quiet_s=0.2, patience_s=5)
    assert 0.4 <= time.monotonic() - started < 1.5  # 0.2 s busy, then 0.2 s idle in a row


def test_a_loop_that_goes_busy_again_restarts_the_quiet_period() -> None:
    idleness = Idleness()
    idleness.leave()
    idleness.enter()
    threading.Timer(0.1, idleness.leave).start()
    threading.Timer(0.2, idleness.enter).start()
    started = time.monotonic()
    assert idleness.wait_quiet(quiet_s=0.3, patience_s=5)
    assert time.monotonic() - started >= 0.5  # idle from 0.2 s on, so quiet at 0.5 s, not at 0.3 s
