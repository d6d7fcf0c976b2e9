"""Rope scaling of every kind, checked past the original context against transformers (cases_rope.py).

test_decoders.py builds, serves and compares greedy tokens for these cases too; greedy tokens could hide a near miss,
so here the bundle's graph and transformers are compared logit by logit at every position past the original context
of a 200-token prompt. Longrope is checked in both of its regimes (rotary.py): the bundle of 256 positions against
transformers on the long prompt, a bundle that fits the original context against transformers on a prompt that
fills it. And the configs a bundle cannot compute as transformers does are refused before the export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from packager.errors import UserError
from packager.export.architectures import check_config
from tests.architectures.cases import LONG_PROMPT, ORIGINAL_CONTEXT, Case
from tests.architectures.cases_rope import ROPE_CASES
from tests.architectures.conftest import Builds

LONGROPE = [c for c in ROPE_CASES if c.config()["rope_scaling"].get("type") == "longrope"]
LOGIT_TOLERANCE = 2e-4  # fp32 through other kernels: measured <= 4e-5; a wrong rope table moves logits by ~1
PROBABILITY_TOLERANCE = 1e-5


def _long_prompt() -> list[int]:
    return [3 + (i * 37) % 380 for i in range(LONG_PROMPT)]  # test_decoders' long prompt


def _onnx_logits(model: Path, prompt: list[int]) -> np.ndarray:
    """The graph's logits at every position of `prompt`, one forward pass from an empty cache."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    decoder = json.loads((model.parent / "genai_config.json").read_text())["model"]["decoder"]
    feeds: dict[str, np.ndarray] = {"input_ids": np.asarray([prompt], np.int64)}
    feeds["attention_mask"] = np.ones((1, len(prompt)), np.int64)
    for value in session.get_inputs():
        if value.name.startswith("past_key_values."):
            feeds[value.name] = np.zeros((1, decoder["num_key_value_heads"], 0, decoder["head_size"]), np.float32)
    (logits,) = session.run(["logits"], feeds)
    return np.asarray(logits[0])


def _torch_logits(hf: Path, prompt: list[int], config: Any = None) -> np.ndarray:
    """transformers' fp32 logits (its own config unless `config` is given)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, config=config, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float().numpy()  # type: ignore[no-any-return]


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


def _differences(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """(max |logit difference|, max |probability difference|)."""
    return float(np.abs(ours - theirs).max()), float(np.abs(_softmax(ours) - _softmax(theirs)).max())


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: c.name)
def test_logits_past_the_original_context_are_transformers(case: Case, builds: Builds) -> None:
    hf, bundle = builds.get(case)
    prompt = _long_prompt()
    ours, theirs = _onnx_logits(bundle / "model.onnx", prompt), _torch_logits(hf, prompt)
    past = slice(ORIGINAL_CONTEXT, len(prompt))
    logit, probability = _differences(ours[past], theirs[past])
    assert logit < LOGIT_TOLERANCE and probability < PROBABILITY_TOLERANCE, (logit, probability)
    assert (ours[past].argmax(-1) == theirs[past].argmax(-1)).all()


@pytest.mark.parametrize("case", LONGROPE, ids=lambda c: c.name)
def test_longrope_within_the_original_context_uses_the_short_factors(
    case: Case, builds: Builds, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bundle that fits the original context ships the short-factor table: transformers' on a prompt filling it.
    The 256-position bundle's long-factor table gives other logits there (so the two regimes are told apart)."""
    from packager.export.builder import ExportOptions, export_decoder, export_structure
    from packager.progress import StepProgress
    from packager.sources import resolve_source

    hf, bundle = builds.get(case)
    monkeypatch.setenv("ONNXFN_CACHE_DIR", str(builds.cache))
    source = resolve_source(f"hf:{hf}", hf.parent, StepProgress())
    short = export_decoder(source, export_structure(source), ExportOptions("fp32"), ORIGINAL_CONTEXT)
    prompt = _long_prompt()[:ORIGINAL_CONTEXT]
    theirs = _torch_logits(hf, prompt)
    logit, probability = _differences(_onnx_logits(short.directory / "model.onnx", prompt), theirs)
    assert logit < LOGIT_TOLERANCE and probability < PROBABILITY_TOLERANCE, (logit, probability)
    long_logit, _ = _differences(_onnx_logits(bundle / "model.onnx", prompt), theirs)
    assert long_logit > 100 * LOGIT_TOLERANCE, long_logit


def test_a_rotary_table_gqa_cannot_take_is_refused() -> None:
    phi4_mini = next(c for c in ROPE_CASES if c.name == "phi4-mini-longrope")
    config = {**phi4_mini.config(), "hidden_size": 64, "num_attention_heads": 4}  # head_dim 16: 12 rotary dims
    with pytest.raises(UserError, match=r"rotary tables 6 wide; .*GroupQueryAttention needs a multiple of 8"):
        check_config(config, "config.json")
    check_config(phi4_mini.config(), "config.json")  # head_dim 64: 24 wide


def test_dynamic_ntk_past_max_position_embeddings_is_refused(tmp_path: Path) -> None:
    """Past max_position_embeddings dynamic NTK rescales every position by the sequence length; the build refuses a
    context that reaches there (cases_rope's dynamic case builds at max_context = max_position_embeddings)."""
    from packager.build import build_function
    from packager.progress import StepProgress
    from packager.spec import load_spec
    from tests.architectures.conftest import make_model
    from tests.packager.conftest import write_function

    dynamic = next(c for c in ROPE_CASES if c.config()["rope_scaling"].get("type") == "dynamic")
    hf = make_model(dynamic, tmp_path / "hf")
    limit = dynamic.config()["max_position_embeddings"]
    spec = f'[export]\nprecision = "fp32"\nmax_context = {2 * limit}\n'
    function = write_function(tmp_path, "dynamic", f"hf:{hf}", spec)
    with pytest.raises(UserError, match=rf"dynamic NTK.*set export.max_context to at most {limit}"):
        build_function(load_spec(function), StepProgress())
