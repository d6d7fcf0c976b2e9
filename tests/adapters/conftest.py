"""Fixtures for the LoRA-adapter tests (issue 41): the demo base as a Hugging Face folder, and two real adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import DEMO_FUNCTION


@pytest.fixture(scope="session")
def smollm2_hf_dir() -> Path:
    """The demo model (SmolLM2-135M-Instruct) dequantized to an fp32 HF folder; cached under the onnxfn cache."""
    from packager.progress import StepProgress
    from packager.sources import resolve_source
    from packager.sources.gguf import dequantized_folder
    from packager.spec import load_spec
    from runtime.bundle import file_digest

    spec = load_spec(DEMO_FUNCTION)
    source = resolve_source(spec.model.source, DEMO_FUNCTION, StepProgress())
    assert source.gguf_file is not None
    progress = StepProgress()
    sha256 = file_digest(source.gguf_file).sha256
    return dequantized_folder(
        source.gguf_file, sha256, spec.model.source, progress, tokenizer_from=source.gguf_file.parent
    )[0]


@pytest.fixture(scope="session")
def peft_adapters(smollm2_hf_dir: Path) -> dict[str, Path]:
    """{"upper": PEFT folder, "french": PEFT folder}, trained on `smollm2_hf_dir` once and cached (training.py)."""
    from tests.adapters.training import ensure_adapters

    return ensure_adapters(smollm2_hf_dir)
