"""What a web page can make the user's browser send to a keyless local function is refused (issue 47, row 8).

A function without `[endpoint] api_key_env` (the documented default) serves anyone who reaches 127.0.0.1. A page
the user visits could rebind its own name to 127.0.0.1 (DNS rebinding, Ollama's CVE-2024-28224) and read the
model's answers, or post a form to it. These run a real `python -m runtime serve` process without a key and the
real gateway process, and attack them with raw requests of the attack's shape and with a real browser (Debian's
chromium, driven by playwright), the page's name mapped to 127.0.0.1 as the attacker's DNS would.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import pytest
from playwright.sync_api import Browser, sync_playwright

from tests.reliability.live import LiveServer, free_port, live_server

pytestmark = pytest.mark.real_model
CHROMIUM = Path("/usr/bin/chromium")
ALLOWED_NAME = "llm.example.org"  # a public-looking name the user allows explicitly
CHAT = {"model": "smollm2-chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
REFUSED_HOSTS = ["evil.example", "evil.example:80", "EVIL.Example.", "127.0.0.1.nip.io", "localhost.evil.example"]
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "LOCALHOST.", "[::1]", "127.0.0.2", "10.1.2.3", "llm", "box.local",
                 "svc.ns.svc.cluster.local", "app.localhost", ALLOWED_NAME]  # fmt: skip
SIMPLE_TYPES = ["text/plain", "text/plain;charset=UTF-8", "multipart/form-data; boundary=x",
                "application/x-www-form-urlencoded", "TEXT/PLAIN"]  # fmt: skip


@pytest.fixture(scope="module")
def keyless(demo_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("keyless") / "server.log"
    flags = ["--max-tokens", "2", "--temperature", "0", "--allowed-host", ALLOWED_NAME]
    with live_server(demo_bundle, log, flags, auth=False) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real gateway process over an empty state folder: no function needed to reach its guard."""
    state = tmp_path_factory.mktemp("gateway-state")
    port = free_port()
    env = {**os.environ, "XDG_STATE_HOME": str(state), "ONNXFN_ALLOWED_HOSTS": ALLOWED_NAME}
    command = [sys.executable, "-m", "packager.gateway", "--host", "127.0.0.1", "--port", str(port)]
    log = (state / "gateway.log").open("wb")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (state / "gateway.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def refused(response: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["type"]) == (code, "invalid_request_error"), error
    return dict(error)


@pytest.mark.parametrize("host", REFUSED_HOSTS)
@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                                              ("GET", "/health"), ("PUT", "/v1/adapters/x")])  # fmt: skip
def test_a_host_that_is_not_this_servers_is_a_403(keyless: LiveServer, host: str, method: str, path: str) -> None:
    response = httpx.request(method, keyless.url + path, json=CHAT, headers={"Host": host}, timeout=30)
    error = refused(response, 403, "host_not_allowed")
    assert "--allowed-host" in str(error["message"])


@pytest.mark.parametrize("host", ALLOWED_HOSTS)
def test_local_names_addresses_and_allowed_names_are_served(keyless: LiveServer, host: str) -> None:
    response = httpx.post(keyless.url + "/v1/chat/completions", json=CHAT, headers={"Host": host}, timeout=60)
    assert response.status_code == 200, response.text


