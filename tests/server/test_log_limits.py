"""A cause logged thousands of times a second is written once per interval, with a count of what was left out."""

from __future__ import annotations

import io
import logging

import pytest

from runtime.log_limits import RepeatLimit


@pytest.fixture
def captured() -> tuple[logging.Logger, io.StringIO, RepeatLimit]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    limit = RepeatLimit(interval=60)
    handler.addFilter(limit)
    logger = logging.getLogger("test.log_limits")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, out, limit


def test_one_line_per_cause_per_interval(captured: tuple[logging.Logger, io.StringIO, RepeatLimit]) -> None:
    logger, out, limit = captured
    for i in range(10_000):
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            logger.exception("socket.accept() out of system resource: %d", i)
        logger.warning("connection answered %s and closed: %s", 503, "too_many_connections")
        logger.info("access line %d", i)  # below WARNING: every one is kept
    text = out.getvalue()
    assert text.count("out of system resource") == 1 and text.count("Traceback") == 1
    assert text.count("connection answered") == 1
    assert text.count("access line") == 10_000
    # After the interval the next one is written, saying how many were left out.
    limit.interval = 0
    logger.warning("connection answered %s and closed: %s", 503, "too_many_connections")
    assert "[9999 more like this in the last 0 s not logged]" in out.getvalue()


def test_causes_are_told_apart_and_bounded(captured: tuple[logging.Logger, io.StringIO, RepeatLimit]) -> None:
    logger, out, limit = captured
    logger.warning("first cause %s", 1)
    logger.warning("second cause %s", 1)
    logger.error("first cause %s", 2)  # same template and logger: the same cause, whatever the level
    assert out.getvalue().count("cause") == 2
    for i in range(5000):
        logger.warning(f"template {i}")  # a template per record: memory must still be bounded
    assert len(limit._causes) <= 1024
