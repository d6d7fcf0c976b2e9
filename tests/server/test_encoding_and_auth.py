"""Wire-format helpers, engine-error translation and bearer auth, without a server."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from runtime.api.encoding import decode_body
from runtime.api.errors import APIError, from_engine_error
from runtime.engine.request import EngineOverloadedError, InvalidRequestError
from runtime.http.auth import AuthConfigError, BearerAuth, load_api_key
from runtime.http.wire import WireFormat


def test_bodies_decode_by_content_type() -> None:
    assert decode_body(b'{"a": 1}', None) == {"a": 1}
    assert decode_body(b'{"a": 1}', "text/plain") == {"a": 1}
    assert decode_body(msgpack.packb({"a": 1, 5: 2}), "application/x-msgpack") == {"a": 1, 5: 2}
    assert decode_body(msgpack.packb([1]), "application/msgpack; charset=binary") == [1]


@pytest.mark.parametrize(
    ("raw", "content_type", "code"),
    [
        (b"{", "application/json", "invalid_json"),
        (b"  ", None, "invalid_json"),
        (b'{"x": Infinity}', None, "invalid_json"),
        (b"\xff\xfe", None, "invalid_json"),
        (b"\x92\x01", "application/msgpack", "invalid_msgpack"),  # an array announced with 2 items, 1 given
    ],
)
def test_malformed_bodies_are_400(raw: bytes, content_type: str | None, code: str) -> None:
    with pytest.raises(APIError) as caught:
        decode_body(raw, content_type)
    assert (caught.value.status, caught.value.code) == (400, code)


def test_stream_framings() -> None:
    sse = WireFormat.for_accept("text/event-stream")
    assert sse.frame({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert sse.end_of_stream() == b"data: [DONE]\n\n"
    assert sse.stream_media_type == "text/event-stream"
    packed = WireFormat.for_accept("application/msgpack")
    stream = packed.frame({"a": 1}) + packed.frame({"b": 2}) + packed.end_of_stream()
    assert _unpack_all(stream) == [{"a": 1}, {"b": 2}]


def _unpack_all(data: bytes) -> list[object]:
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    return list(unpacker)


def test_error_responses_carry_status_headers_and_the_openai_body() -> None:
    error = APIError(429, "slow down", error_type="rate_limit_error", code="engine_overloaded", headers={"X": "1"})
    response = WireFormat(msgpack=False).error_response(error)
    assert response.status_code == 429
    assert response.headers["x"] == "1"
    assert json.loads(response.body) == {
        "error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "engine_overloaded"}
    }


@pytest.mark.parametrize(("hint", "header"), [(0.2, "1"), (1.0, "1"), (2.5, "3")])
def test_overload_becomes_429_with_whole_second_retry_after(hint: float, header: str) -> None:
    error = from_engine_error(EngineOverloadedError("queue full", retry_after=hint))
    assert (error.status, error.headers["Retry-After"], error.error_type) == (429, header, "rate_limit_error")


def test_engine_validation_errors_keep_param_and_code() -> None:
    error = from_engine_error(InvalidRequestError("too long", param="messages", code="context_length_exceeded"))
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")


def test_api_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONNXFN_TEST_KEY", " secret \n")
    assert load_api_key("ONNXFN_TEST_KEY", None) == "secret"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert load_api_key(None, key_file) == "from-file"
    assert load_api_key(None, None) is None
    monkeypatch.setenv("ONNXFN_EMPTY_KEY", "")
    for env_name, path in [("ONNXFN_EMPTY_KEY", None), ("ONNXFN_NO_SUCH_KEY", None), (None, tmp_path / "missing")]:
        with pytest.raises(AuthConfigError):
            load_api_key(env_name, path)
    with pytest.raises(AuthConfigError, match="not both"):
        load_api_key("ONNXFN_TEST_KEY", key_file)


@pytest.mark.parametrize(
    ("header", "accepted"),
    [
        ("Bearer secret", True),
        ("bearer secret", True),
        ("Bearer secret2", False),
        ("Bearer secre", False),
        ("Basic secret", False),
        ("Bearer ", False),
        (None, False),
    ],
)
def test_bearer_auth(header: str | None, accepted: bool) -> None:
    auth = BearerAuth("secret")
    if accepted:
        auth.check(header)
        return
    with pytest.raises(APIError) as caught:
        auth.check(header)
    assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")
    assert caught.value.headers == {"WWW-Authenticate": "Bearer"}


def test_no_key_means_auth_is_off() -> None:
    auth = BearerAuth(None)
    assert not auth.enabled
    auth.check(None)
