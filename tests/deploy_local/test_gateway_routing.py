"""The gateway's routing, auth and relaying, without a model: deployment records written here, and a small
stand-in server (a real uvicorn on a free port) where a function's server would be. The real functions,
idle stops and wakes are in test_gateway.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import pytest
import uvicorn

from packager.gateway.app import create_app
from packager.gateway.functions import REFRESH_SECONDS, Registry
from packager.targets.local.server_process import free_port
from tests.deploy_local import standin
from tests.deploy_local.standin import ABANDONED, EVENT_GAP, record


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(the gateway's URL, its state root) with the stand-in server's port recorded for `alpha` (key A) and
    `open` (no key), and `beta` (key B) recorded where nothing listens."""
    servers = []
    upstream_port, gateway_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    root = tmp_path / "onnxfn"
    record(root, "alpha", f"http://127.0.0.1:{upstream_port}", "key-a")
    record(root, "open", f"http://127.0.0.1:{upstream_port}", None)
    record(root, "beta", f"http://127.0.0.1:{free_port('127.0.0.1')}", "key-b")
    gateway = uvicorn.Config(create_app(Registry(root)), host="127.0.0.1", port=gateway_port, loop="asyncio")
    for config in (standin.config(upstream_port), gateway):
        server = uvicorn.Server(config)
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
    deadline = time.monotonic() + 10
    while not all(server.started for server in servers):
        assert time.monotonic() < deadline, "the servers did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{gateway_port}", root
    for server in servers:
        server.should_exit = True


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_requests_go_to_the_function_their_model_names_with_its_key(served: tuple[str, Path]) -> None:
    url, _ = served
    answer = httpx.post(f"{url}/v1/embeddings", json={"model": "alpha", "input": "x"}, headers=bearer("key-a"))
    assert answer.status_code == 200 and answer.headers["x-upstream"] == "yes"
    assert answer.json() == {"path": "/v1/embeddings", "auth": "Bearer key-a", "bytes": len(answer.request.content)}
    packed = msgpack.packb({"model": "open", "input": "x"})
    routed = httpx.post(f"{url}/v1/embeddings", content=packed, headers={"content-type": "application/msgpack"})
    assert routed.status_code == 200 and routed.json()["bytes"] == len(packed)

    models = httpx.get(f"{url}/v1/models", headers=bearer("key-a")).json()
    assert [card["id"] for card in models["data"]] == ["alpha", "open"]  # not beta: its key is another
    assert [card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]] == ["open"]
    assert httpx.get(f"{url}/v1/models/alpha", headers=bearer("key-a")).json()["id"] == "alpha"
    assert httpx.get(f"{url}/health").json()["service"] == "onnxfn-gateway"


def test_a_stream_is_relayed_event_by_event(served: tuple[str, Path]) -> None:
    url, _ = served
    arrivals = []
    body = {"model": "alpha", "stream": True, "n": 5, "messages": []}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=bearer("key-a")) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line:
                arrivals.append((time.monotonic(), line))
    assert [line for _, line in arrivals] == [f'data: {{"index": {i}}}' for i in range(5)] + ["data: [DONE]"]
    # The server spaces its events 5 gaps apart in all: a relay that held them until the end would deliver them
    # together. Measured between arrivals, not from the request's start, which a loaded machine can delay.
    assert arrivals[-1][0] - arrivals[0][0] >= 2 * EVENT_GAP


def test_a_client_that_goes_away_stops_the_server_stream(served: tuple[str, Path]) -> None:
    url, _ = served
    body = {"model": "alpha", "stream": True, "n": 50, "messages": []}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=bearer("key-a")) as stream:
        assert next(stream.iter_lines()).startswith("data:")
    deadline = time.monotonic() + 5
    while not ABANDONED and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ABANDONED and ABANDONED[-1] < 10  # the server stopped long before its 50 events


