"""Issue 37 rows 2 and 3 re-run against a real server process: grammars within memory, time and size budgets.

Before the fix (the same attacks on this machine): eight `((a{100}){100}){N}` regexes took RSS from
273 to 1,625 MB, kept while idle; a 50,000-alternative Lark grammar held `/health` for 3.7 s; the
85,000-alternative one (924 KB) answered with llguidance's panic and `<backtrace>`; a JSON schema
chaining 4,000 `$ref`s crashed the server (a stack overflow in the compiler).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.api.protocol import RequestPolicy
from runtime.engine.config import EngineConfig
from tests.reliability.live import LiveServer, live_server

pytestmark = pytest.mark.real_model

FLAGS = ["--max-batch", "4", "--max-tokens-limit", "16", "--max-tokens", "4", "--temperature", "0"]
LIMIT = RequestPolicy(model_name="", vocab_size=0).max_grammar_bytes
CACHE_BYTES = EngineConfig().grammar_cache_bytes
GRAMMAR_BYTES = EngineConfig().grammar_max_bytes
MiB = 1 << 20


@pytest.fixture(scope="module")
def server(demo_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("grammar-budgets") / "server.log"
    with live_server(demo_bundle, log, FLAGS) as running:  # the default 1 MiB body limit: the attacks fit
        chat(running, guided_regex="[a-z]+")  # the first grammar builds llguidance's tokenizer (~30 MB, once)
        yield running


def chat(server: LiveServer, **fields: Any) -> httpx.Response:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.auth, timeout=120)


def refused(response: httpx.Response, param: str, fragment: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    for leak in ("panic", "backtrace", "<state>", "<non-verbose"):
        assert leak not in error["message"], error
    return str(error["message"])


@contextmanager
def health_watch(server: LiveServer) -> Iterator[list[float]]:
    """`/health` asked every 20 ms while the block runs; yields the list its latencies go into, once it holds
    the first (on a loaded machine the block could otherwise be over before the watcher's first answer)."""
    latencies: list[float] = []
    failures: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                started = time.perf_counter()
                status = client.get(server.url + "/health").status_code
                if status != 200:
                    failures.append(f"/health answered {status}")
                latencies.append(time.perf_counter() - started)
                stop.wait(0.02)

    thread = threading.Thread(target=watch)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not latencies and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert latencies, "the /health watcher never got its first answer"
        yield latencies
    finally:
        stop.set()
        thread.join()
    assert not failures, failures


def normal_request_s(server: LiveServer) -> float:
    started = time.perf_counter()
    assert chat(server, temperature=0).status_code == 200
    return time.perf_counter() - started


def test_row_3_a_huge_grammar_is_refused_at_once_and_health_never_waits(server: LiveServer) -> None:
    huge = "start: " + " | ".join(f"/w{i}/" for i in range(85_000))  # 924 KB, as in the issue
    with health_watch(server) as latencies:
        message = refused(chat(server, guided_grammar=huge), "guided_grammar", f"at most {LIMIT} are allowed")
    assert message == f"'guided_grammar' takes {len(huge)} bytes; at most {LIMIT} are allowed"
    assert max(latencies) < 1.0
    # Within the size limit, a grammar whose first mask takes llguidance ~1 s (8,300 right-nested
    # alternatives): the compile runs on the grammar thread while `/health` answers, then a plain 400.
    rules = "\n".join(f'a{i}:a{i + 1}|"x"' for i in range(8_300))
    deep = f'start:a0\n{rules}\na8300:"e"'
    with health_watch(server) as latencies:
        started = time.perf_counter()
        message = refused(chat(server, guided_grammar=deep), "guided_grammar", "")
        compile_s = time.perf_counter() - started
    # llguidance's own refusal; on a loaded machine the compile can outlast its time budget first: a 400 too.
    parsed = message.startswith("invalid guided_grammar: Parser Error: Current row has ") and "max is 2000" in message
    assert parsed or message.startswith("'guided_grammar' took longer than"), message
    assert compile_s > 0.3 and len(latencies) > 5 and max(latencies) < 1.0


def test_tools_beyond_the_limits_are_400s_naming_tools(server: LiveServer) -> None:
    def tool(name: str, properties: int) -> dict[str, Any]:
        schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}
        return {"type": "function", "function": {"name": name, "parameters": schema}}

    many = [tool(f"f{i}", 1) for i in range(3000)]
    refused(chat(server, tools=many), "tools", "'tools' has 3000 functions; at most 128 are allowed")
    wide = [tool(f"f{i}", 250) for i in range(100)]  # ~500 KB of schemas
    refused(chat(server, tools=wide), "tools", "at most 131072 are allowed")
    bad = [tool("ok", 1), {"type": "function", "function": {"name": "f", "parameters": {"type": "nada"}}}]
    refused(chat(server, tools=bad), "tools[1].function.parameters", "invalid JSON schema")


def test_a_schema_chaining_4000_refs_compiles_without_crashing_the_server(server: LiveServer) -> None:
    defs: dict[str, Any] = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(4_000)}
    defs["a4000"] = {"type": "string", "maxLength": 8}
    response = chat(server, guided_json={"$ref": "#/$defs/a0", "$defs": defs})
    assert response.status_code == 200, response.text
    assert server.process.poll() is None
    assert chat(server).status_code == 200


def test_row_2_regexes_leave_rss_where_it_was(server: LiveServer) -> None:
    normal_before = normal_request_s(server)
    rss_before = server.rss_bytes()
    for n in range(100, 108):
        refused(chat(server, guided_regex=f"((a{{100}}){{100}}){{{n}}}"), "guided_regex", "ran out of fuel")
    growth = server.rss_bytes() - rss_before
    # Refused, so never cached: what stays is allocator slack (measured 1-17 MB), within the 10 %.
    assert growth < rss_before // 10, growth / MiB
    assert normal_request_s(server) < 3 * normal_before + 0.5


def test_heavy_valid_grammars_stay_within_the_cache_budget(server: LiveServer) -> None:
    rss_before = server.rss_bytes()
    for letter in "bcdefghijklmnopq":  # sixteen grammars of ~21 MB each: 330 MB if all were kept
        response = chat(server, guided_regex=f"({letter}{{100}}){{600}}")
        assert response.status_code == 200, response.text
        content = response.json()["choices"][0]["message"]["content"]
        assert content and set(content) == {letter}
    growth = server.rss_bytes() - rss_before
    # The cache's 128 MiB (it holds six of them), plus glibc's slack: evicted lexers are freed and trimmed,
    # but the arenas they lived in stay partly resident (measured growth: 115-200 MB).
    assert growth < CACHE_BYTES + 3 * GRAMMAR_BYTES, growth / MiB
    assert chat(server).status_code == 200
