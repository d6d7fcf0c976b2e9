"""Issue 47, row 9: `pkg deploy` of a changed function while requests flow through the gateway drops none.

Before, a redeploy stopped the running server first: ~0.5 s of 503s (`function_unavailable`, then
`not_ready`) per deploy. Now the new server starts beside the old one, the gateway keeps routing to the old one
until the new one is ready, then switches and the old one is drained (rolling.py). Clients here are the official
`openai` SDK (streamed and not) and a raw msgpack client, each sending requests back to back for the whole
deploy; the change (a longer system prompt) shows in each answer's prompt token count.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgpack
import openai
import pytest

from packager.targets.local.server_process import free_port
from tests.conftest import DEMO_FUNCTION
from tests.deploy_local.conftest import FUNCTION, Workspace, pid_alive

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "Say hi."}]
OLD_PROMPT = 'system_prompt = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"'
NEW_PROMPT = 'system_prompt = "You are a terse assistant. Answer in as few words as you can, and never apologise."'


class Traffic:
    """Clients sending requests back to back until stopped; what each answer's prompt was, and every failure."""

    def __init__(self, base: str, key: str) -> None:
        self.base, self.key = base, key
        self.prompts: dict[str, list[int]] = {}
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, clients: dict[str, Callable[[], int]]) -> None:
        for name, ask in clients.items():
            self.prompts[name] = []
            thread = threading.Thread(target=self._loop, args=(name, ask))
            thread.start()
            self._threads.append(thread)
        deadline = time.monotonic() + 120
        while not all(self.prompts.values()) and not self.failures:  # every client's first answer
            assert time.monotonic() < deadline, "the clients got no first answer"
            time.sleep(0.05)
        assert not self.failures, self.failures

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def _loop(self, name: str, ask: Callable[[], int]) -> None:
        while not self._stop.is_set():
            try:
                self.prompts[name].append(ask())
            except Exception as exc:  # any failure at all is what this test counts
                self.failures.append(f"{name}: {type(exc).__name__}: {exc}")

    def clients(self) -> dict[str, Callable[[], int]]:
        sdk = openai.OpenAI(base_url=self.base, api_key=self.key, max_retries=0, timeout=120)

        def streamed() -> int:
            usage = None
            stream = sdk.chat.completions.create(
                model=FUNCTION, messages=QUESTION, max_tokens=16, stream=True, stream_options={"include_usage": True}
            )
            for chunk in stream:
                usage = chunk.usage or usage
            assert usage is not None, "the stream ended without its usage chunk"
            return usage.prompt_tokens

        def whole() -> int:
            answer = sdk.chat.completions.create(model=FUNCTION, messages=QUESTION, max_tokens=16)
            assert answer.usage is not None and answer.choices[0].message.content
            return answer.usage.prompt_tokens

        def packed() -> int:
            body = msgpack.packb({"model": FUNCTION, "messages": QUESTION, "max_tokens": 16})
            headers = {"authorization": f"Bearer {self.key}", "content-type": "application/msgpack"}
            headers["accept"] = "application/msgpack"
            answer = httpx.post(f"{self.base}/chat/completions", content=body, headers=headers, timeout=120)
            assert answer.status_code == 200, answer.content[:300]
            return int(msgpack.unpackb(answer.content)["usage"]["prompt_tokens"])

        return {"sdk-stream": streamed, "sdk": whole, "msgpack": packed}


def redeploy_under_traffic(space: Workspace, toml: str) -> tuple[Traffic, dict[str, Any], dict[str, Any], str]:
    """Deploy `toml`, then the changed one while clients send requests; (traffic, first record, second, stdout)."""
    folder = space.add_function(FUNCTION, toml)
    first = space.pkg("deploy", str(folder))
    assert first.returncode == 0, first.stderr
    before = space.state()
    key = (space.state_dir() / "api-key").read_text()
    traffic = Traffic(f"{space.gateway_url}/v1", key)
    traffic.start(traffic.clients())
    try:
        (folder / "function.toml").write_text(toml.replace(OLD_PROMPT, NEW_PROMPT))
        second = space.pkg("deploy", str(folder))
        assert second.returncode == 0, second.stderr
        time.sleep(2.0)  # answers from the new server only
    finally:
        traffic.stop()
    return traffic, before, space.state(), second.stdout


def test_a_redeploy_of_a_changed_function_drops_no_request(workspace: Workspace) -> None:
    toml = (DEMO_FUNCTION / "function.toml").read_text()
    assert OLD_PROMPT in toml
    traffic, before, after, said = redeploy_under_traffic(workspace, toml)
    assert traffic.failures == []
    old, new = traffic.prompts["sdk"][0], traffic.prompts["sdk"][-1]
    assert new > old  # the longer system prompt: every client's last answers came from the new server
    for name, prompts in traffic.prompts.items():
        assert prompts[0] == old and prompts[-1] == new, (name, prompts)
        assert set(prompts) == {old, new}, (name, prompts)
    assert after["pid"] != before["pid"] and not pid_alive(int(str(before["pid"])))
    assert after["ready"] is True and after["previous_pid"] == 0
    assert f"pid {before['pid']}" in " ".join(said.split())  # "replaced pid N"
    served = sum(len(prompts) for prompts in traffic.prompts.values())
    print(f"{served} requests across the redeploy, 0 failed")


def test_a_redeploy_on_a_fixed_port_holds_requests_instead_of_failing_them(workspace: Workspace) -> None:
    """The new server needs the old one's port: the old one is drained and stopped first, and requests wait at
    the gateway until the new one is ready (slower answers, no errors)."""
    port = free_port("127.0.0.1")
    toml = (DEMO_FUNCTION / "function.toml").read_text().replace("port = 0", f"port = {port}")
    traffic, before, after, _ = redeploy_under_traffic(workspace, toml)
    assert traffic.failures == []
    assert after["port"] == before["port"] == port and after["pid"] != before["pid"]
    for prompts in traffic.prompts.values():
        assert prompts[-1] > prompts[0]
