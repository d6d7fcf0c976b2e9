"""Issue 47, row 1: bodies as an outsider sends them to a real gateway process (`python -m packager.gateway`)
in front of a stand-in function server (a process of its own, tests/deploy_local/standin.py).

Before: a 32 MiB keyless msgpack body of empty maps got its 401 after 18 s with the gateway at 2.7 GiB, and
three 30 MB JSON bodies paused another client's stream 5.1 s and `/health` 10.6 s. Now the key is checked
before a byte of the body is read, a body over the servers' 1 MiB is refused at the limit, and `model` is
found without building the body; so the attacker's bytes are never read, the gateway's peak memory stays
where it was and the other clients do not notice.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgpack
import pytest

from packager.targets.local.server_process import free_port
from runtime.http.connection_limits import MAX_BODY_BYTES
from tests.deploy_local.standin import record

MiB = 1 << 20
ATTACK_BYTES = 32 * MiB
KEY = "key-a"
# Far above any stall of a loaded machine, far below what the attack cost before (5.1 s, 10.6 s).
GENEROUS_STALL_S = 3.0


@dataclass(frozen=True)
class Gateway:
    url: str
    port: int
    pid: int

    def peak_rss(self) -> int:
        """VmHWM: the most memory the gateway ever held."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")


def wait_answers(url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer"
        time.sleep(0.05)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    """A gateway process routing `alpha` (key KEY) to a stand-in server process."""
    upstream_port, gateway_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}
    processes = [
        subprocess.Popen([sys.executable, "-m", "tests.deploy_local.standin", str(upstream_port)], env=env),
        subprocess.Popen([sys.executable, "-m", "packager.gateway", "--port", str(gateway_port)], env=env),
    ]
    try:
        record(tmp_path / "onnxfn", "alpha", f"http://127.0.0.1:{upstream_port}", KEY, pid=processes[0].pid)
        wait_answers(f"http://127.0.0.1:{upstream_port}/ready")
        wait_answers(f"http://127.0.0.1:{gateway_port}/health")
        yield Gateway(f"http://127.0.0.1:{gateway_port}", gateway_port, processes[1].pid)
    finally:
        for process in processes:
            process.kill()
            process.wait(10)


