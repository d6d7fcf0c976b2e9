"""Connection hygiene for the HTTP servers: limits that hold before a request reaches the app.

uvicorn closes an idle keep-alive connection, but nothing else: a socket that connects and sends nothing, a
header line that never ends, or a body trickling a byte a minute holds its file descriptor (and, for the
header, its memory) forever, and enough of them exhaust the process's descriptors. `GuardedHttpProtocol`
wraps uvicorn's httptools protocol with the limits nginx and Apache's mod_reqtimeout apply:

- a request head (request line + headers) must arrive within `head_timeout` seconds of its first byte, or
  of the connection's start, and hold at most `max_header_bytes` (431 beyond, counted before parsing, so a
  never-ending header costs at most that much memory);
- a body must keep coming: its deadline starts at `body_timeout` and grows by one second per
  `body_min_rate` bytes received (mod_reqtimeout's `MinRate`), and never runs while the app itself has
  paused reading; a late body gets 408;
- at most `max_connections` are open, below the descriptor limit. At the cap a new connection closes the
  longest-idle one (no request in flight, idle for at least `EVICT_MIN_IDLE`), as nginx reuses its idle
  connections; when every connection is busy the newcomer gets an immediate 503.

Errors written here are OpenAI-shaped JSON like the app's, with `Connection: close`.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from runtime.engine.heap import release_free_memory
from runtime.http.connection_limits import ConnectionLimits

log = logging.getLogger("runtime.http.connections")

TRIM_AFTER_PEAK = 512  # open connections at once that make a trim worth its milliseconds once they are gone
EVICT_MIN_IDLE = 0.25  # seconds: a client that just connected sends its request at once; older silence is idle


class _Phase(enum.Enum):
    IDLE = "idle"  # no request in progress: new, or kept alive after a response
    HEAD = "head"  # a request head is arriving
    BODY = "body"  # the head is parsed; its body is arriving
    BUSY = "busy"  # the request is complete; the app is answering


class ConnectionRegistry:
    """Idle connections of one server, oldest first: the ones a newcomer may close when the cap is reached."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._idle: OrderedDict[GuardedHttpProtocol, float] = OrderedDict()
        self._peak = 0  # connections open at once since memory was last handed back

    def opened(self, open_now: int) -> None:
        self._peak = max(self._peak, open_now)

    def closed(self, open_now: int) -> None:
        """After a flood, hand the heap pages its connections used back to the kernel: glibc keeps pages freed in
        the middle of an arena resident, so 4,000 closed connections would otherwise stay ~50 MB of RSS."""
        if self._peak >= TRIM_AFTER_PEAK and open_now <= self._peak // 8:
            self._peak = open_now
            release_free_memory()

    def idle(self, connection: GuardedHttpProtocol) -> None:
        self._idle[connection] = time.monotonic()
        self._idle.move_to_end(connection)

    def active(self, connection: GuardedHttpProtocol) -> None:
        self._idle.pop(connection, None)

    def make_room(self) -> bool:
        """Close the longest-idle connection; False when none has been idle for `EVICT_MIN_IDLE`."""
        for connection, since in self._idle.items():
            if time.monotonic() - since < EVICT_MIN_IDLE:
                return False
            self._idle.pop(connection)
            connection.transport.abort()  # nothing is in flight on an idle connection; frees its fd now
            return True
        return False


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpProtocol]:
    """The protocol class to give `uvicorn.Config(http=...)`: one registry per server."""
    registry = ConnectionRegistry(limits)
    return type("ServerHttpProtocol", (GuardedHttpProtocol,), {"registry": registry})


class GuardedHttpProtocol(HttpToolsProtocol):
    registry: ConnectionRegistry

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.registry.opened(len(self.connections))
        self._phase = _Phase.IDLE
        self._head_bytes = 0
        self._body_bytes = 0
        self._body_started = 0.0
        self._timer: asyncio.TimerHandle | None = None
        limits = self.registry.limits
        if len(self.connections) > limits.max_connections and not self.registry.make_room():
            self._refuse(503, f"the server holds its limit of {limits.max_connections} connections; retry shortly",
                         code="too_many_connections", error_type="service_unavailable")  # fmt: skip
            return
        self.registry.idle(self)
        self._arm(limits.head_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.registry.active(self)
        self._disarm()
        super().connection_lost(exc)
        self.registry.closed(len(self.connections))

    def data_received(self, data: bytes) -> None:
        # Head bytes are counted before httptools buffers them: it keeps an unfinished header in memory.
        limit = self.registry.limits.max_header_bytes
        while data and self._phase in (_Phase.IDLE, _Phase.HEAD) and not self.transport.is_closing():
            room = limit - self._head_bytes
            if room <= 0:
                self._refuse(431, f"the request head is over {limit} bytes; send shorter headers",
                             code="request_header_fields_too_large")  # fmt: skip
                return
            piece, data = data[:room], data[room:]
            self._head_bytes += len(piece)
            super().data_received(piece)
        if data and not self.transport.is_closing():
            if self._phase is _Phase.BODY:
                self._body_bytes += len(data)
            super().data_received(data)

    # httptools callbacks: they move the connection through its phases.
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = _Phase.HEAD
        self.registry.active(self)
        if self._timer is None:  # a kept-alive connection: the head's clock starts at its first byte
            self._arm(self.registry.limits.head_timeout, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._head_bytes = 0
        self._phase = _Phase.BODY
        self._body_bytes = 0
        self._body_started = self.loop.time()
        self._arm(self.registry.limits.body_timeout, self._body_check)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._phase = _Phase.BUSY
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._phase is _Phase.BUSY:
            self._phase = _Phase.IDLE
            self.registry.idle(self)

    # Timers.
    def _arm(self, delay: float, callback: Any) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._phase is _Phase.IDLE and self._head_bytes == 0:
            self.transport.close()  # never said anything: nothing to answer
        elif self._phase in (_Phase.IDLE, _Phase.HEAD):
            timeout = self.registry.limits.head_timeout
            self._refuse(408, f"the request head did not arrive within {timeout:g} s", code="request_timeout")

    def _body_check(self) -> None:
        self._timer = None
        if self._phase is not _Phase.BODY or self.transport.is_closing():
            return
        limits = self.registry.limits
        deadline = self._body_started + limits.body_timeout + self._body_bytes / limits.body_min_rate
        now = self.loop.time()
        if self.flow.read_paused:  # the app is behind, not the client: wait for it
            self._body_started += 1.0
            self._arm(1.0, self._body_check)
        elif now < deadline:
            self._arm(deadline - now, self._body_check)
        else:
            took = now - self._body_started
            message = (f"the request body came too slowly: {self._body_bytes} bytes in {took:.0f} s "
                       f"(at least {limits.body_min_rate} bytes/s after {limits.body_timeout:g} s)")  # fmt: skip
            if self.cycle is not None and not self.cycle.response_started:
                self.cycle.disconnected = True  # the app's next receive() sees a disconnect
                self.cycle.message_event.set()
                self._refuse(408, message, code="request_timeout")
            else:
                self.transport.close()

    def _refuse(self, status: int, message: str, *, code: str, error_type: str = "invalid_request_error") -> None:
        """Answer with an OpenAI-shaped error outside the app, then close: the request cannot be read further."""
        self._disarm()
        self.registry.active(self)
        body = json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}}).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n"
        )
        retry = "retry-after: 1\r\n" if status == 503 else ""
        log.warning("connection answered %s and closed: %s", status, code)
        self.transport.write((head + retry + "\r\n").encode() + body)
        self.transport.close()


_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}
