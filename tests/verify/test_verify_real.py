"""Quality verification on the real demo model (SmolLM2-135M): int8 ships, int4 (from Q4_1 weights) does not.

Paths come from the environment so they can point at any build of the model:
ONNXFN_TEST_HF_DIR, ONNXFN_TEST_FP32_DIR, ONNXFN_TEST_INT8_DIR, ONNXFN_TEST_INT4_DIR.
An int4 export that does not exist yet is built from the HF folder.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from packager.verify import CandidateQuality, QualityBudget, QualityEvaluator, torch_parity
from tests.fixtures.tiny_llama import export_with_genai_builder

pytestmark = pytest.mark.real_model


def _path(variable: str, default: str) -> Path:
    return Path(os.environ.get(variable, default))


HF_DIR = _path("ONNXFN_TEST_HF_DIR", "/tmp/proto/hf")
FP32_DIR = _path("ONNXFN_TEST_FP32_DIR", "/tmp/proto/out_fp32")
INT8_DIR = _path("ONNXFN_TEST_INT8_DIR", "/tmp/proto/out_int8")
INT4_DIR = _path("ONNXFN_TEST_INT4_DIR", "/tmp/verify_int4")

if not (FP32_DIR / "model.onnx").is_file() or not (HF_DIR / "config.json").is_file():
    pytest.skip(f"the demo model's exports are not at {HF_DIR} and {FP32_DIR}", allow_module_level=True)


@pytest.fixture(scope="module")
def evaluator() -> QualityEvaluator:
    return QualityEvaluator(FP32_DIR, HF_DIR / "tokenizer.json", (HF_DIR / "chat_template.jinja").read_text())


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if (INT4_DIR / "model.onnx").is_file():
        return INT4_DIR
    root = tmp_path_factory.mktemp("smollm2_int4")
    return export_with_genai_builder(HF_DIR, root / "int4", "int4", root / "cache")


def _evaluate(evaluator: QualityEvaluator, directory: Path, precision: str) -> CandidateQuality:
    started = time.perf_counter()
    quality = evaluator.evaluate(directory, precision, QualityBudget())
    print(f"\n{precision}: {quality} in {time.perf_counter() - started:.1f} s")
    return quality


def test_fp32_export_decodes_like_pytorch() -> None:
    parity = torch_parity(HF_DIR, FP32_DIR, HF_DIR / "tokenizer.json", (HF_DIR / "chat_template.jinja").read_text())
    assert (parity.prompts, parity.identical_greedy) == (8, 8), parity.first_divergence


def test_int8_passes_the_default_budget(evaluator: QualityEvaluator) -> None:
    quality = _evaluate(evaluator, INT8_DIR, "int8")
    assert quality.passes, quality.failures
    assert 0.0 < quality.mean_kl < 0.02
    assert quality.top1_agreement >= 0.95
    assert abs(quality.perplexity_increase_pct) < 5.0
    assert 20.0 < evaluator.reference_perplexity < 50.0


def test_int4_fails_with_its_numbers(evaluator: QualityEvaluator, int4_dir: Path) -> None:
    quality = _evaluate(evaluator, int4_dir, "int4")
    assert not quality.passes
    assert quality.mean_kl > 0.1
    assert quality.top1_agreement < 0.9
    kl_failures = [f for f in quality.failures if f.startswith("mean KL")]
    assert kl_failures == [f"mean KL divergence from fp32 {quality.mean_kl:.4f} is above the maximum 0.0200"]
    assert any(f"{quality.top1_agreement:.3f}" in failure for failure in quality.failures)
