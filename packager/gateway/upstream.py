"""HTTP/1.1 to a function's server for the relay: a request written in one piece, the response parsed by
httptools (C) as it arrives and handed over in whatever chunks have come since the last look.

Why not httpx here: relaying a token stream through httpx (h11, anyio) and Starlette's StreamingResponse
cost the gateway ~170 µs of CPU per token on this machine, ~6 % of 8 streams' throughput, since the gateway
shares the cores with the engine. This path is an asyncio protocol whose `data_received` feeds the parser,
and one future per wait: the relay wakes once for all the bytes that came meanwhile. Connections are kept
per function (`Pool`) and reused while the server keeps them open.

A chunked body (a stream) is handed over in whole HTTP chunks only: the runtime writes one SSE event or
msgpack frame per chunk, so a server that dies mid-write never leaves half an event for the relay to pass on
before its error event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httptools

CONNECT_TIMEOUT = 5.0


class UpstreamError(Exception):
    """The server closed the connection or sent something that is not HTTP, before the response ended."""


class Unreachable(Exception):
    """No connection to the server could be made: nothing of the request reached it, so it may be sent again."""


class Upstream(asyncio.Protocol):
    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: list[bytes] = []
        self._partial: list[bytes] = []  # the HTTP chunk being received
        self._chunked = False
        self._header_list: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # set once the head is complete
        self.complete = False
        self.received = False  # any byte of a response came: a failure then is not worth a retry
        self.error: Exception | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"the server's answer is not valid HTTP ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if not self.complete:
            self._fail(UpstreamError(f"the server closed the connection ({exc or 'end of stream'})"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_list.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.headers = self._header_list
        self._chunked = (b"transfer-encoding", b"chunked") in self._header_list
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._chunked:
            self._partial.append(bytes(body))
            return
        self._chunks.append(bytes(body))
        self._wake()

    def on_chunk_complete(self) -> None:
        if self._partial:
            self._chunks.extend(self._partial)
            self._partial.clear()
            self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # the relay's side
    @property
    def streamed(self) -> bool:
        """The body comes in chunks as the server writes it (a stream), not with a length up front."""
        return self._chunked

    @property
    def reusable(self) -> bool:
        return self.complete and self._transport is not None and not self._transport.is_closing()

    def send(self, head: bytes, body: bytes) -> None:
        assert self._transport is not None
        self._transport.write(head + body)

    async def head(self) -> None:
        """Until the response's status and headers are in; raises UpstreamError."""
        while not self.headers:
            await self._wait()

    async def chunks(self) -> bytes:
        """The body bytes that came since the last call (waiting for some); b"" once the response is complete."""
        while not self._chunks and not self.complete:
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data

    def reset(self) -> None:
        """Ready for the next request on this connection."""
        self._parser = httptools.HttpResponseParser(self)
        self._header_list, self.headers, self.status = [], [], 0
        self._partial, self._chunked = [], False
        self.complete = self.received = False
        self.error = None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        self.error = self.error or error
        self._wake()


class Pool:
    """The idle connections to one server."""

    def __init__(self, url: str, host: str, port: int) -> None:
        self.url, self.host, self.port = url, host, port
        self._idle: list[Upstream] = []
        self._closed = False

    async def request(self, method: str, target: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> Upstream:
        """Send the request and wait for the response's head. A kept connection the server closed meanwhile
        (its keep-alive timeout) is retried once on a new one: nothing of the request was answered."""
        head = _head(method, target, f"{self.host}:{self.port}", headers, len(body))
        while self._idle:
            connection = self._idle.pop()
            if not connection.reusable:  # closed by the server while it waited here
                connection.close()
                continue
            connection.reset()
            connection.send(head, body)
            try:
                await connection.head()
                return connection
            except UpstreamError:
                connection.close()
                if connection.received:
                    raise
        loop = asyncio.get_running_loop()
        try:
            connecting = loop.create_connection(Upstream, self.host, self.port)
            _, connection = await asyncio.wait_for(connecting, CONNECT_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            raise Unreachable(f"nothing answers at {self.url} ({exc or 'no connection within the timeout'})") from exc
        connection.send(head, body)
        await connection.head()
        return connection

    def release(self, connection: Upstream) -> None:
        if connection.reusable and not self._closed:  # closed: its server moved or stops; nothing to keep
            self._idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        self._closed = True
        for connection in self._idle:
            connection.close()
        self._idle.clear()


def _head(method: str, target: str, host: str, headers: Sequence[tuple[bytes, bytes]], length: int) -> bytes:
    lines = [f"{method} {target} HTTP/1.1\r\nhost: {host}\r\ncontent-length: {length}\r\n".encode("latin-1")]
    lines += [name + b": " + value + b"\r\n" for name, value in headers]
    return b"".join(lines) + b"\r\n"
