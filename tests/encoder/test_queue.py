"""Encoder bundles on the queue path: `kind: embedding | classification` through the real worker process and the
Lambda SQS handler, against a real moto server; the results equal what the HTTP routes answer."""

from __future__ import annotations

import base64
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from runtime.aws_lambda import handler as lambda_handler
from tests.encoder.conftest import CLASSIFY_FUNCTION, ClassifierBuild
from tests.encoder.test_classify import torch_probabilities
from tests.events.conftest import LambdaContext, Queues, make_queues
from tests.events.test_lambda_handler import lambda_event, receive_all, s3_reply
from tests.events.workers import wait_for, worker_process
from tests.fixtures.moto_server import MotoServer, aws_env, moto_server  # noqa: F401  (fixtures)

TEXTS = ["A man is eating food.", "How do I reset my password?", "The stock market fell sharply."]


@pytest.fixture
def queues(moto_server: MotoServer, aws_env: dict[str, str]) -> Queues:  # noqa: F811
    return make_queues(moto_server, max_receive_count=1)


def envelope(request_id: str, kind: str, body: dict[str, Any], queues: Queues) -> dict[str, Any]:
    return {"request_id": request_id, "kind": kind, "body": body, "reply_to": s3_reply(queues, request_id)}


def test_the_worker_serves_embedding_requests_and_refuses_other_kinds(
    queues: Queues,
    embed_bundle: Path,
    aws_env: dict[str, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    from runtime.encoder.engine import EncoderConfig, start_encoder

    queues.send(envelope("e-json", "embedding", {"input": TEXTS}, queues))
    queues.send(
        envelope("e-pack", "embedding", {"input": TEXTS[0], "encoding_format": "base64"}, queues), as_msgpack=True
    )
    queues.send(envelope("e-bad", "embedding", {"input": ""}, queues))
    queues.send(envelope("wrong-kind", "classification", {"input": "x"}, queues))
    queues.send(envelope("chat", "chat", {"messages": [{"role": "user", "content": "hi"}]}, queues))
    names = ("e-json", "e-pack", "e-bad", "wrong-kind", "chat")
    with worker_process(embed_bundle, queues, aws_env, tmp_path) as worker:
        worker.wait_ready()
        wait_for(lambda: all(queues.result(f"out/{n}.json") for n in names[:1] + names[2:]), 60, worker.log)
        wait_for(lambda: _raw(queues, "out/e-pack.json") is not None, 30, worker.log)
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.log()[-2000:]
    engine = start_encoder(embed_bundle, EncoderConfig(), verify=False)
    try:
        expected = engine.embed_texts(TEXTS)
    finally:
        engine.shutdown()
    ok = queues.result("out/e-json.json")
    assert ok is not None and ok.status == 200 and ok.body["model"] == "minilm-embed"
    vectors = np.array([d["embedding"] for d in ok.body["data"]], dtype=np.float32)
    assert np.abs(vectors - expected).max() < 1e-5
    packed = msgpack.unpackb(_raw(queues, "out/e-pack.json"))  # the reply keeps the request's encoding
    vector = np.frombuffer(base64.b64decode(packed["body"]["data"][0]["embedding"]), dtype="<f4")
    assert packed["status"] == 200 and np.abs(vector - expected[0]).max() < 1e-5
    bad = queues.result("out/e-bad.json")
    assert bad is not None and bad.status == 400 and bad.body["error"]["param"] == "input[0]"
    for name in ("wrong-kind", "chat"):
        refused = queues.result(f"out/{name}.json")
        assert refused is not None and refused.status == 400, name
        assert (
            refused.body["error"]["code"] == "unsupported_endpoint"
            and "'embedding'" in refused.body["error"]["message"]
        )
    # The served messages are deleted; the refused ones are left for the redrive policy (→ the DLQ).
    assert queues.depth() == 3


def _raw(queues: Queues, key: str) -> bytes | None:
    try:
        return bytes(queues.s3.get_object(Bucket=queues.bucket, Key=key)["Body"].read())
    except queues.s3.exceptions.NoSuchKey:
        return None


@pytest.fixture
def classifier_lambda(classifier_build: ClassifierBuild, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The Lambda entry point configured as the image configures it, serving the classifier bundle."""
    monkeypatch.setenv(lambda_handler.BUNDLE_ENV, str(classifier_build.bundle))
    monkeypatch.setenv(lambda_handler.FLAGS_ENV, f"--no-verify --max-batch 8 --model-name {CLASSIFY_FUNCTION}")
    monkeypatch.setattr(lambda_handler, "_function", None)
    yield
    loaded = lambda_handler._function
    if loaded is not None:
        loaded.shutdown()


def test_the_lambda_handler_serves_a_classification_batch(
    queues: Queues, classifier_build: ClassifierBuild, classifier_lambda: None
) -> None:
    for i, text in enumerate(TEXTS):
        queues.send(envelope(f"c{i}", "classification", {"input": text}, queues))
    queues.send(envelope("c-embed", "embedding", {"input": "x"}, queues))
    event = lambda_event(queues, receive_all(queues, len(TEXTS) + 1))
    response = lambda_handler.handler(event, LambdaContext())
    refused = next(r["messageId"] for r in event["Records"] if "c-embed" in r["body"])
    assert response == {"batchItemFailures": [{"itemIdentifier": refused}]}
    expected = torch_probabilities(classifier_build.model_dir, TEXTS)
    for i in range(len(TEXTS)):
        result = queues.result(f"out/c{i}.json")
        assert result is not None and result.status == 200, result
        (item,) = result.body["data"]
        assert np.abs(np.array(item["probs"]) - expected[i]).max() < 1e-4
        assert item["label"] == result.body["labels"][int(expected[i].argmax())]
    wrong = queues.result("out/c-embed.json")
    assert wrong is not None and wrong.status == 400 and wrong.body["error"]["code"] == "unsupported_endpoint"
    # The same function's HTTP side (function URL / API Gateway through mangum) serves /v1/classify too.
    http = lambda_handler.handler(_function_url_event({"model": CLASSIFY_FUNCTION, "input": TEXTS[0]}), LambdaContext())
    assert http["statusCode"] == 200
    import json

    probs = json.loads(http["body"])["data"][0]["probs"]
    assert np.abs(np.array(probs) - expected[0]).max() < 1e-4


def _function_url_event(body: dict[str, Any]) -> dict[str, Any]:
    import json

    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": "/v1/classify",
        "rawQueryString": "",
        "headers": {"content-type": "application/json", "host": "abc.lambda-url.us-east-1.on.aws"},
        "requestContext": {
            "http": {"method": "POST", "path": "/v1/classify", "protocol": "HTTP/1.1", "sourceIp": "127.0.0.1"},
            "domainName": "abc.lambda-url.us-east-1.on.aws",
            "requestId": "r1",
            "routeKey": "$default",
            "stage": "$default",
        },
        "body": json.dumps(body),
        "isBase64Encoded": False,
    }
