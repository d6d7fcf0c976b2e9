"""One real server process for the reliability tests: small limits so every limit is cheap to reach."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.live import LiveServer, live_server

MAX_BODY_BYTES = 64 << 10
MAX_CONTEXT = 256
MAX_PROMPT_TOKENS = 128
MAX_TOKENS_LIMIT = 4  # the fuzzer's generations stay short: the document states this bound
MAX_BATCH = 4
SERVER_FLAGS = [
    "--max-batch", str(MAX_BATCH), "--max-queue", "32", "--max-context", str(MAX_CONTEXT),
    "--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--max-tokens", "4", "--temperature", "0",
    "--max-body-bytes", str(MAX_BODY_BYTES), "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
]  # fmt: skip


@pytest.fixture(scope="package")
def live(demo_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("reliability") / "server.log"
    with live_server(demo_bundle, log, SERVER_FLAGS) as server:
        yield server


@pytest.fixture
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, headers=live.auth, timeout=60) as client:
        yield client


def assert_serves(live: LiveServer) -> None:
    """The server still answers a real request correctly and holds no slot afterwards."""
    body = {"model": live.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
    response = httpx.post(live.url + "/v1/chat/completions", json=body, headers=live.auth, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] and choice["finish_reason"] in ("stop", "length")
    assert live.running_and_queued() == (0, 0)
