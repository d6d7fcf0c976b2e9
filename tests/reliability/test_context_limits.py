"""The prompt limit and the context agree, and a refusal names the limit that applies (issue 47, row 10).

The demo function's own settings: `max_prompt_tokens = 1792` under `[export] max_context = 2048`, but its KV budget
(`kv_memory_mb = 512` over 8 slots, 46,080 bytes a token) holds 1,456 tokens a slot. A 1,531-token prompt passed the
1,792 check and was then refused as over "maximum context length 1456". One function now decides the prompt limit
from both (`runtime.api.formatting.prompt_limit`), the refusal says which limit it is, and the server says at start
which setting caps the context and what would lift it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.live import LiveServer, live_server

pytestmark = pytest.mark.real_model
DEMO_FLAGS = ["--max-batch", "8", "--kv-memory-mb", "512", "--max-context", "2048", "--max-prompt-tokens", "1792",
              "--max-tokens", "1", "--temperature", "0"]  # fmt: skip
CONTEXT = 1456  # 512 MiB // (8 slots * 46,080 bytes a token)


@pytest.fixture(scope="module")
def demo_limits(demo_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("limits") / "server.log"
    with live_server(demo_bundle, log, DEMO_FLAGS) as server:
        yield server


def completion(server: LiveServer, tokens: int, max_tokens: int = 1) -> httpx.Response:
    body = {"model": server.model, "prompt": [42] * tokens, "max_tokens": max_tokens}
    return httpx.post(server.url + "/v1/completions", json=body, headers=server.auth, timeout=300)


def test_the_server_says_at_start_which_setting_caps_prompts(demo_limits: LiveServer) -> None:
    log = demo_limits.log.read_text()
    assert "max_prompt_tokens (--max-prompt-tokens) is 1792, but the context is 1456 tokens" in log, log[-3000:]
    assert "kv_memory_mb (--kv-memory-mb, 512)" in log and "720 would hold 2048" in log
    assert f"prompts are limited to {CONTEXT - 1} tokens" in log


def test_the_issues_prompt_is_refused_naming_the_context_not_max_prompt_tokens(demo_limits: LiveServer) -> None:
    words = " ".join(["word"] * 1531)
    body = {"model": demo_limits.model, "messages": [{"role": "user", "content": words}]}
    response = httpx.post(demo_limits.url + "/v1/chat/completions", json=body, headers=demo_limits.auth, timeout=300)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert f"accepts at most {CONTEXT - 1} (the model's context here is {CONTEXT} tokens" in error["message"], error


def test_the_limit_is_exact_at_its_edge(demo_limits: LiveServer) -> None:
    assert completion(demo_limits, CONTEXT - 1).status_code == 200  # the longest prompt, one completion token
    over = completion(demo_limits, CONTEXT)
    assert over.status_code == 400 and f"accepts at most {CONTEXT - 1}" in over.json()["error"]["message"]
    # A prompt that fits with a completion that does not: the engine's own check, naming both parts.
    both = completion(demo_limits, CONTEXT - 10, max_tokens=20)
    assert both.status_code == 400, both.text
    assert f"maximum context length is {CONTEXT} tokens" in both.json()["error"]["message"]


def test_a_max_prompt_tokens_inside_the_context_is_the_one_named(demo_bundle: Path, tmp_path: Path) -> None:
    flags = [*DEMO_FLAGS[:-6], "--max-prompt-tokens", "100", "--max-tokens", "1", "--temperature", "0"]
    with live_server(demo_bundle, tmp_path / "server.log", flags) as server:
        assert completion(server, 100).status_code == 200
        refused = completion(server, 101)
        assert refused.status_code == 400 and "accepts at most 100 (max_prompt_tokens is 100)" in refused.text
        assert "prompts are limited" not in server.log.read_text()
