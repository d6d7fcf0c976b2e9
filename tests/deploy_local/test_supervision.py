"""Issue 47, rows 4 and 5, and per-function memory limits: the demo function deployed with `pkg deploy`, its
server killed under real clients (the official `openai` SDK among them), through the gateway `pkg` started.

- A server killed mid-answer: every stream ends with an OpenAI-style error event (never `[DONE]`), in SSE or
  msgpack framing; a request that was not streamed gets a 502 with an error body.
- The gateway starts a dead server again on the next request (from its process snapshot), with backoff; after
  five ends in a minute the function is `crashloop` in `pkg ps` with why and its log, until a redeploy.
- `[targets.local] memory_mb`: a server driven over it (a long prompt's KV cache) is ended by the kernel
  alone and started again, while another function keeps answering.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgpack
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from packager.targets.local.crashes import CRASHLOOP_CRASHES
from tests.conftest import DEMO_FUNCTION
from tests.deploy_local.conftest import FUNCTION, Workspace, pid_alive
from tests.encoder.conftest import EMBED_FUNCTION, embed_build, embed_bundle  # noqa: F401 (fixtures)

pytestmark = pytest.mark.real_model

EMBED = "minilm-embed"
QUESTION = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def with_local(source: Path, settings: str) -> str:
    toml = source.read_text()
    if "[targets.local]" not in toml:
        toml += "\n[targets.local]\n"
    return toml.replace("[targets.local]", f"[targets.local]\n{settings}")


def deploy(space: Workspace, name: str, toml: str | None = None, bundle: Path | None = None) -> str:
    """Deploy `name` (the demo's spec unless `toml`); its API key."""
    if not (space.root / "functions" / name).exists():
        space.add_function(name, toml, bundle)
    deployed = space.pkg("deploy", str(space.root / "functions" / name))
    assert deployed.returncode == 0, deployed.stderr
    space.last_deploy = deployed.stdout  # type: ignore[attr-defined]
    return (space.state_dir(name) / "api-key").read_text()


def ps(space: Workspace) -> dict[str, dict[str, Any]]:
    listed = space.pkg("ps", "--json")
    assert listed.returncode == 0, listed.stderr
    return {row["name"]: row for row in json.loads(listed.stdout)}


def kill(space: Workspace, name: str = FUNCTION) -> int:
    pid = int(str(space.state(name)["pid"]))
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pid


def wait_running(space: Workspace, key: str, count: int) -> None:
    """Until the server's engine holds `count` requests (its /metrics, read directly)."""
    url, running = f"{space.state()['url']}/metrics", None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = httpx.get(url, headers={"authorization": f"Bearer {key}"}, timeout=5).text
        families = {family.name: family for family in text_string_to_metric_families(text)}
        running = int(families["onnxfn_running_requests"].samples[0].value)
        if running == count:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server holds {running} requests after 60 s, not {count}")


def chat(space: Workspace, key: str, **extra: Any) -> httpx.Response:
    body = {"model": FUNCTION, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    return httpx.post(
        f"{space.gateway_url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=120
    )


def in_thread(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target)
    thread.start()
    return thread


def test_a_server_killed_mid_answer_fails_every_answer_and_is_started_again(workspace: Workspace) -> None:
    key = deploy(workspace, FUNCTION)
    base, auth = f"{workspace.gateway_url}/v1", {"authorization": f"Bearer {key}"}
    sdk = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
    going = {name: threading.Event() for name in ("sdk0", "sdk1", "sdk2", "sse", "msgpack")}
    results: dict[str, Any] = {}
    body = {"model": FUNCTION, "messages": QUESTION, "max_tokens": 400, "stream": True}

    def sdk_stream(name: str) -> None:
        chunks = 0
        try:
            for _ in sdk.chat.completions.create(model=FUNCTION, messages=QUESTION, max_tokens=400, stream=True):
                chunks += 1
                if chunks == 3:
                    going[name].set()
            results[name] = ("finished", chunks)
        except openai.APIError as exc:
            results[name] = ("raised", chunks, exc)

    def sse() -> None:
        lines = []
        with httpx.stream("POST", f"{base}/chat/completions", json=body, headers=auth, timeout=120) as events:
            for line in events.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                    if len(lines) == 3:
                        going["sse"].set()
        results["sse"] = lines

    def msgpack_stream() -> None:
        frames, unpacker = [], msgpack.Unpacker(raw=False)
        headers = {**auth, "accept": "application/msgpack"}
        with httpx.stream("POST", f"{base}/chat/completions", json=body, headers=headers, timeout=120) as events:
            for data in events.iter_bytes():
                unpacker.feed(data)
                frames += list(unpacker)
                if len(frames) >= 3:
                    going["msgpack"].set()
        results["msgpack"] = frames

    def whole() -> None:
        results["whole"] = chat(workspace, key, messages=QUESTION, max_tokens=400)

    threads = [in_thread(lambda n=name: sdk_stream(n)) for name in ("sdk0", "sdk1", "sdk2")]  # type: ignore[misc]
    threads += [in_thread(sse), in_thread(msgpack_stream), in_thread(whole)]
    for name, event in going.items():  # every stream is under way
        assert event.wait(120), f"{name} never got its first chunks: {results.get(name)}"
    wait_running(workspace, key, len(threads))  # and the non-streamed request is in the batch too
    pid = kill(workspace)
    for thread in threads:
        thread.join(120)

    for name in ("sdk0", "sdk1", "sdk2"):  # the SDK raises: a dead server is not a finished answer
        outcome, chunks, error = results[name]
        assert outcome == "raised" and chunks >= 3 and "ended while answering" in str(error), results[name]
    assert "data: [DONE]" not in results["sse"]
    last = json.loads(results["sse"][-1].removeprefix("data:"))
    assert last["error"]["code"] == "function_crashed" and last["error"]["type"] == "server_error"
    assert len(results["msgpack"]) > 3 and results["msgpack"][-1]["error"]["code"] == "function_crashed"
    assert all("error" not in frame for frame in results["msgpack"][:-1])
    refused = results["whole"]
    assert refused.status_code == 502 and refused.json()["error"]["code"] == "function_crashed", refused.text
    assert f"pid {pid}" in refused.json()["error"]["message"]

    # The gateway starts it again (from the process snapshot the deploy took); the next request is answered.
    again = chat(workspace, key)
    assert again.status_code == 200, again.text
    row = ps(workspace)[FUNCTION]
    assert row["state"] == "ready" and row["pid"] != pid
    assert row["crashes"] == 1 and "was killed by SIGKILL" in row["last_crash"]
    assert workspace.state()["start"] == "restored"
    table = workspace.pkg("ps").stdout
    assert "started again by the gateway 1x in the last minute" in " ".join(table.split())


def test_a_function_that_keeps_ending_is_marked_crashloop_until_it_is_redeployed(workspace: Workspace) -> None:
    key = deploy(workspace, FUNCTION)
    pauses = []
    for _ in range(CRASHLOOP_CRASHES):
        started = time.monotonic()
        answered = chat(workspace, key)  # a dead server is started again first: the client sees no error
        assert answered.status_code == 200, answered.text
        pauses.append(time.monotonic() - started)
        kill(workspace)
    refused = chat(workspace, key)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "crashloop", refused.text
    assert int(refused.headers["retry-after"]) > 0
    message = refused.json()["error"]["message"]
    # How the last one ended: a server resumed from a snapshot has no launcher to record its exit status.
    assert f"ended {CRASHLOOP_CRASHES} times within 60 s, last: the server (pid" in message
    assert "it was resumed from a process snapshot" in message
    assert f"pkg deploy {workspace.root / 'functions' / FUNCTION}" in message

    row = ps(workspace)[FUNCTION]
    assert row["state"] == "crashloop" and row["rss_bytes"] is None
    assert "the gateway stopped starting it again" in row["reason"] and row["log_tail"]
    table = workspace.pkg("ps")
    assert table.returncode == 0 and "crashloop" in table.stdout and row["log_tail"][-1].strip() in table.stdout
    status = workspace.pkg("status", str(workspace.root / "functions" / FUNCTION))
    assert status.returncode == 1 and "crashloop" in status.stdout

    # A redeploy starts over.
    deploy(workspace, FUNCTION)
    again = chat(workspace, key)
    assert again.status_code == 200, again.text
    assert ps(workspace)[FUNCTION]["state"] == "ready" and ps(workspace)[FUNCTION]["crashes"] == 0
    assert pauses[1] < pauses[-1]  # the restarts backed off (0 s, 0.5 s, 1 s, 2 s before them)


def test_a_function_over_its_memory_is_ended_alone_and_started_again(
    workspace: Workspace,
    embed_bundle: Path,  # noqa: F811
) -> None:
    # Idle, the demo's server holds ~95 MiB; a 1,000-token prompt's KV cache (46 KB a token) takes it over 150.
    chat_key = deploy(workspace, FUNCTION, with_local(DEMO_FUNCTION / "function.toml", "memory_mb = 150"))
    said = " ".join(workspace.last_deploy.split())  # type: ignore[attr-defined]
    assert "at most 150 MiB (cgroup v" in said and "over it, this server alone is ended" in said
    cgroup = Path(str(workspace.state()["cgroup"]))
    assert cgroup.is_dir() and str(workspace.state()["pid"]) in (cgroup / "cgroup.procs").read_text().split()
    embed_key = deploy(workspace, EMBED, (EMBED_FUNCTION / "function.toml").read_text(), bundle=embed_bundle)
    embeds = openai.OpenAI(base_url=f"{workspace.gateway_url}/v1", api_key=embed_key, max_retries=0, timeout=60)

    answered: list[int] = []
    failures: list[str] = []
    stop = threading.Event()

    def embed_meanwhile() -> None:
        while not stop.is_set():
            try:
                vectors = embeds.embeddings.create(model=EMBED, input=["the other function"]).data
                answered.append(len(vectors[0].embedding))
            except openai.APIError as exc:
                failures.append(str(exc))
            stop.wait(0.2)

    watcher = in_thread(embed_meanwhile)
    deadline = time.monotonic() + 60
    while not (answered or failures) and time.monotonic() < deadline:  # its first answer, before the attack
        time.sleep(0.05)
    assert answered, failures
    before = len(answered)
    pid = int(str(workspace.state()["pid"]))
    long_prompt = " ".join(f"w125x{i}" for i in range(125))  # ~1,000 tokens
    over = chat(workspace, chat_key, messages=[{"role": "user", "content": long_prompt}])
    assert over.status_code == 502 and over.json()["error"]["code"] == "function_crashed", over.text
    assert chat(workspace, chat_key).status_code == 200  # started again, within its limit
    time.sleep(1.0)  # a few more embeddings after the restart
    stop.set()
    watcher.join(60)

    assert not failures and len(answered) > before + 2 and set(answered) == {384}
    rows = ps(workspace)
    assert rows[FUNCTION]["state"] == "ready" and rows[FUNCTION]["pid"] != pid and rows[FUNCTION]["crashes"] == 1
    assert "went over its memory limit ([targets.local] memory_mb = 150)" in rows[FUNCTION]["last_crash"]
    assert "OOM killer" in rows[FUNCTION]["last_crash"]
    assert rows[EMBED]["crashes"] == 0 and rows[EMBED]["state"] == "ready"
    restarted = Path(str(workspace.state()["cgroup"]))
    assert restarted != cgroup and restarted.parent == cgroup.parent  # a cgroup per server
    for name in (FUNCTION, EMBED):
        assert workspace.pkg("destroy", str(workspace.root / "functions" / name)).returncode == 0
    assert not cgroup.parent.exists()  # destroy removed the function's cgroups


def test_where_no_cgroup_can_be_made_the_deploy_says_the_limit_is_not_enforced(workspace: Workspace) -> None:
    """A host without the memory controller: `pkg deploy` in a mount namespace of its own whose /sys/fs/cgroup
    is an empty tmpfs (the kernel's cgroups are there, but not mounted where anything could use them)."""
    settings = "memory_mb = 150\nprocess_snapshot = false"
    toml = with_local(DEMO_FUNCTION / "function.toml", settings).replace("process_snapshot = true", "")
    workspace.add_function(FUNCTION, toml)
    no_cgroups = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    no_cgroups += ['mount -t tmpfs none /sys/fs/cgroup && exec "$@"', "sh"]
    deployed = subprocess.run(
        [*no_cgroups, *workspace.command("deploy", str(workspace.root / "functions" / FUNCTION))],
        cwd=workspace.root, env=workspace.env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert deployed.returncode == 0, deployed.stderr
    said = " ".join(deployed.stdout.split())
    assert "memory_mb = 150 is NOT enforced: no cgroup memory controller is mounted" in said
    assert workspace.state()["cgroup"] == "" and workspace.state()["memory_mb"] == 150
    key = (workspace.state_dir() / "api-key").read_text()
    assert chat(workspace, key).status_code == 200
