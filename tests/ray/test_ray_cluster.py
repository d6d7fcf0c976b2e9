"""`pkg deploy --target ray` against a real cluster (tests/ray/cluster.py): a head and two worker nodes, moto as
the S3 bundle store, the demo function, the official OpenAI client through Ray Serve's proxy.

The tests run in order on one deployment, as an operator's day would: deploy, serve, scale up under load,
bound the queue, lose a replica mid-stream, lose a node, scale to zero and wake, read the logs, destroy.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import boto3
import httpx
import msgpack
import openai
import pytest

from packager.bench.gateway import cpu_seconds
from tests.ray.cluster import BUCKET
from tests.ray.conftest import FUNCTION, Deployed

PROMPTS = [f"Write one sentence about the number {n}." for n in range(8)]
WAIT = 240.0  # generous: replicas load the model on a loaded 2-core machine


def wait_for(what: str, check: Any, timeout: float = WAIT, poll: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(poll)


def chat(client: openai.OpenAI, prompt: str, max_tokens: int = 24) -> str:
    reply = client.chat.completions.create(
        model=FUNCTION, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].message.content or ""


def stream(client: openai.OpenAI, prompt: str, max_tokens: int = 24) -> str:
    chunks = client.chat.completions.create(
        model=FUNCTION, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True,
    )  # fmt: skip
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def busiest(replicas: list[dict[str, Any]], window: float = 0.5) -> dict[str, Any]:
    before = {r["pid"]: cpu_seconds(r["pid"]) for r in replicas}
    time.sleep(window)
    return max(replicas, key=lambda r: cpu_seconds(r["pid"]) - before[r["pid"]])


def test_deploy_serves_the_runtime_app_through_serve_s_proxy(deployed: Deployed) -> None:
    report = deployed.deploy()
    assert report["applied"] and report["state"] == "ready"
    plan = {(row["action"], row["resource"]) for row in report["plan"]}
    assert plan == {("create", "bundle"), ("create", "serve-application")}
    digest = report["bundle_digest"]
    # The bundle lies in the store under its digest, every file the manifest lists, the manifest last.
    s3 = boto3.client("s3", endpoint_url=deployed.cluster.moto_outside, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")  # fmt: skip
    prefix = f"functions/bundles/{digest.removeprefix('sha256:')}/"
    keys = {o["Key"].removeprefix(prefix) for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]}
    manifest = json.loads(s3.get_object(Bucket=BUCKET, Key=prefix + "manifest.json")["Body"].read())
    assert keys == {*manifest["files"], "manifest.json"}

    client = deployed.client()
    assert [m.id for m in client.models.list().data] == [FUNCTION]
    alone = chat(client, PROMPTS[0])
    assert alone and stream(client, PROMPTS[0]) == alone
    # msgpack in and out, as on every target.
    response = httpx.post(
        f"{deployed.base_url}/chat/completions",
        content=msgpack.packb({"model": FUNCTION, "messages": [{"role": "user", "content": PROMPTS[0]}],
                               "max_tokens": 24, "temperature": 0}),
        headers={"Authorization": f"Bearer {deployed.key}", "Content-Type": "application/msgpack",
                 "Accept": "application/msgpack"},
        timeout=120,
    )  # fmt: skip
    assert response.headers["content-type"] == "application/msgpack"
    assert msgpack.unpackb(response.content)["choices"][0]["message"]["content"] == alone
    # Auth and the Host check are the runtime's own; Serve's own 404 comes in the same shape.
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=deployed.base_url, api_key="wrong", max_retries=0).models.list()
    refused = httpx.get(f"{deployed.base_url}/models", headers={"Host": "evil.example",
                        "Authorization": f"Bearer {deployed.key}"})  # fmt: skip
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "host_not_allowed"
    missing = httpx.get(f"{deployed.cluster.proxy}/no-such-function/v1/models")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    # A second deploy of the same thing changes nothing.
    assert deployed.deploy()["changes"] is False


def test_replicas_rise_on_both_workers_and_concurrent_streams_equal_alone(deployed: Deployed) -> None:
    client = deployed.client()
    alone = [stream(client, prompt) for prompt in PROMPTS]
    nodes_seen: set[str] = set()
    together: list[str] = []
    deadline = time.monotonic() + WAIT
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        while len(nodes_seen) < 2:  # rounds of 8 concurrent streams until the autoscaler has added a replica
            assert time.monotonic() < deadline, f"no second replica within {WAIT:.0f} s: {deployed.replicas()}"
            round_ = [pool.submit(stream, client, prompt) for prompt in PROMPTS]
            while not all(f.done() for f in round_):
                nodes_seen |= {tuple(r["node"]) for r in deployed.replicas()}  # type: ignore[misc]
                time.sleep(0.5)
            together = [f.result() for f in round_]
            assert together == alone  # greedy: the same replies whatever else runs and wherever they run
    workers = {name for node in nodes_seen for name in node if name.startswith("worker_")}
    assert workers == {"worker_a", "worker_b"}
    # Each worker fetched the bundle once into its own cache, verified; the head, which runs no replica, did not.
    for node in ("worker_a", "worker_b"):
        cached = [p.name for p in deployed.cluster.cache(node).iterdir() if p.name.startswith("bundle-")]
        assert len(cached) == 1 and not cached[0].count(".partial")
    assert not deployed.cluster.cache("head").exists()


def test_a_full_proxy_queue_answers_429_with_retry_after(deployed: Deployed) -> None:
    running = len(deployed.replicas())
    capacity = running * 8 + 16  # max_ongoing_requests (min(2 x max_batch, max_queue)) each + max_queued_requests
    burst = capacity + 16
    # Sent at once, each holding its slot for all 48 tokens: on a fast host, one-sentence answers that end at EOS
    # freed slots before the burst had all arrived, and nothing was refused.
    together = threading.Barrier(burst)
    body = {"model": FUNCTION, "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 48,
            "ignore_eos": True}  # fmt: skip

    def one(_: int) -> httpx.Response:
        together.wait()
        return httpx.post(
            f"{deployed.base_url}/chat/completions", json=body,
            headers={"Authorization": f"Bearer {deployed.key}"}, timeout=300,
        )  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(burst) as pool:
        answers = list(pool.map(one, range(burst)))
    refused = [a for a in answers if a.status_code == 429]
    assert refused and all(a.status_code in (200, 429) for a in answers), [a.status_code for a in answers]
    for answer in refused:
        assert int(answer.headers["retry-after"]) >= 1
        assert answer.json()["error"]["code"] == "serve_queue_full"


def test_a_replica_killed_mid_stream_ends_the_stream_cleanly_and_is_replaced(deployed: Deployed) -> None:
    client = deployed.client()
    replicas = deployed.replicas()
    chunks = client.chat.completions.create(
        model=FUNCTION, messages=[{"role": "user", "content": "Tell a long story about a dragon."}],
        max_tokens=300, stream=True,
    )  # fmt: skip
    received = 0
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="replica answering this request stopped") as ended:
        for _ in chunks:
            received += 1
            if received == 3:  # the replica decoding this stream is the one whose CPU time grows meanwhile
                victim = busiest(replicas)
                os.kill(victim["pid"], signal.SIGKILL)
    assert received >= 3 and time.monotonic() - started < 60  # ended, not hung
    assert ended.value.body is None or "replica_lost" in json.dumps(ended.value.body)
    assert chat(client, PROMPTS[2])  # the next request is answered (by a survivor or the replacement)
    wait_for("a replacement replica", lambda: victim["replica_id"] not in {r["replica_id"] for r in deployed.replicas()}
             and deployed.replicas())  # fmt: skip


def test_a_stopped_worker_node_s_replicas_come_back_on_the_other(deployed: Deployed) -> None:
    client = deployed.client()
    on_a = [r for r in deployed.replicas() if "worker_a" in r["node"]]
    if not on_a:  # put one there: scale up again so both workers hold a replica
        deployed.write_spec(min_replicas=2)
        deployed.deploy()
        on_a = wait_for("a replica on worker_a", lambda: [r for r in deployed.replicas() if "worker_a" in r["node"]])
    deployed.cluster.stop_node("worker_a")  # `ray start` ends: the node drains, its processes go
    replicas = wait_for(
        "every replica on worker_b",
        lambda: (found := deployed.replicas()) and all("worker_b" in r["node"] for r in found) and found,
    )
    assert replicas and chat(client, PROMPTS[3])
    deployed.cluster.start_node("worker_a")  # back for the tests after this one


def test_scale_to_zero_then_a_request_wakes_it(deployed: Deployed) -> None:
    deployed.write_spec(min_replicas=0, idle_timeout=2)
    deployed.deploy()
    wait_for("zero replicas", lambda: not deployed.replicas() and not deployed.replicas("STARTING"))
    status = json.loads(deployed.pkg("status", f"functions/{FUNCTION}", "--target", "ray", "--json").stdout)
    assert status[0]["state"] == "idle" and "scaled to zero" in status[0]["detail"]
    started = time.monotonic()
    assert chat(deployed.client(), PROMPTS[4]) == chat(deployed.client(), PROMPTS[4])
    woke = time.monotonic() - started
    assert deployed.replicas() and woke < WAIT


def test_logs_read_the_replicas_files_on_their_nodes(deployed: Deployed) -> None:
    result = deployed.pkg("logs", f"functions/{FUNCTION}", "--target", "ray")
    assert result.returncode == 0, result.stderr
    assert "fetch and verify" in result.stdout  # the runtime's own start-up line, from a replica's log file
    assert f"POST /{FUNCTION} 200" in result.stdout  # Serve's access log of the same replica


def test_destroy_removes_the_application_and_keeps_the_bundle(deployed: Deployed) -> None:
    result = deployed.pkg("destroy", f"functions/{FUNCTION}", "--target", "ray")
    assert result.returncode == 0, result.stderr
    assert FUNCTION not in deployed.cluster.serve_details()["applications"]
    assert not (deployed.root / "build" / FUNCTION / "ray" / "state.json").exists()
    gone = httpx.get(f"{deployed.base_url}/models")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    assert Path(deployed.cluster.cache("worker_b")).exists()
