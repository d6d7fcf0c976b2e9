"""`task = "classification"`: a tiny BERT classifier through `pkg build`, `pkg deploy --target local` and /v1/classify.

Probabilities are checked against PyTorch running the same Hugging Face folder, each text alone.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest

from tests.encoder.conftest import CLASSIFY_FUNCTION, ClassifierBuild, pkg
from tests.encoder.tiny_classifier import LABELS

KEY = "classify-test-key"
TEXTS = [
    "I loved every minute of this film.",
    "The service was slow and the food was cold.",
    "It is a train timetable.",
    "ok",
    "Customers can return items within thirty days of purchase, no questions asked, at any of our stores.",
]


@dataclass(frozen=True)
class Deployed:
    url: str
    headers: dict[str, str]
    build: ClassifierBuild


@pytest.fixture(scope="module")
def deployed(classifier_build: ClassifierBuild) -> Iterator[Deployed]:
    """The bundle served the way a user serves it: `pkg deploy --target local` (the runtime under uvicorn)."""
    env = {"CLASSIFY_TEST_KEY": KEY}
    function = f"functions/{CLASSIFY_FUNCTION}"
    result = pkg("deploy", function, "--target", "local", cwd=classifier_build.root, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    # The server's own port (the deploy's `server` row): the tests read its /openapi.json, which the gateway
    # in front of every function (the `url` row) does not serve.
    url = re.search(r"server\s*│\s*(http://127\.0\.0\.1:\d+)", result.stdout)
    assert url is not None, result.stdout
    try:
        yield Deployed(url.group(1), {"Authorization": f"Bearer {KEY}"}, classifier_build)
    finally:
        pkg("destroy", function, "--target", "local", cwd=classifier_build.root, env=env)


def torch_probabilities(model_dir: Path, texts: list[str]) -> np.ndarray:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForSequenceClassification

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()  # the shipped file pads to 128
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    rows = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text).ids])
            rows.append(torch.softmax(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0], -1))
    return torch.stack(rows).numpy()


def _classify(deployed: Deployed, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{deployed.url}/v1/classify", json=body, headers=deployed.headers, timeout=30)


def test_the_bundle_is_fused_and_carries_the_labels(classifier_build: ClassifierBuild) -> None:
    from packager.export.encoder import graph_ops
    from runtime.bundle import open_bundle

    manifest = open_bundle(classifier_build.bundle).manifest
    assert manifest.task == "classification" and manifest.model is None
    facts = manifest.encoder
    assert facts is not None and facts.labels == LABELS and facts.output_name == "logits"
    assert facts.max_tokens == 128 and facts.dimensions == 3
    ops = graph_ops(classifier_build.bundle / manifest.model_file)
    assert (ops["EmbedLayerNormalization"], ops["Attention"], ops["SkipLayerNormalization"]) == (1, 2, 4)
    assert ops["BiasGelu"] + ops["FastGelu"] == 2 and ops["Softmax"] == 0
    quality = json.loads((classifier_build.bundle / "quality.json").read_text())
    assert quality["task"] == "classification" and quality["chosen"] == "fp32"
    assert quality["torch_parity"]["max_probability_delta"] < 1e-4
    assert quality["torch_parity"]["top1_agreement"] == 1.0
    assert "classifier, 3 labels: negative, neutral, positive" in classifier_build.build_output


def test_labels_and_probabilities_equal_pytorch(deployed: Deployed) -> None:
    response = _classify(deployed, {"model": CLASSIFY_FUNCTION, "input": TEXTS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == CLASSIFY_FUNCTION and body["labels"] == list(LABELS)
    expected = torch_probabilities(deployed.build.model_dir, TEXTS)
    probs = np.array([d["probs"] for d in body["data"]])
    assert np.abs(probs - expected).max() < 1e-4
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert [d["label"] for d in body["data"]] == [LABELS[i] for i in expected.argmax(axis=1)]
    assert [d["score"] for d in body["data"]] == pytest.approx(expected.max(axis=1), abs=1e-4)
    assert len({d["label"] for d in body["data"]}) > 1, "random weights should not give every text one label"
    single = _classify(deployed, {"model": CLASSIFY_FUNCTION, "input": TEXTS[0]}).json()
    assert np.abs(np.array(single["data"][0]["probs"]) - expected[0]).max() < 1e-4
    assert single["usage"]["prompt_tokens"] == single["usage"]["total_tokens"] > 2


def test_msgpack_and_concurrent_requests_give_the_solo_answers(deployed: Deployed) -> None:
    solo = [_classify(deployed, {"model": CLASSIFY_FUNCTION, "input": t}).json()["data"][0]["probs"] for t in TEXTS]
    packed = httpx.post(
        f"{deployed.url}/v1/classify",
        content=msgpack.packb({"model": CLASSIFY_FUNCTION, "input": TEXTS}),
        headers={**deployed.headers, "Content-Type": "application/msgpack", "Accept": "application/msgpack"},
    )
    assert packed.headers["content-type"].startswith("application/msgpack")
    assert np.allclose([d["probs"] for d in msgpack.unpackb(packed.content)["data"]], solo, atol=1e-5)
    with ThreadPoolExecutor(max_workers=len(TEXTS)) as pool:
        together = list(pool.map(lambda t: _classify(deployed, {"model": CLASSIFY_FUNCTION, "input": t}), TEXTS * 3))
    probs = [r.json()["data"][0]["probs"] for r in together]
    assert np.allclose(probs, solo * 3, atol=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/v1/classify", {"model": CLASSIFY_FUNCTION, "input": []}, 400, "input", None),
        ("/v1/classify", {"model": CLASSIFY_FUNCTION, "input": ["ok", ""]}, 400, "input[1]", None),
        ("/v1/classify", {"model": CLASSIFY_FUNCTION, "input": 3}, 400, "input", None),
        ("/v1/classify", {"model": CLASSIFY_FUNCTION, "input": "word " * 200}, 400, "input", "context_length_exceeded"),
        ("/v1/classify", {"model": CLASSIFY_FUNCTION, "input": "x", "top_k": 2}, 400, "top_k", "unknown_parameter"),
        ("/v1/classify", {"model": "other", "input": "x"}, 404, "model", "model_not_found"),
        ("/v1/classify", {"input": "x"}, 400, "model", "missing_required_parameter"),
        ("/v1/embeddings", {"model": CLASSIFY_FUNCTION, "input": "x"}, 400, "model", "unsupported_endpoint"),
        ("/v1/chat/completions", {"model": CLASSIFY_FUNCTION}, 400, "model", "unsupported_endpoint"),
    ],
)
def test_client_mistakes_are_4xx_naming_the_field(
    deployed: Deployed, path: str, body: dict[str, object], status: int, param: str, code: str | None
) -> None:
    response = httpx.post(f"{deployed.url}{path}", json=body, headers=deployed.headers, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    if code is not None:
        assert error["code"] == code
    if code == "unsupported_endpoint":
        assert "/v1/classify" in error["message"]


def test_long_input_is_cut_on_request_and_the_openapi_document_lists_classify(deployed: Deployed) -> None:
    cut = _classify(deployed, {"model": CLASSIFY_FUNCTION, "input": "word " * 200, "truncate_prompt_tokens": -1})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 128
    paths = httpx.get(f"{deployed.url}/openapi.json", headers=deployed.headers).json()["paths"]
    assert "/v1/classify" in paths and "/v1/embeddings" not in paths and "/v1/chat/completions" not in paths


def test_pkg_invoke_prints_the_label_table(deployed: Deployed) -> None:
    result = pkg(
        "invoke", f"functions/{CLASSIFY_FUNCTION}", TEXTS[0], cwd=deployed.build.root,
        env={"CLASSIFY_TEST_KEY": KEY},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    expected = torch_probabilities(deployed.build.model_dir, TEXTS[:1])[0]
    lines = [line for line in result.stdout.splitlines() if any(label in line for label in LABELS)]
    printed = {
        label: float(re.findall(r"\d\.\d{4}", line)[0]) for line in lines[1:] for label in LABELS if label in line
    }
    assert printed == pytest.approx(dict(zip(LABELS, expected.tolist(), strict=True)), abs=2e-4)
    assert f"{CLASSIFY_FUNCTION}: {LABELS[int(expected.argmax())]}" in result.stdout  # the title names the winner


def test_auto_measures_every_candidate_against_fp32(classifier_build: ClassifierBuild) -> None:
    """The same model under `precision = "auto"`: every scheme measured, the first within budget chosen."""
    from packager.build import build_function
    from packager.encoder.build import AUTO_ORDER, EncoderBuildResult
    from packager.progress import StepProgress
    from packager.spec import load_spec

    auto_dir = classifier_build.root / "functions" / "tiny-classify-auto"
    auto_dir.mkdir(exist_ok=True)
    text = (classifier_build.function_dir / "function.toml").read_text()
    (auto_dir / "function.toml").write_text(
        text.replace(CLASSIFY_FUNCTION, "tiny-classify-auto").replace('"fp32"', '"auto"')
    )
    previous = Path.cwd()
    os.chdir(classifier_build.root)
    try:
        result = build_function(load_spec(auto_dir), StepProgress())
    finally:
        os.chdir(previous)
    assert isinstance(result, EncoderBuildResult)
    candidates = {c.precision: c for c in result.candidates}
    assert list(candidates) == list(AUTO_ORDER)
    fp32 = candidates["fp32"]
    assert fp32.passes and fp32.top1_agreement == 1.0 and fp32.max_probability_delta == 0.0  # type: ignore[union-attr]
    chosen = result.chosen
    assert chosen.passes and all(not candidates[p].passes for p in AUTO_ORDER[: AUTO_ORDER.index(chosen.precision)])
    # Dynamic int8's per-batch activation scales make a row's probabilities depend on its batch-mates.
    assert candidates["int8"].batch_probability_delta > fp32.batch_probability_delta == 0.0  # type: ignore[union-attr]
    assert result.manifest.encoder is not None and result.manifest.encoder.precision == chosen.precision
