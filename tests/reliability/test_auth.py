"""Auth with a key configured: every route but `/health` needs it (`/ready` answers probes without details),
a wrong or missing key is a 401 whose timing does not depend on the guess, and the key never leaks."""

from __future__ import annotations

import statistics
import time

import httpx
import pytest

from tests.reliability.live import LiveServer

pytestmark = pytest.mark.real_model
GUARDED = [
    ("GET", "/v1/models"),
    ("GET", "/v1/models/smollm2-chat"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
]


@pytest.mark.parametrize(("method", "path"), GUARDED)
def test_every_route_but_the_probes_needs_the_key(live: LiveServer, method: str, path: str) -> None:
    wrong = "Bearer " + live.key[:-1] + ("0" if live.key[-1] != "0" else "1")
    for headers in ({}, {"Authorization": wrong}, {"Authorization": "Basic " + live.key}, {"Authorization": "Bearer"}):
        response = httpx.request(method, live.url + path, headers=headers, json={}, timeout=30)
        assert response.status_code == 401, (path, headers, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.request(method, live.url + path, headers=live.auth, json={}, timeout=30).status_code != 401


def test_probes_stay_open_but_say_little(live: LiveServer) -> None:
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    assert httpx.get(live.url + "/ready").json() == {"status": "ready"}  # no model name without the key
    detailed = httpx.get(live.url + "/ready", headers=live.auth).json()
    # A fresh `runtime serve` loads the prefill graph after it is ready.
    assert detailed.pop("prompt_graph") in ("loading", "prefill graph")
    assert detailed.pop("warm") in (True, False)  # true once that graph and the huge-page move are done
    assert detailed == {"status": "ready", "model": live.model}


def test_openapi_document_declares_the_bearer_scheme(live: LiveServer) -> None:
    doc = httpx.get(live.url + "/openapi.json", headers=live.auth).json()
    assert doc["openapi"].startswith("3.1") and doc["security"] == [{"bearer": []}]
    assert doc["paths"]["/health"]["get"]["security"] == [{}]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics", "/ready"} <= doc["paths"].keys()


def _median_401_seconds(client: httpx.Client, url: str, token: str, rounds: int) -> list[float]:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        assert client.get(url, headers={"Authorization": f"Bearer {token}"}).status_code == 401
        samples.append(time.perf_counter() - started)
    return samples


def test_401_timing_does_not_depend_on_how_much_of_the_key_was_right(live: LiveServer) -> None:
    """Medians of interleaved batches: a near-miss (all but the last character right) against a guess that
    shares nothing. The bound is generous (2x) so scheduler noise cannot fail it; a comparison that stopped at
    the first wrong byte would not show over HTTP either, which is why auth.py compares digests."""
    near = live.key[:-1] + ("0" if live.key[-1] != "0" else "1")
    far = "".join("z" if c != "z" else "y" for c in live.key)
    near_times: list[float] = []
    far_times: list[float] = []
    with httpx.Client(timeout=30) as client:
        _median_401_seconds(client, live.url + "/v1/models", far, 20)  # warm the connection
        for _ in range(8):
            near_times += _median_401_seconds(client, live.url + "/v1/models", near, 12)
            far_times += _median_401_seconds(client, live.url + "/v1/models", far, 12)
    ratio = statistics.median(near_times) / statistics.median(far_times)
    assert 0.5 < ratio < 2.0, ratio


def test_the_key_never_appears_in_logs_metrics_or_error_bodies(live: LiveServer) -> None:
    wrong = live.key[::-1]
    texts = [
        httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {wrong}"}).text,
        httpx.post(live.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {wrong}"}, json={}).text,
        httpx.post(live.url + "/v1/chat/completions", headers=live.auth, json={"model": "nope"}).text,
        httpx.get(live.url + "/metrics", headers=live.auth).text,
        httpx.get(live.url + "/openapi.json", headers=live.auth).text,
        httpx.get(live.url + "/ready").text,
    ]
    for text in texts:
        assert live.key not in text and wrong not in text
    log = live.log.read_text()
    assert "GET /v1/models" in log  # the log is really captured
    assert live.key not in log and wrong not in log
