"""One endpoint for every local function, scaled to zero: the chat demo and the embedding demo deployed with
`pkg deploy`, both answering through the gateway it started, both stopped when idle (no memory held) and
woken by the next request, from the process snapshot or fresh; bounded waiting; a broken snapshot.
Real `pkg` processes, the real models, the real CRIU (scripts/setup_criu.sh)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from packager.targets.local import lock
from tests.conftest import DEMO_FUNCTION
from tests.deploy_local.conftest import FUNCTION, Workspace, pid_alive
from tests.encoder.conftest import EMBED_FUNCTION, embed_build, embed_bundle  # noqa: F401 (fixtures)

pytestmark = pytest.mark.real_model

EMBED = "minilm-embed"
IDLE = 3  # seconds
MAX_WAKING = 2


def spec(source: Path) -> str:
    """The demo's function.toml with a short idle timeout and a small waiting room."""
    toml = source.read_text()
    if "[targets.local]" not in toml:
        toml += "\n[targets.local]\n"
    settings = f"[targets.local]\nidle_timeout = {IDLE}\nmax_waking_requests = {MAX_WAKING}"
    return toml.replace("[targets.local]", settings)


def ps(space: Workspace) -> dict[str, dict[str, Any]]:
    listed = space.pkg("ps", "--json")
    assert listed.returncode == 0, listed.stderr
    return {row["name"]: row for row in json.loads(listed.stdout)}


def wait_idle(space: Workspace, *names: str) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + IDLE + 20
    while True:
        rows = ps(space)
        if all(rows[name]["state"] == "idle" for name in names):
            return rows
        assert time.monotonic() < deadline, {name: rows[name]["state"] for name in names}
        time.sleep(0.5)


