"""The bytes on the wire: SSE framing, msgpack bodies and streams, malformed bodies, size limit, auth, metrics."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY, MAX_BODY_BYTES, RunningServer

pytestmark = pytest.mark.real_model

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSGPACK = "application/msgpack"


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def chat_body(server: RunningServer, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Say hello."}]
    return {"model": server.state.policy.model_name, "messages": messages, "max_tokens": 8, **extra}


def test_sse_stream_is_data_events_ending_in_done(http: httpx.Client, server: RunningServer) -> None:
    response = http.post("/v1/chat/completions", json=chat_body(server, stream=True), headers=AUTH)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == ""
    assert events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}


def test_msgpack_in_and_out_matches_json(http: httpx.Client, server: RunningServer) -> None:
    as_json = http.post("/v1/chat/completions", json=chat_body(server), headers=AUTH).json()
    response = http.post(
        "/v1/chat/completions",
        content=msgpack.packb(chat_body(server)),
        headers={**AUTH, "Content-Type": MSGPACK, "Accept": MSGPACK},
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == MSGPACK
    as_msgpack = msgpack.unpackb(response.content)
    assert as_msgpack["choices"] == as_json["choices"]
    assert as_msgpack["usage"] == as_json["usage"]


def test_msgpack_stream_is_back_to_back_maps(http: httpx.Client, server: RunningServer) -> None:
    whole = http.post("/v1/chat/completions", json=chat_body(server), headers=AUTH).json()
    body = chat_body(server, stream=True, stream_options={"include_usage": True})
    unpacker = msgpack.Unpacker()
    chunks = []
    with http.stream("POST", "/v1/chat/completions", json=body, headers={**AUTH, "Accept": MSGPACK}) as response:
        assert response.headers["content-type"] == MSGPACK
        for data in response.iter_bytes():
            unpacker.feed(data)
            chunks.extend(unpacker)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize(
    ("content", "content_type", "code"),
    [
        (b'{"model": "x", "messages": [', "application/json", "invalid_json"),
        (b"", "application/json", "invalid_json"),
        (b'{"temperature": NaN}', "application/json", "invalid_json"),
        (b"\xc1\x00", MSGPACK, "invalid_msgpack"),
    ],
)
def test_malformed_bodies_are_400(http: httpx.Client, content: bytes, content_type: str, code: str) -> None:
    response = http.post("/v1/chat/completions", content=content, headers={**AUTH, "Content-Type": content_type})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == code


def test_errors_follow_the_accept_format(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", content=b"[1]", headers={**AUTH, "Accept": MSGPACK})
    assert response.status_code == 400
    error = msgpack.unpackb(response.content)["error"]
    assert error["message"] == "the request body must be an object, got [1]"
    assert error["type"] == "invalid_request_error"


def test_oversized_bodies_are_413_with_or_without_content_length(http: httpx.Client, server: RunningServer) -> None:
    big = chat_body(server)
    big["messages"][0]["content"] = "x" * MAX_BODY_BYTES
    declared = http.post("/v1/chat/completions", json=big, headers=AUTH)
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:
        payload = json.dumps(big).encode()
        for start in range(0, len(payload), 8192):
            yield payload[start : start + 8192]

    json_type = {"Content-Type": "application/json"}
    streamed = http.post("/v1/chat/completions", content=chunked(), headers={**AUTH, **json_type})
    assert streamed.status_code == 413


def test_v1_needs_the_bearer_key_but_probes_do_not(http: httpx.Client, server: RunningServer) -> None:
    missing = http.post("/v1/chat/completions", json=chat_body(server))
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/v1/models", headers={"Authorization": "Basic " + API_KEY}).status_code == 401
    assert http.get("/health").json() == {"status": "ok"}
    # /ready stays open for orchestrators' probes but tells a caller without the key nothing more.
    assert http.get("/ready").json() == {"status": "ready"}
    detailed = {"status": "ready", "model": server.state.policy.model_name, "prompt_graph": "prefill graph"}
    answer = http.get("/ready", headers=AUTH).json()
    assert answer.pop("warm") in (True, False)  # false while the huge-page move goes on
    assert answer == detailed
    assert http.get("/metrics").status_code == 401
    assert http.get("/metrics", headers=AUTH).status_code == 200


def test_unknown_routes_and_methods_get_openai_shaped_errors(http: httpx.Client) -> None:
    missing = http.get("/v1/embeddingz", headers=AUTH)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    wrong_method = http.get("/v1/chat/completions", headers=AUTH)
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["message"] == "GET is not allowed on /v1/chat/completions"


def scrape(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    families = text_string_to_metric_families(http.get("/metrics", headers=AUTH).text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_metrics_count_requests_tokens_and_latency(http: httpx.Client, server: RunningServer) -> None:
    before = scrape(http)
    # A prompt never seen before, system message included (the template's default one is in the bundle's
    # snapshot), so the prefix cache cannot skip any of its tokens.
    body = chat_body(server, max_tokens=6, ignore_eos=True)
    body["messages"] = [{"role": "system", "content": uuid.uuid4().hex}, {"role": "user", "content": "Repeat"}]
    reply = http.post("/v1/chat/completions", json=body, headers=AUTH)
    assert reply.json()["usage"]["completion_tokens"] == 6
    after = scrape(http)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("onnxfn_http_requests_total", route="chat", status="200") == 1
    assert delta("onnxfn_time_to_first_token_seconds_count") == 1
    assert delta("onnxfn_time_per_output_token_seconds_count") == 1
    assert delta("onnxfn_generation_tokens_total") == 6
    assert delta("onnxfn_prompt_tokens_total") == reply.json()["usage"]["prompt_tokens"]
    assert after[("onnxfn_ready", ())] == 1
    assert after[("onnxfn_kv_cache_capacity_bytes", ())] > 0
    assert after[("onnxfn_running_requests", ())] == 0
    assert after[("onnxfn_queue_depth", ())] == 0