def test_client_mistakes_are_openai_shaped_4xx(served: tuple[str, Path]) -> None:
    url, _ = served

    def post(body: object, key: str | None = "key-a", **extra: str) -> httpx.Response:
        headers = {**(bearer(key) if key else {}), **extra}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{url}/v1/chat/completions", content=content, headers=headers)

    unknown = post({"model": "gamma", "messages": []})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert "'gamma' is not deployed" in unknown.json()["error"]["message"]
    assert "deployed: alpha, open" in unknown.json()["error"]["message"]  # what this key opens, not beta
    wrong = post({"model": "alpha", "messages": []}, key="key-b")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    missing = post({"model": "alpha", "messages": []}, key=None)
    assert missing.status_code == 401 and "missing bearer token" in missing.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/models", headers=bearer("nope")).status_code == 200  # `open` needs no key
    no_model = post({"messages": []})
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    assert no_model.json()["error"]["code"] == "missing_required_parameter"
    broken = post(b"{not json")
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"
    bad_msgpack = post(b"\xc1", **{"content-type": "application/msgpack", "accept": "application/msgpack"})
    assert bad_msgpack.status_code == 400 and bad_msgpack.headers["content-type"] == "application/msgpack"
    assert msgpack.unpackb(bad_msgpack.content)["error"]["code"] == "invalid_msgpack"
    nowhere = httpx.get(f"{url}/v2/anything")
    assert nowhere.status_code == 404 and "no route GET /v2/anything" in nowhere.json()["error"]["message"]
    # A function whose server is gone and cannot be started again (its record names no real bundle): the gateway
    # tried, says so and where to look; it does not fail with a 500.
    down = httpx.post(f"{url}/v1/chat/completions", json={"model": "beta", "messages": []}, headers=bearer("key-b"))
    assert down.status_code == 503 and down.json()["error"]["code"] == "restart_failed", down.text
    assert "pkg status /project/functions/beta" in down.json()["error"]["message"]


def test_a_corrupt_record_is_written_back_and_its_function_keeps_serving(served: tuple[str, Path]) -> None:
    """A `state.json` cut short (as by a crash mid-write, or the chaos run): the gateway keeps routing to the
    server it knew and writes the record it read last back."""
    url, root = served
    state = next((root / "functions").glob("alpha-*")) / "state.json"
    good = json.loads(state.read_text())
    state.write_text(state.read_text()[:40])
    time.sleep(REFRESH_SECONDS + 0.1)  # records are read again at most that often
    answer = httpx.post(f"{url}/v1/embeddings", json={"model": "alpha", "input": "x"}, headers=bearer("key-a"))
    assert answer.status_code == 200 and answer.headers["x-upstream"] == "yes"
    assert json.loads(state.read_text()) == good


def test_two_functions_of_one_name_are_refused_by_name(served: tuple[str, Path]) -> None:
    url, root = served
    record(root, "alpha", "http://127.0.0.1:9", "key-a", folder="other-alpha")
    time.sleep(REFRESH_SECONDS + 0.1)  # records are read again at most that often
    clash = httpx.post(f"{url}/v1/embeddings", json={"model": "alpha", "input": "x"}, headers=bearer("key-a"))
    assert clash.status_code == 409 and clash.json()["error"]["code"] == "ambiguous_model"
    assert "/project/functions/alpha" in clash.json()["error"]["message"]


def test_two_starts_at_once_leave_one_gateway(tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    env = {"XDG_STATE_HOME": str(tmp_path), "ONNXFN_GATEWAY_PORT": str(port), "PATH": "/usr/bin:/bin"}

    def pkg(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "packager.cli", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    command = [sys.executable, "-c", "from packager.gateway import control; print(control.ensure().pid)"]
    starts = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    pids = {int(process.communicate(timeout=60)[0]) for process in starts}
    try:
        assert len(pids) == 1
        report = json.loads(pkg("gateway", "status", "--json").stdout)
        assert report["running"] and report["pid"] in pids and report["url"] == f"http://127.0.0.1:{port}/v1"
    finally:
        pkg("gateway", "stop")
    gone = pkg("gateway", "status")
    assert gone.returncode == 1 and "no gateway runs" in gone.stdout


def test_the_gateway_process_refuses_an_endless_header_as_the_server_does(tmp_path: Path) -> None:
    """The runtime's connection guards run in the gateway too: 431 after 64 KiB of head, not 300 MB read."""
    port = free_port("127.0.0.1")
    env = {"XDG_STATE_HOME": str(tmp_path), "ONNXFN_GATEWAY_PORT": str(port), "PATH": "/usr/bin:/bin"}
    start = [sys.executable, "-c", "from packager.gateway import control; print(control.ensure().pid)"]
    subprocess.run(start, env=env, check=True, capture_output=True, timeout=60)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Long: ")
            sent = 0
            try:
                while sent < 300 << 20:
                    sock.sendall(b"a" * (1 << 20))
                    sent += 1 << 20
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused at the limit; its answer is already in our receive buffer
            reply = sock.recv(4096)
        assert sent < 16 << 20, sent
        assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        subprocess.run([sys.executable, "-m", "packager.cli", "gateway", "stop"], env=env, capture_output=True)