def chat(client: openai.OpenAI) -> tuple[str, float]:
    """A streamed reply and the time to its first token."""
    started, first, text = time.monotonic(), 0.0, ""
    question = [{"role": "user", "content": "Name three primary colours."}]
    stream = client.chat.completions.create(model=FUNCTION, messages=question, max_tokens=16, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic() - started
            text += chunk.choices[0].delta.content
    return text, first


def test_two_functions_behind_one_url_idle_to_zero_and_wake(workspace: Workspace, embed_bundle: Path) -> None:  # noqa: F811
    chat_folder = workspace.add_function(FUNCTION, spec(DEMO_FUNCTION / "function.toml"))
    embed_folder = workspace.add_function(EMBED, spec(EMBED_FUNCTION / "function.toml"), bundle=embed_bundle)
    for folder in (chat_folder, embed_folder):
        deployed = workspace.pkg("deploy", str(folder))
        assert deployed.returncode == 0, deployed.stderr
        assert f"{workspace.gateway_url}/v1" in deployed.stdout
        assert f"after {IDLE} s without a request" in deployed.stdout
    keys = {name: (workspace.state_dir(name) / "api-key").read_text() for name in (FUNCTION, EMBED)}
    base = f"{workspace.gateway_url}/v1"
    chats = openai.OpenAI(base_url=base, api_key=keys[FUNCTION], max_retries=0, timeout=60)
    embeds = openai.OpenAI(base_url=base, api_key=keys[EMBED], max_retries=0, timeout=60)

    # One URL, routed by model; each function keeps its own key.
    reply, _ = chat(chats)
    assert reply
    vectors = embeds.embeddings.create(model=EMBED, input=["red", "green"]).data
    assert len(vectors) == 2 and len(vectors[0].embedding) == 384
    assert [m.id for m in chats.models.list().data] == [FUNCTION]
    with pytest.raises(openai.AuthenticationError):
        embeds.chat.completions.create(model=FUNCTION, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="deployed: smollm2-chat"):
        chats.chat.completions.create(model="llama-70b", messages=[{"role": "user", "content": "hi"}])

    # Idle: both processes gone, no memory; the chat demo resumes its snapshot, the embedder starts fresh.
    rows = wait_idle(workspace, FUNCTION, EMBED)
    for name in (FUNCTION, EMBED):
        assert rows[name]["rss_bytes"] == 0 and not pid_alive(rows[name]["pid"])
        assert rows[name]["url"] == workspace.gateway_url
    assert (rows[FUNCTION]["wake"], rows[EMBED]["wake"]) == ("snapshot", "fresh")
    idle_at = time.time()
    again, first_token = chat(chats)
    assert again == reply  # greedy: the resumed process answers as the first one did
    assert first_token < 2.0, f"{first_token:.2f} s from an idle function to its first token"
    assert len(embeds.embeddings.create(model=EMBED, input="blue").data[0].embedding) == 384
    # How each woke (their records; on a loaded machine either may be idle again by the time `pkg ps` looks).
    for name, start in ((FUNCTION, "restored"), (EMBED, "fresh")):
        woken = workspace.state(name)
        assert woken["start"] == start and float(str(woken["started_at"])) > idle_at, woken

    # At most MAX_WAKING requests wait for a wake; the others are told when to come back. The function's lock,
    # held meanwhile, keeps the wake from finishing before the whole burst has arrived (on a loaded machine too).
    wait_idle(workspace, FUNCTION)
    answers: list[tuple[int, httpx.Headers]] = []
    sender = threading.Thread(target=lambda: asyncio.run(burst(base, keys[FUNCTION], 8, answers)))
    with lock.held(workspace.state_dir(FUNCTION), FUNCTION, "test", print):
        sender.start()
        deadline = time.monotonic() + 60
        while len(answers) < 8 - MAX_WAKING and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Counter(status for status, _ in answers) == {429: 8 - MAX_WAKING}, answers
    sender.join(60)
    assert Counter(status for status, _ in answers) == {429: 8 - MAX_WAKING, 200: MAX_WAKING}
    refused = [headers for status, headers in answers if status == 429]
    assert all(headers["retry-after"].isdigit() for headers in refused)

    # A wake waits for a `pkg` that holds the function's lock (a deploy, a destroy), never races it.
    wait_idle(workspace, FUNCTION)
    done: list[int] = []
    with lock.held(workspace.state_dir(FUNCTION), FUNCTION, "test", print):
        waiter = threading.Thread(target=lambda: done.append(raw_chat(base, keys[FUNCTION]).status_code))
        waiter.start()
        time.sleep(1.5)
        assert not done and ps(workspace)[FUNCTION]["state"] == "idle"
    waiter.join(60)
    assert done == [200]

    # A snapshot that does not come back: the wake falls back to a fresh start and the request is answered;
    # the next idle stop dumps the server again, and the wake after that resumes it.
    wait_idle(workspace, FUNCTION)
    snapshot = workspace.state_dir(FUNCTION) / "process-snapshot"
    for pages in snapshot.glob("pages-*.img"):
        pages.unlink()
    fallback = raw_chat(base, keys[FUNCTION])
    assert fallback.status_code == 200 and fallback.headers["x-onnxfn-woke"].startswith("fresh")
    assert "criu restore failed" in str(workspace.state(FUNCTION)["start_note"])
    wait_idle(workspace, FUNCTION)
    assert list(snapshot.glob("pages-*.img"))
    resumed = raw_chat(base, keys[FUNCTION])
    assert resumed.status_code == 200 and resumed.headers["x-onnxfn-woke"].startswith("restored")

    # Destroyed functions leave the gateway; an idle one is destroyed like any other.
    wait_idle(workspace, EMBED)
    for folder in (chat_folder, embed_folder):
        assert workspace.pkg("destroy", str(folder)).returncode == 0
    time.sleep(0.6)
    gone = httpx.post(f"{base}/embeddings", json={"model": EMBED, "input": "x"}, headers=bearer(keys[EMBED]))
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def raw_chat(base: str, key: str) -> httpx.Response:
    body = {"model": FUNCTION, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return httpx.post(f"{base}/chat/completions", json=body, headers=bearer(key), timeout=60)


async def burst(base: str, key: str, count: int, answers: list[tuple[int, httpx.Headers]]) -> None:
    """Send `count` chats at once; each answer is appended as it comes (a waiter watches them arrive)."""
    body = {"model": FUNCTION, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=count)) as client:

        async def one() -> None:
            response = await client.post(f"{base}/chat/completions", json=body, headers=bearer(key))
            answers.append((response.status_code, response.headers))

        await asyncio.gather(*(one() for _ in range(count)))