def test_a_request_without_host_is_served(keyless: LiveServer) -> None:
    """HTTP/1.0 has no Host; no browser sends such a request."""
    with socket.create_connection(("127.0.0.1", int(keyless.url.rsplit(":", 1)[1])), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("content_type", SIMPLE_TYPES)
def test_bodies_a_browser_sends_across_sites_unasked_are_a_415(keyless: LiveServer, content_type: str) -> None:
    response = httpx.post(
        keyless.url + "/v1/chat/completions", content=json.dumps(CHAT), headers={"Content-Type": content_type}
    )
    error = refused(response, 415, "unsupported_media_type")
    assert "application/json" in str(error["message"])


@pytest.mark.parametrize("origin", ["http://evil.example", "https://evil.example:8443", "null"])
def test_a_request_from_another_sites_page_is_a_403(keyless: LiveServer, origin: str) -> None:
    response = httpx.post(keyless.url + "/v1/chat/completions", json=CHAT, headers={"Origin": origin})
    refused(response, 403, "cross_origin_request")


def test_json_msgpack_untyped_bodies_and_local_origins_are_served(keyless: LiveServer) -> None:
    url = keyless.url + "/v1/chat/completions"
    assert httpx.post(url, content=json.dumps(CHAT)).status_code == 200  # curl --data-binary without -H
    packed = httpx.post(url, content=msgpack.packb(CHAT), headers={"Content-Type": "application/msgpack"})
    assert packed.status_code == 200
    for origin in (keyless.url, "http://localhost:3000"):  # the gateway's page; another local app
        assert httpx.post(url, json=CHAT, headers={"Origin": origin}).status_code == 200


def test_the_gateway_refuses_the_same(gateway: str) -> None:
    for host in REFUSED_HOSTS:
        refused(httpx.get(gateway + "/health", headers={"Host": host}), 403, "host_not_allowed")
        refused(httpx.post(gateway + "/v1/chat/completions", json=CHAT, headers={"Host": host}), 403,
                "host_not_allowed")  # fmt: skip
    for content_type in SIMPLE_TYPES:
        response = httpx.post(gateway + "/v1/chat/completions", content=b"{}", headers={"Content-Type": content_type})
        refused(response, 415, "unsupported_media_type")
    refused(httpx.post(gateway + "/v1/chat/completions", json=CHAT, headers={"Origin": "http://evil.example"}), 403,
            "cross_origin_request")  # fmt: skip
    msgpack_error = httpx.get(gateway + "/health", headers={"Host": "evil.example", "Accept": "application/msgpack"})
    assert msgpack_error.status_code == 403 and msgpack_error.headers["content-type"] == "application/msgpack"
    for host in ("127.0.0.1", "localhost", ALLOWED_NAME):  # the last from $ONNXFN_ALLOWED_HOSTS
        assert httpx.get(gateway + "/health", headers={"Host": host}).status_code == 200
    # Past the guard, the gateway's own answer: nothing is deployed here.
    assert httpx.post(gateway + "/v1/chat/completions", json=CHAT).status_code == 404


# ---- a real browser ---------------------------------------------------------------------------------------

# The attacker's page: once its name points at 127.0.0.1, a same-origin fetch reaches the function, and the
# browser lets the page read the answer.
REBINDING_PAGE = """<script>
fetch('/v1/chat/completions', {method: 'POST', headers: {'content-type': 'application/json'},
  body: JSON.stringify(%s)}).then(async r => { window.result = r.status + ' ' + await r.text(); },
                                   e => { window.result = 'failed ' + e; });
</script>"""
# A page of another site posting to the function without reading the answer: a simple request, sent unasked.
CROSS_SITE_PAGE = """<script>
fetch('%s/v1/chat/completions', {method: 'POST', mode: 'no-cors', body: JSON.stringify(%s)})
  .then(r => { window.result = 'sent'; }, e => { window.result = 'failed ' + e; });
</script>"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert CHROMIUM.exists(), "the browser tests need Debian's chromium: bash scripts/setup_browser.sh"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=[
                "--no-sandbox",  # as root (CI, these machines) Chromium's sandbox cannot start
                # The attacker's DNS, rebound: its names now answer with 127.0.0.1.
                "--host-resolver-rules=MAP rebind.test 127.0.0.1, MAP attacker.test 127.0.0.1",
                # Chromium 156 asks the user before a public page reaches a local address (Local Network Access);
                # Firefox and Safari do not, and a user may allow it: the server must hold on its own.
                "--disable-features=LocalNetworkAccessChecks,BlockInsecurePrivateNetworkRequests",
            ],
        )
        try:
            yield launched
        finally:
            launched.close()


def attack(browser: Browser, page_url: str, html: str) -> str:
    """Open `page_url` served with `html` (as the attacker's server would serve it), wait for its script."""
    page = browser.new_page()
    try:
        page.route(page_url, lambda route: route.fulfill(body=html, content_type="text/html"))
        page.goto(page_url)
        page.wait_for_function("window.result !== undefined", timeout=60_000)
        return str(page.evaluate("window.result"))
    finally:
        page.close()


def chat_requests(server: LiveServer) -> float:
    """Chat completions the server answered with 200 so far, from its /metrics."""
    wanted = 'onnxfn_http_requests_total{route="chat",status="200"}'
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(wanted):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_rebinding_page_cannot_read_the_model_and_a_cross_site_page_cannot_run_it(
    keyless: LiveServer, browser: Browser, demo_bundle: Path, tmp_path: Path
) -> None:
    port = keyless.url.rsplit(":", 1)[1]
    body = json.dumps(CHAT)
    answered = chat_requests(keyless)
    rebound = attack(browser, f"http://rebind.test:{port}/attack.html", REBINDING_PAGE % body)
    assert rebound.startswith("403 ") and "host_not_allowed" in rebound, rebound
    # A page of another site (its name, like any, may point anywhere) posts text/plain and cannot read the answer.
    sent = attack(browser, f"http://attacker.test:{free_port()}/", CROSS_SITE_PAGE % (keyless.url, body))
    assert sent == "sent", sent  # the browser sent it; the server refused it (its Origin), as its log says
    log = keyless.log.read_text()
    assert log.count('"POST /v1/chat/completions HTTP/1.1" 403') >= 2, log[-2000:]
    # A local page (another app on localhost) gets as far as the body type: text/plain is refused too.
    local = attack(browser, f"http://localhost:{free_port()}/", CROSS_SITE_PAGE % (keyless.url, body))
    assert local == "sent", local
    assert '"POST /v1/chat/completions HTTP/1.1" 415' in keyless.log.read_text()
    assert chat_requests(keyless) == answered  # none of them ran the model

    # The same rebinding page against a server with the guard turned off reads the model's answer: the attack
    # this test makes is the real one.
    with live_server(
        demo_bundle, tmp_path / "open.log", ["--max-tokens", "2", "--allowed-host", "*"], auth=False
    ) as server:
        open_port = server.url.rsplit(":", 1)[1]
        read = attack(browser, f"http://rebind.test:{open_port}/attack.html", REBINDING_PAGE % body)
        assert read.startswith("200 ") and '"choices"' in read, read
