"""docs/models.md is generated from the architecture registry; every supported architecture names its test."""

from __future__ import annotations

import re
from pathlib import Path

from packager.export.architectures import ARCHITECTURES, SUPPORTED, SUPPORTED_DECODERS
from packager.models_reference import REFERENCE_PATH, render_markdown

REPO = Path(__file__).resolve().parents[2]


def test_models_doc_is_current() -> None:
    assert REFERENCE_PATH.read_text() == render_markdown(), (
        "docs/models.md is stale: run python -m packager.models_reference"
    )


def test_every_supported_architecture_is_tested_and_every_refused_one_says_why() -> None:
    for entry in ARCHITECTURES:
        if entry.status == SUPPORTED:
            assert entry.tested_by and (REPO / entry.tested_by).is_file(), entry.hf_class
            assert SUPPORTED_DECODERS[entry.hf_class] == entry.model_type
        else:
            # one supported class, or one per kind of model ("Qwen3ForCausalLM (dense), GptOssForCausalLM (MoE)")
            named = re.findall(r"\b\w+For(?:CausalLM|ConditionalGeneration)\b", entry.nearest)
            assert entry.reason and named and all(n in SUPPORTED_DECODERS for n in named), entry.hf_class
