"""/v1/embeddings on a real server process: the openai client, errors, msgpack, and batching of concurrent calls."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import numpy as np
import pytest
from openai import BadRequestError, OpenAI

from tests.encoder.conftest import API_KEY, EmbedServer

MODEL = "minilm-embed"
LONG = "Embeddings turn sentences into vectors. " * 40  # ~280 tokens, over the model's 256


def _post(server: EmbedServer, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json=body, headers=server.headers, timeout=30)


def _vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)


def test_openai_client_embeddings_create(embed_server: EmbedServer) -> None:
    client = OpenAI(base_url=f"{embed_server.url}/v1", api_key=API_KEY)
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply."]
    reply = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    vectors = np.array([d.embedding for d in reply.data])
    assert vectors.shape == (3, 384) and [d.index for d in reply.data] == [0, 1, 2]
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.3  # paraphrases are nearer
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert np.allclose(np.array([d.embedding for d in floats.data]), vectors, atol=1e-6)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(_bundle_tokenizer()))
    tokenizer.no_padding()  # the shipped file pads to 128
    expected_tokens = sum(len(tokenizer.encode(t).ids) for t in texts)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == expected_tokens
    assert [m.id for m in client.models.list()] == [MODEL]


def test_token_ids_embed_like_text_and_msgpack_round_trips(embed_server: EmbedServer) -> None:
    from tokenizers import Tokenizer

    text = "How do I reset my password?"
    tokenizer = Tokenizer.from_file(str(_bundle_tokenizer()))
    tokenizer.no_padding()  # the shipped file pads to 128
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    by_text = _vectors(_post(embed_server, {"model": MODEL, "input": text}))
    by_ids = _vectors(_post(embed_server, {"model": MODEL, "input": ids}))
    nested = _vectors(_post(embed_server, {"model": MODEL, "input": [ids, ids]}))
    assert np.allclose(by_text, by_ids, atol=1e-6) and np.allclose(nested, by_text, atol=1e-6)
    response = httpx.post(
        f"{embed_server.url}/v1/embeddings",
        content=msgpack.packb({"model": MODEL, "input": [text], "encoding_format": "base64"}),
        headers={**embed_server.headers, "Content-Type": "application/msgpack", "Accept": "application/msgpack"},
    )
    body = msgpack.unpackb(response.content)
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vector, by_text[0], atol=1e-6)


def _bundle_tokenizer():  # type: ignore[no-untyped-def]
    from pathlib import Path

    return Path(__file__).resolve().parents[2] / "build" / "minilm-embed" / "bundle" / "tokenizer.json"


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"model": MODEL, "input": "x", "dimensions": 128}, 400, "dimensions", "unsupported_parameter"),
        ({"model": MODEL, "input": LONG}, 400, "input", "context_length_exceeded"),
        ({"model": MODEL, "input": ["ok", ""]}, 400, "input[1]", None),
        ({"model": MODEL, "input": []}, 400, "input", None),
        ({"model": MODEL, "input": [[1, 2, 99999]]}, 400, "input[0]", None),
        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, 400, "encoding_format", None),
        ({"model": MODEL, "input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", None),
        ({"model": MODEL, "input": "x", "temperature": 1}, 400, "temperature", "unknown_parameter"),
        ({"model": "other", "input": "x"}, 404, "model", "model_not_found"),
        ({"input": "x"}, 400, "model", "missing_required_parameter"),
    ],
)
def test_client_mistakes_are_4xx_naming_the_field(
    embed_server: EmbedServer, body: dict[str, object], status: int, param: str, code: str | None
) -> None:
    response = _post(embed_server, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    if code is not None:
        assert error["code"] == code


def test_long_input_with_truncation_opt_in_and_the_openai_error(embed_server: EmbedServer) -> None:
    client = OpenAI(base_url=f"{embed_server.url}/v1", api_key=API_KEY)
    with pytest.raises(BadRequestError, match="at most 256"):
        client.embeddings.create(model=MODEL, input=LONG)
    cut = _post(embed_server, {"model": MODEL, "input": LONG, "truncate_prompt_tokens": -1})
    assert cut.json()["usage"]["prompt_tokens"] == 256
    shorter = _post(embed_server, {"model": MODEL, "input": LONG, "truncate_prompt_tokens": 100})
    assert shorter.json()["usage"]["prompt_tokens"] == 100
    chat = httpx.post(f"{embed_server.url}/v1/chat/completions", json={}, headers=embed_server.headers)
    assert chat.status_code == 400 and "/v1/embeddings" in chat.json()["error"]["message"]
    assert httpx.post(f"{embed_server.url}/v1/embeddings", json={"model": MODEL, "input": "x"}).status_code == 401


def test_concurrent_requests_share_forwards_and_get_their_solo_vectors(embed_server: EmbedServer) -> None:
    from packager.encoder.sentences import SENTENCES

    texts = list(SENTENCES[:32])
    solo = [_vectors(_post(embed_server, {"model": MODEL, "input": t}))[0] for t in texts]
    forwards_before = _metric(embed_server, "onnxfn_engine_steps_total")
    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(lambda t: _vectors(_post(embed_server, {"model": MODEL, "input": t}))[0], texts))
    forwards = _metric(embed_server, "onnxfn_engine_steps_total") - forwards_before
    assert forwards < len(texts), "concurrent requests should have shared forwards"
    cosines = [float(a @ b) for a, b in zip(solo, together, strict=True)]
    assert min(cosines) >= 0.9999, cosines


def _metric(server: EmbedServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))