def head(path: str, *, key: str | None, length: int | None, content_type: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {content_type}"]
    lines += [f"Authorization: Bearer {key}"] if key else []
    lines += [f"Content-Length: {length}"] if length is not None else ["Transfer-Encoding: chunked"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def empty_maps_msgpack(size: int) -> Iterator[bytes]:
    """The issue's body, `size` bytes: a map whose `pad` holds an array of `\\x80` (msgpack's empty map) x N,
    then `model` (a decoder builds N dicts before it gets there)."""
    pad = size - 22
    yield b"\x82\xa3pad\xdd" + pad.to_bytes(4, "big")
    sent = 0
    while sent < pad:
        piece = min(MiB, pad - sent)
        yield b"\x80" * piece
        sent += piece
    yield b"\xa5model\xa5alpha"


def empty_objects_json(size: int) -> Iterator[bytes]:
    yield b'{"model": "alpha", "pad": ['
    for _ in range(size // MiB):
        yield b"{}," * (MiB // 3)
    yield b"{}]}"


@dataclass
class Attack:
    status: bytes  # the status line the gateway answered with
    sent: int  # body bytes the socket took before the answer came or the gateway closed it
    seconds: float


def attack(port: int, request_head: bytes, body: Iterator[bytes], *, chunked: bool) -> Attack:
    """Send the head, then the body as fast as the gateway takes it, looking for its answer after every MiB."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request_head)
        sent, answer = 0, b""
        try:
            for piece in body:
                for offset in range(0, len(piece), MiB):
                    part = piece[offset : offset + MiB]
                    sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n" if chunked else part)
                    sent += len(part)
                    answer = _poll(sock)
                    if answer:
                        raise StopIteration
        except (StopIteration, BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(30)
        answer = answer or sock.recv(65536)
    return Attack(answer.split(b"\r\n", 1)[0], sent, time.monotonic() - started)


def _poll(sock: socket.socket) -> bytes:
    sock.settimeout(0.0)
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return b""
    finally:
        sock.settimeout(30)


def test_a_keyless_32_mib_msgpack_body_is_refused_before_it_is_read(gateway: Gateway) -> None:
    peak_before = gateway.peak_rss()
    sized = head("/v1/chat/completions", key=None, length=ATTACK_BYTES, content_type="application/msgpack")
    refused = attack(gateway.port, sized, empty_maps_msgpack(ATTACK_BYTES), chunked=False)
    assert refused.status == b"HTTP/1.1 401 Unauthorized"
    # The answer came before the body: what the socket took fits in the kernel's buffers, not 32 MiB.
    assert refused.sent < 8 * MiB, refused.sent
    # The same without a length (chunked), in JSON, and with a wrong key.
    for content_type, body in (("application/json", empty_objects_json), ("application/msgpack", empty_maps_msgpack)):
        for key in (None, "not-the-key"):
            chunked = head("/v1/chat/completions", key=key, length=None, content_type=content_type)
            refused = attack(gateway.port, chunked, body(ATTACK_BYTES), chunked=True)
            assert refused.status == b"HTTP/1.1 401 Unauthorized" and refused.sent < 8 * MiB, refused
    assert gateway.peak_rss() - peak_before < 16 * MiB


def test_a_key_holders_body_over_the_limit_is_refused_at_the_limit(gateway: Gateway) -> None:
    peak_before = gateway.peak_rss()
    sized = head("/v1/chat/completions", key=KEY, length=ATTACK_BYTES, content_type="application/msgpack")
    unread = attack(gateway.port, sized, empty_maps_msgpack(ATTACK_BYTES), chunked=False)
    assert unread.status == b"HTTP/1.1 413 Request Entity Too Large" and unread.sent < 8 * MiB, unread
    chunked = head("/v1/chat/completions", key=KEY, length=None, content_type="application/json")
    capped = attack(gateway.port, chunked, empty_objects_json(ATTACK_BYTES), chunked=True)
    assert capped.status == b"HTTP/1.1 413 Request Entity Too Large" and capped.sent < 8 * MiB, capped
    too_large = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=b"x" * (MAX_BODY_BYTES + 1),
        headers={"authorization": "Bearer " + KEY},
    )
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
    assert f"over {MAX_BODY_BYTES} bytes" in too_large.json()["error"]["message"]
    assert gateway.peak_rss() - peak_before < 16 * MiB


def test_bodies_within_the_limit_are_routed_without_being_built(gateway: Gateway) -> None:
    """Neighbours: a megabyte of empty maps or objects with the right key is relayed (the stand-in echoes its
    size) for a few megabytes of the gateway's memory, not the tens a decoded body would take."""
    auth = {"authorization": f"Bearer {KEY}"}
    peak_before = gateway.peak_rss()
    for _ in range(4):
        packed = b"".join(empty_maps_msgpack(MAX_BODY_BYTES))
        routed = httpx.post(
            f"{gateway.url}/v1/embeddings", content=packed, headers={**auth, "content-type": "application/msgpack"}
        )
        assert routed.status_code == 200 and routed.json()["bytes"] == len(packed), routed.text
        text = b'{"model": "alpha", "pad": [' + b"{}," * ((MAX_BODY_BYTES - 40) // 3) + b"{}]}"
        routed = httpx.post(f"{gateway.url}/v1/embeddings", content=text, headers=auth)
        assert routed.status_code == 200 and routed.json()["bytes"] == len(text), routed.text
    # A decoded megabyte of empty maps is 72 MB of Python objects; of `{}`, 25 MB (DECODES_AT_ONCE at a time).
    assert gateway.peak_rss() - peak_before < 48 * MiB
    nested = b"\x81\xa5model" + b"\x91" * 100_000 + b"\xc0"
    deep = httpx.post(
        f"{gateway.url}/v1/embeddings", content=nested, headers={**auth, "content-type": "application/msgpack"}
    )
    assert deep.status_code == 400 and deep.json()["error"]["code"] == "too_deeply_nested"
    not_a_map = httpx.post(
        f"{gateway.url}/v1/embeddings",
        content=msgpack.packb([1, 2]),
        headers={**auth, "content-type": "application/msgpack"},
    )
    assert not_a_map.status_code == 400 and not_a_map.json()["error"]["param"] == "model"


def test_attackers_do_not_stall_other_clients(gateway: Gateway) -> None:
    """Three clients send 32 MiB keyless bodies over and over while another streams and `/health` is watched."""
    stream_gaps: list[float] = []
    health: list[float] = []
    first_seen = threading.Event()
    stop = threading.Event()

    def stream() -> None:
        body = {"model": "alpha", "stream": True, "n": 150, "gap": 0.02, "messages": []}
        with httpx.stream(
            "POST",
            f"{gateway.url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {KEY}"},
            timeout=60,
        ) as events:
            last = time.monotonic()
            for line in events.iter_lines():
                if line.startswith("data:"):
                    now = time.monotonic()
                    stream_gaps.append(now - last)
                    last = now
                    first_seen.set()

    def watch_health() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                started = time.monotonic()
                assert client.get(f"{gateway.url}/health").status_code == 200
                health.append(time.monotonic() - started)
                stop.wait(0.02)

    outcomes: list[Attack] = []

    def attacker() -> None:
        while not stop.is_set():
            sized = head("/v1/chat/completions", key=None, length=ATTACK_BYTES, content_type="application/json")
            outcomes.append(attack(gateway.port, sized, empty_objects_json(ATTACK_BYTES), chunked=False))

    peak_before = gateway.peak_rss()
    streamer, watcher = threading.Thread(target=stream), threading.Thread(target=watch_health)
    streamer.start()
    watcher.start()
    deadline = time.monotonic() + 30
    while not (first_seen.is_set() and health) and time.monotonic() < deadline:  # the first observations
        time.sleep(0.01)
    assert first_seen.is_set() and health, "the stream or /health never answered"
    attackers = [threading.Thread(target=attacker) for _ in range(3)]
    for thread in attackers:
        thread.start()
    streamer.join(60)
    stop.set()
    for thread in [watcher, *attackers]:
        thread.join(60)
    assert len(stream_gaps) == 151  # 150 events and [DONE]: the stream was whole
    assert outcomes and all(o.status == b"HTTP/1.1 401 Unauthorized" and o.sent < 8 * MiB for o in outcomes)
    assert max(stream_gaps) < GENEROUS_STALL_S and max(health) < GENEROUS_STALL_S, (max(stream_gaps), max(health))
    assert gateway.peak_rss() - peak_before < 16 * MiB
    print(json.dumps({"attacks": len(outcomes), "max_stream_gap_s": max(stream_gaps), "max_health_s": max(health)}))
