"""Hostile bodies are refused fast with a 4xx that says what was wrong, and the server keeps serving."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest

from runtime.api.encoding import MAX_DEPTH, decode_body
from runtime.api.errors import APIError
from tests.reliability.conftest import MAX_BATCH, MAX_BODY_BYTES, MAX_CONTEXT, MAX_TOKENS_LIMIT, assert_serves
from tests.reliability.hostile_corpus import CASES, MSGPACK_CASES, VALID_PAIR, HostileCase
from tests.reliability.live import LiveServer

pytestmark = pytest.mark.real_model
FAST = 5.0  # seconds; generous for a loaded 2-core machine, far below any generation
MSGPACK = {"Content-Type": "application/msgpack"}


def chat(live: LiveServer, **extra: Any) -> dict[str, Any]:
    return {"model": live.model, "messages": [{"role": "user", "content": "Hi"}], **extra}


def refused(response: httpx.Response, status: int, code: str | None, message: str, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and message in error["message"], error
    if param is not None:
        assert error["param"] == param
    assert response.elapsed.total_seconds() < FAST


@pytest.fixture(scope="module", autouse=True)
def still_serving_afterwards(live: LiveServer) -> Iterator[None]:
    yield
    assert_serves(live)


def test_body_over_the_limit_declared_or_chunked(http: httpx.Client, live: LiveServer) -> None:
    big = chat(live, user="x" * MAX_BODY_BYTES)
    refused(http.post("/v1/chat/completions", json=big), 413, "request_too_large", f"limit is {MAX_BODY_BYTES} bytes")
    payload = json.dumps(big).encode()
    chunks = (payload[i : i + 4096] for i in range(0, len(payload), 4096))  # no Content-Length: chunked
    streamed = http.post("/v1/chat/completions", content=chunks, headers={"Content-Type": "application/json"})
    refused(streamed, 413, "request_too_large", "the request body is at least")


def raw_exchange(live: LiveServer, head: str, body: bytes) -> bytes:
    """Send bytes exactly as given (a lying Content-Length cannot be sent through an HTTP client)."""
    port = int(live.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=FAST) as sock:
        auth = f"Authorization: Bearer {live.key}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}{head}\r\n".encode() + body)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass  # the server closed with our surplus bytes unread; what it answered first is kept
        return received


def test_lying_content_length(live: LiveServer) -> None:
    body = json.dumps(chat(live)).encode()
    # Claims a terabyte: refused from the header alone, before a byte of body is read.
    started = time.perf_counter()
    huge = raw_exchange(live, "Content-Length: 1000000000000\r\n", body)
    assert huge.startswith(b"HTTP/1.1 413") and b"request_too_large" in huge
    # Claims 10 bytes and sends them: they reach the app, which says they are not JSON.
    exact = raw_exchange(live, "Content-Length: 10\r\n", body[:10])
    assert exact.startswith(b"HTTP/1.1 400") and b"invalid_json" in exact
    # Claims 10 bytes and sends more: the surplus is parsed as the next request, which is none, so the HTTP
    # parser refuses the connection with a 400 (the app's answer to the first 10 bytes, also a 400, may or may
    # not go out before it).
    short = raw_exchange(live, "Content-Length: 10\r\n", body + b"x" * 100)
    assert short.startswith(b"HTTP/1.1 400")
    assert b"invalid_json" in short or short.endswith(b"\r\n\r\nInvalid HTTP request received.")
    # Claims more than it sends, then closes: the server stops waiting when the connection ends.
    partial = raw_exchange(live, f"Content-Length: {len(body) + 100}\r\n", body)
    assert partial == b"" or partial.startswith(b"HTTP/1.1 4")
    assert time.perf_counter() - started < 3 * FAST


def test_deeply_nested_json_is_a_400_not_a_recursion_error(http: httpx.Client, live: LiveServer) -> None:
    levels = (MAX_BODY_BYTES - 100) // 2  # ~32k levels: far beyond Python's recursion limit
    deep = b'{"model": "m", "messages": ' + b"[" * levels + b"]" * levels + b"}"
    response = http.post("/v1/chat/completions", content=deep, headers={"Content-Type": "application/json"})
    refused(response, 400, "too_deeply_nested", f"nested more than {MAX_DEPTH} levels")
    # Shallow enough for the parser, too deep for the server: caught before any handler walks it.
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(MAX_DEPTH + 5):
        schema = {"type": "object", "properties": {"a": schema}}
    nested = chat(live, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    refused(http.post("/v1/chat/completions", json=nested), 400, "too_deeply_nested", "nested more than")


def test_100k_levels_in_either_format_are_refused_in_process() -> None:
    for raw, content_type in (
        (b"[" * 100_000 + b"]" * 100_000, "application/json"),
        (b"\x91" * 100_000 + b"\xc0", "application/msgpack"),
    ):
        with pytest.raises(APIError, match="nested more than") as caught:
            decode_body(raw, content_type)
        assert caught.value.status == 400


def test_invalid_utf8(http: httpx.Client, live: LiveServer) -> None:
    body = json.dumps(chat(live)).encode().replace(b'"Hi"', b'"H\xff\xfei"')
    response = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    refused(response, 400, "invalid_json", "not UTF-8: invalid start byte at byte")
    packed = msgpack.packb(chat(live)).replace(b"\xa2Hi", b"\xa2\xff\xfe")
    refused(http.post("/v1/chat/completions", content=packed, headers=MSGPACK), 400, "invalid_msgpack", "not UTF-8")


def test_prompt_of_ten_times_the_context(http: httpx.Client, live: LiveServer) -> None:
    words = " hello" * (10 * MAX_CONTEXT)
    text = http.post("/v1/chat/completions", json=chat(live, messages=[{"role": "user", "content": words}]))
    refused(text, 400, "context_length_exceeded", "accepts at most", param="messages")
    ids = http.post("/v1/completions", json={"model": live.model, "prompt": [1] * (10 * MAX_CONTEXT)})
    refused(ids, 400, "context_length_exceeded", "accepts at most", param="prompt")


@pytest.mark.parametrize("n", [0, -1, MAX_BATCH + 1, 2**63, 10**30])
def test_n_at_extremes(http: httpx.Client, live: LiveServer, n: int) -> None:
    refused(http.post("/v1/chat/completions", json=chat(live, n=n)), 400, None, "is not valid for 'n'", param="n")


@pytest.mark.parametrize("max_tokens", [0, -1, MAX_TOKENS_LIMIT + 1, 2**63, 10**30])
def test_max_tokens_at_extremes(http: httpx.Client, live: LiveServer, max_tokens: int) -> None:
    response = http.post("/v1/chat/completions", json=chat(live, max_tokens=max_tokens))
    refused(response, 400, None, "'max_tokens'", param="max_tokens")


def test_stop_list_of_thousands(http: httpx.Client, live: LiveServer) -> None:
    stops = [f"s{i}" for i in range(5000)]
    response = http.post("/v1/chat/completions", json=chat(live, stop=stops))
    refused(response, 400, None, "'stop' has 5000 sequences; at most 16", param="stop")


def test_huge_logit_bias(http: httpx.Client, live: LiveServer) -> None:
    bias = {str(token): 1 for token in range(5000)}
    response = http.post("/v1/chat/completions", json=chat(live, logit_bias=bias))
    refused(response, 400, None, "logit_bias", param="logit_bias")


@pytest.mark.parametrize(
    "bomb",
    [
        b"\xdd" + struct.pack(">I", 2**32 - 1),  # array32 declaring 4 G elements
        b"\xdf" + struct.pack(">I", 2**32 - 1),  # map32 declaring 4 G pairs
        b"\xdb" + struct.pack(">I", 2**32 - 1) + b"abc",  # str32 declaring 4 GB
        b"\xc6" + struct.pack(">I", 2**32 - 1) + b"abc",  # bin32 declaring 4 GB
        b"\x81\xa1a" + b"\xdd\x00\x01\x00\x00" * 1000,  # nested arrays, each declaring 65536 elements
    ],
    ids=["array32", "map32", "str32", "bin32", "nested-arrays"],
)
def test_msgpack_bombs(http: httpx.Client, bomb: bytes) -> None:
    response = http.post("/v1/chat/completions", content=bomb, headers=MSGPACK)
    assert response.status_code == 400 and response.json()["error"]["code"] in ("invalid_msgpack", "too_deeply_nested")
    assert response.elapsed.total_seconds() < FAST


def test_msgpack_nested_past_the_depth_limit(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", content=b"\x91" * 50_000 + b"\xc0", headers=MSGPACK)
    refused(response, 400, "too_deeply_nested", "msgpack is nested more than")


def test_extreme_penalties_never_fail_the_batch(http: httpx.Client, live: LiveServer) -> None:
    body = chat(live, repetition_penalty=1e-300, top_p=0.5, temperature=1.0, max_tokens=2)
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code in (200, 400), response.text


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_hostile_corpus_gets_its_400(http: httpx.Client, live: LiveServer, case: HostileCase) -> None:
    # Before issue 37: lone surrogates and odd logit_bias keys were 500s (the tokenizer, int(), the error's own
    # encoding); the 400 of an unknown key "\ud800" itself failed to encode.
    path = "/v1/chat/completions" if case.kind == "chat" else "/v1/completions"
    response = http.post(path, content=case.raw(live.model), headers={"Content-Type": "application/json"})
    refused(response, 400, case.code, case.message, param=case.param)


@pytest.mark.parametrize("case", MSGPACK_CASES, ids=lambda case: case.name)
def test_msgpack_values_json_has_no_type_for_get_a_400_naming_the_field(
    http: httpx.Client, live: LiveServer, case: HostileCase
) -> None:
    # Before issue 47: bytes in tools[].function.parameters were a TypeError (500) in the tool prompt's json.dumps.
    path = "/v1/chat/completions" if case.kind == "chat" else "/v1/completions"
    response = http.post(path, content=case.packed(live.model), headers=MSGPACK)
    refused(response, 400, case.code, case.message, param=case.param)


def test_msgpack_int_keys_and_infinities_stay_as_before(http: httpx.Client, live: LiveServer) -> None:
    """Integer map keys are a msgpack client's natural `logit_bias`; an infinity gets its field's own 400."""
    body = chat(live, logit_bias={12: -100}, max_tokens=2)
    assert http.post("/v1/chat/completions", content=msgpack.packb(body), headers=MSGPACK).status_code == 200
    infinite = msgpack.packb(chat(live, temperature=float("inf")))
    refused(http.post("/v1/chat/completions", content=infinite, headers=MSGPACK), 400, None, "", param="temperature")


def test_a_valid_surrogate_pair_is_text(http: httpx.Client, live: LiveServer) -> None:
    raw = VALID_PAIR.raw(live.model)
    response = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
