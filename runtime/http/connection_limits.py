"""The limits `runtime.http.connections` enforces, apart from it so the command line can show their defaults
without importing uvicorn."""

from __future__ import annotations

import argparse
import logging
import resource
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("runtime.http.connections")

RESERVED_FDS = 128  # descriptors kept for the process itself: model files, logs, the event loop, pipes
MAX_BACKLOG = 2048  # uvicorn's default listen backlog, which is also how many sockets one accept round takes
# A socket refused at the cap is closed an event-loop turn or two after its accept round, and a flood keeps the
# listener readable, so more rounds land meanwhile: with one round budgeted, a 2,248-socket flood on a
# 2,048-descriptor server still hit EMFILE in accept() now and then (1 run in 4).
ACCEPT_ROUNDS_IN_FLIGHT = 3
# A request body's limit, the servers' `--max-body-bytes` default and the gateway's (which routes by the body's
# `model`, so it reads a body before it knows the function): the longest prompt and tools fit well inside it.
MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class ConnectionLimits:
    # Each open connection holds ~12 KB of RSS (measured: a flood to 4,096 added 51 MB, to 1,024 added 33 MB
    # before the trim after it); 1,024 is 14x what a server of max_batch 8 + max_queue 64 can work on.
    max_connections: int = 1024
    max_header_bytes: int = 64 << 10
    head_timeout: float = 10.0
    body_timeout: float = 30.0
    body_min_rate: int = 500  # bytes per second that extend a body's deadline by one second
    keep_alive_timeout: int = 5
    backlog: int = MAX_BACKLOG

    @classmethod
    def for_process(cls, max_connections: int, **settings: Any) -> ConnectionLimits:
        """Limits whose connection cap and listen backlog fit this process's descriptor limit.

        The soft limit is raised to the hard one first (as Go's runtime does): the soft default of 1024 is a
        relic of select(2), which asyncio does not use. Sockets accepted in one round are open before any of
        them can be closed, so the backlog, times the rounds in flight, is part of the budget.
        """
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass  # keep the soft limit we have
        available = max(soft - RESERVED_FDS, 16)
        backlog = max(min(MAX_BACKLOG, available // 8), 8)
        cap = max(min(max_connections, available - ACCEPT_ROUNDS_IN_FLIGHT * backlog), 8)
        if cap < max_connections:
            log.info("at most %d connections: the descriptor limit is %d (ulimit -n)", cap, soft)
        return cls(max_connections=cap, backlog=backlog, **settings)

    def describe(self) -> str:
        """The limits in a sentence, for docs/api.md."""
        return (
            f"A request head (request line and headers) may take {self.max_header_bytes} bytes (431 beyond) and must"
            f" arrive within {self.head_timeout:g} s of the connection or of its first byte (408); a body within"
            f" {self.body_timeout:g} s plus one second per {self.body_min_rate} bytes received (408). Idle keep-alive"
            f" connections close after {self.keep_alive_timeout} s. At most {self.max_connections} connections are"
            " open (fewer when `ulimit -n` is lower): at that limit a new connection closes the longest-idle one, or"
            " gets 503 `too_many_connections` when none is idle. Flags: `--max-header-bytes`, `--head-timeout`,"
            " `--body-timeout`, `--max-connections`."
        )


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """Limits applied before a request reaches the app (runtime/http/connections.py)."""
    default = ConnectionLimits()
    group = parser.add_argument_group("connections")
    # fmt: off
    group.add_argument("--max-connections", type=int, default=default.max_connections,
                       help="open connections at most (lowered to fit `ulimit -n`); beyond: idle ones close, else 503")
    group.add_argument("--max-header-bytes", type=int, default=default.max_header_bytes,
                       help="request heads above this get 431")
    group.add_argument("--head-timeout", type=float, default=default.head_timeout,
                       help="seconds a request head may take (408)")
    group.add_argument("--body-timeout", type=float, default=default.body_timeout,
                       help=f"seconds a body may take, plus one per {default.body_min_rate} bytes received (408)")
    # fmt: on
