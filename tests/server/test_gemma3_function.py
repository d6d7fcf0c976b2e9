"""The second real model, as a user gets it: functions/gemma3-completion built by `pkg build` from the Q4_K_M GGUF
the PyPI wheels ship in parts, served over HTTP and asked through the official `openai` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import onnx
import openai
import pytest

from packager.build import build_function
from packager.progress import StepProgress
from packager.spec import load_spec
from runtime.bundle import Bundle, open_bundle
from runtime.engine.engine import EngineConfig
from runtime.http.state import ServerSettings
from tests.conftest import REPO
from tests.server.conftest import API_KEY, RunningServer, engine_loader, policy_for, serve_in_thread

pytestmark = pytest.mark.real_model

FUNCTION = REPO / "functions" / "gemma3-completion"


@pytest.fixture(scope="module")
def gemma_bundle() -> Bundle:
    spec = load_spec(FUNCTION)
    result = build_function(spec, StepProgress())
    return open_bundle(REPO / result.bundle)


@pytest.fixture(scope="module")
def gemma_server(gemma_bundle: Bundle) -> Iterator[RunningServer]:
    settings = ServerSettings(policy=policy_for(gemma_bundle.path), api_key=API_KEY, fingerprint="fp_gemma")
    config = EngineConfig(max_batch=2, max_context=1024)
    with serve_in_thread(settings, engine_loader(gemma_bundle.path, config)) as running:
        yield running


def test_the_gemma_function_keeps_its_ggufs_mixed_blocks_at_about_the_files_size(gemma_bundle: Bundle) -> None:
    facts = gemma_bundle.manifest.model
    assert (facts.architecture, facts.precision, facts.task) == ("gemma3_text", "gguf", "completion")
    assert (facts.num_layers, facts.num_kv_heads, facts.head_dim, facts.vocab_size) == (18, 1, 256, 262144)
    report = json.loads(gemma_bundle.file("gguf-weights.json").read_text())
    assert set(report["gguf_types"]) == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} and report["kept_float32"] == {}
    quality = json.loads(gemma_bundle.file("quality.json").read_text())
    gguf = next(c for c in quality["candidates"] if c["precision"] == "gguf")
    (int8,) = quality["compared"]
    assert not gguf["failures"] and gguf["mean_kl"] <= int8["mean_kl"]
    gguf_bytes = sum(p.stat().st_size for p in _gguf_parts())
    total = sum(f.size for f in gemma_bundle.manifest.files.values())
    assert total <= 1.5 * gguf_bytes, (total, gguf_bytes)
    graph = onnx.load(str(gemma_bundle.model_path), load_external_data=False)
    windows = [
        next(a.i for a in n.attribute if a.name == "local_window_size")
        for n in graph.graph.node
        if n.op_type == "GroupQueryAttention"
    ]
    assert windows.count(512) == 15 and windows.count(-1) == 3  # sliding layers, every 6th one global


def _gguf_parts() -> list[Path]:
    from packager.sources import locate_source

    located = locate_source(load_spec(FUNCTION).model.source, FUNCTION)
    return list(located.paths)  # type: ignore[union-attr]


def test_the_gemma_function_completes_text_through_the_openai_client(gemma_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=gemma_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    reply = client.completions.create(
        model="gemma3-completion", prompt="The capital of France is", max_tokens=12, temperature=0
    )
    text = reply.choices[0].text
    assert "capital" in text and "France" in text, text  # transformers on the fp32 weights: " the capital of …"
    assert reply.usage is not None and reply.usage.prompt_tokens == 6  # <bos> and five words
    streamed = client.completions.create(
        model="gemma3-completion", prompt="The capital of France is", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == text
    with pytest.raises(openai.BadRequestError, match="no chat template; use the completions API"):
        client.chat.completions.create(model="gemma3-completion", messages=[{"role": "user", "content": "Hi"}])
