"""A real uvicorn server on a free 127.0.0.1 port, in a thread, serving the demo bundle's engine."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from runtime.api.protocol import RequestPolicy
from runtime.bundle import read_manifest
from runtime.engine.engine import Engine, EngineConfig
from runtime.http.app import create_app
from runtime.http.state import ServerSettings, ServerState
from runtime.startup import start_engine

API_KEY = "test-key-0123456789"
MAX_CONTEXT = 256
MAX_PROMPT_TOKENS = 200
MAX_BODY_BYTES = 64 << 10


@dataclass
class RunningServer:
    url: str
    state: ServerState

    @property
    def engine(self) -> Engine:
        assert self.state.engine is not None
        return self.state.engine


def policy_for(bundle: Path, **overrides: object) -> RequestPolicy:
    manifest = read_manifest(bundle)
    values: dict[str, object] = {
        "model_name": manifest.function,
        "vocab_size": manifest.model.vocab_size,
        "default_temperature": 0.0,
        "default_max_tokens": 16,
        "max_tokens_limit": 64,
        **overrides,
    }
    return RequestPolicy(**values)  # type: ignore[arg-type]


def engine_loader(bundle: Path, config: EngineConfig) -> Callable[[], Engine]:
    # The hashes are checked by tests/server/test_serve_cli.py; skipping them here keeps each module fast.
    return lambda: start_engine(bundle, config, verify=False)


@contextmanager
def serve_in_thread(settings: ServerSettings, load_engine: Callable[[], Engine]) -> Iterator[RunningServer]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = create_app(settings, load_engine)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        wait_ready(url, timeout=60)
        yield RunningServer(url=url, state=app.state.server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def wait_ready(url: str, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not become ready within {timeout} s")


@pytest.fixture(scope="package")
def server(demo_bundle: Path) -> Iterator[RunningServer]:
    """The server most tests share: auth on, small limits so limit errors are cheap to reach."""
    settings = ServerSettings(
        policy=policy_for(demo_bundle, max_prompt_tokens=MAX_PROMPT_TOKENS, max_n=4),
        api_key=API_KEY,
        max_body_bytes=MAX_BODY_BYTES,
        fingerprint="fp_test",
    )
    config = EngineConfig(max_batch=4, max_queue=8, max_context=MAX_CONTEXT)
    with serve_in_thread(settings, engine_loader(demo_bundle, config)) as running:
        yield running
