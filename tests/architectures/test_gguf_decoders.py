"""Every dense architecture that llama.cpp converts and onnxfn reads from GGUF, built from a GGUF with its blocks.

For each twin (cases_dense.GGUF_TWINS): the tiny model of the published config is written as llama.cpp's converter
writes it and quantized to a Q4_K_M-like mix (Q8_0, Q4_K, Q6_K; tests/fixtures/hf_to_gguf.py), then `pkg build` at
precision `gguf` must keep every weight in the file's own blocks (no float copy: `kept_float32` empty, each
carried weight read back from the bundle's operators equal to the file's dequantized rows) and its fp32 reference
(those blocks computed in float32) must agree with transformers reading the same GGUF (top-1 at every answer
position of the 8 prompts, probabilities within 1e-4).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from packager.export.architectures import ARCHITECTURES
from tests.architectures.cases import Case
from tests.architectures.cases_dense import DENSE_CASES, GGUF_SIZES, GGUF_TWINS
from tests.architectures.conftest import GGUF_SPEC, Builds, make_model, transformers_greedy

TWINS = [
    dataclasses.replace(case, name=f"{case.name}-gguf", shrink={**case.shrink, **GGUF_SIZES, **GGUF_TWINS[case.name]})
    for case in DENSE_CASES
    if case.name in GGUF_TWINS
]


def _build(case: Case, builds: Builds, mix: Mapping[str, Any] | None = None) -> tuple[Path, dict[str, str], Path]:
    from packager.build import build_function
    from packager.progress import StepProgress
    from packager.spec import load_spec
    from tests.fixtures.hf_to_gguf import Q4_K_M_LIKE, hf_to_gguf
    from tests.packager.conftest import write_function

    folder = builds.root / case.name
    hf = make_model(case, folder / "hf")
    gguf_path = folder / "gguf" / f"{case.name}.gguf"
    gguf_path.parent.mkdir(parents=True)
    # The architectures transformers reads no GGUF of come as a file alone: their tokenizer is the file's own.
    types = hf_to_gguf(hf, gguf_path, mix or Q4_K_M_LIKE, tokenizer_beside=not _read_by_onnxfn(case))
    function = write_function(folder, case.name, f"gguf:{gguf_path}", GGUF_SPEC)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONNXFN_CACHE_DIR", str(builds.cache))
        patch.chdir(folder)
        result = build_function(load_spec(function), StepProgress())
    return gguf_path, types, folder / result.bundle


def _close_to_fp32_rounding(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal up to a few float32 roundings of the row's largest weight (a block minimum's residual adds two)."""
    scale = np.abs(expected).max(axis=-1, keepdims=True) + np.float32(1e-30)
    assert np.all(np.abs(actual - expected) <= 4 * np.finfo(np.float32).eps * scale), np.abs(actual - expected).max()


@pytest.mark.parametrize("case", TWINS, ids=lambda c: c.name)
def test_a_gguf_of_the_architecture_builds_with_its_blocks_and_parity(case: Case, builds: Builds) -> None:
    from tests.fixtures.gguf_bundle import BundleWeights, GgufSource

    gguf_path, types, bundle_dir = _build(case, builds)
    assert "Q8_0" in types.values() and {"Q4_K", "Q6_K"} & set(types.values()), types
    parity = json.loads((bundle_dir / "quality.json").read_text())["torch_parity"]
    assert parity["identical_greedy"] == parity["prompts"] == 8, parity
    assert parity["max_probability_delta"] < 1e-4, parity

    weights, source = BundleWeights(bundle_dir), GgufSource(gguf_path)
    assert weights.report["kept_float32"] == {}
    carried = {run["tensor"] for c in weights.report["carried"].values() for run in c["runs"]}
    assert carried == {name for name, qtype in types.items() if qtype not in ("F32", "F16")}
    for node, entry in weights.report["carried"].items():
        _close_to_fp32_rounding(weights.rows(node), source.rows(entry["runs"]))
    if _read_by_onnxfn(case):
        _reads_back_as_written(case, gguf_path, builds.root / case.name / "hf")


def _read_by_onnxfn(case: Case) -> bool:
    """Whether transformers reads no GGUF of `case`'s architecture, so that packager/sources/gguf_dense.py does."""
    from gguf import MODEL_ARCH_NAMES

    from packager.sources.gguf_dense import DENSE_GGUF
    from tests.fixtures.hf_to_gguf import LLAMA_CPP_ARCH

    return MODEL_ARCH_NAMES[LLAMA_CPP_ARCH[case.model_type]] in DENSE_GGUF


def _reads_back_as_written(case: Case, gguf_path: Path, hf: Path) -> None:
    """Parity compares the bundle with transformers running what onnxfn read from the file; this checks that what it
    read is the model written: the structural config values, and every weight (q/k permutation and norm + 1
    undone) within its type's rounding (exactly for F32 tensors)."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    from packager.progress import StepProgress
    from packager.sources.gguf import dequantized_folder
    from packager.sources.gguf_dense import dense_config
    from packager.sources.weights import GgufWeights

    read, written = dense_config(gguf_path), AutoConfig.from_pretrained(hf)
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "tie_word_embeddings", "rms_norm_eps", "layer_norm_eps", "partial_rotary_factor",
            "attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling",
            "no_rope_layer_interval", "use_qk_norm", "use_bias")  # fmt: skip
    for key in keys:
        if hasattr(written, key):
            assert getattr(read, key) == pytest.approx(getattr(written, key)), (case.name, key)
    rope = written.rope_parameters
    theta = rope["rope_theta"]
    if rope.get("alpha"):  # HunYuan's NTK-alpha, which the converter bakes into the base
        theta *= rope["alpha"] ** (written.head_dim / (written.head_dim - 2))
    assert read.rope_parameters["rope_theta"] == pytest.approx(theta), case.name
    config_dir = gguf_path.parent / "read-config"
    read.save_pretrained(config_dir)
    weights = GgufWeights(gguf_path, config_dir)
    original = {k: v.astype(np.float32) for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}
    # The tools' fp32 folder (the bench's transformers baseline) holds those same weights.
    sha256 = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONNXFN_CACHE_DIR", str(gguf_path.parent / "cache"))
        folder, _, _ = dequantized_folder(gguf_path, sha256, case.name, StepProgress(), tokenizer_from=gguf_path.parent)
    dequantized = load_file(folder / "model.safetensors")
    for name, values in original.items():
        if name == "lm_head.weight" and read.tie_word_embeddings:
            continue
        got = weights.load(name).numpy()
        assert got.shape == values.shape, name
        np.testing.assert_array_equal(dequantized[name], got, err_msg=name)
        if values.ndim == 1:
            np.testing.assert_allclose(got, values, rtol=1e-6, atol=1e-7, err_msg=f"{case.name} {name}")
            continue
        error = np.linalg.norm(got - values) / np.linalg.norm(values)
        assert error < 0.15, (case.name, name, error)  # Q4_K's rounding is ~0.08 of a row's spread; Q8_0 less


def test_the_registry_marks_each_twins_architecture_exact() -> None:
    exact = {entry.hf_class for entry in ARCHITECTURES if entry.exact_gguf}
    assert {case.hf_class for case in TWINS} <= exact


def test_granite_4_micro_is_written_as_a_granite_gguf_and_builds_as_the_model_it_is(builds: Builds) -> None:
    """llama.cpp writes an attention-only GraniteMoeHybrid (Granite 4.0 Micro) as a `granite` file, its fused shared
    MLP split into ffn_gate/ffn_up/ffn_down (GraniteHybridModel renames the architecture when no layer is Mamba):
    onnxfn builds that file as Granite, and with every tensor F32 its greedy tokens are transformers' GraniteMoeHybrid
    model's on the Hugging Face weights (what the file was written from)."""
    from gguf import GGMLQuantizationType

    from packager.sources.gguf_metadata import read_metadata
    from runtime.bundle import open_bundle
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.engine.request import GenerationRequest, SamplingParams
    from runtime.engine.tokenizer import Tokenizer
    from tests.architectures.cases_moe import GRANITE_4_MICRO
    from tests.fixtures.hf_to_gguf import Q4_K_M_LIKE

    sizes = {**GGUF_SIZES, "shared_intermediate_size": GGUF_SIZES["intermediate_size"]}  # equal, as published
    case = dataclasses.replace(GRANITE_4_MICRO, name="granite-4-micro-gguf", shrink={**GRANITE_4_MICRO.shrink, **sizes})
    gguf_path, types, bundle_dir = _build(case, builds, dict.fromkeys(Q4_K_M_LIKE, GGMLQuantizationType.F32))
    assert read_metadata(gguf_path).architecture == "granite"
    assert {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"} <= set(types)
    assert set(types.values()) == {"F32"}
    bundle = open_bundle(bundle_dir)
    facts = bundle.manifest.model
    assert facts.architecture == "granite"
    tokenizer = Tokenizer(bundle.tokenizer_path, facts.chat_template, facts.bos_token_id, facts.eos_token_ids)
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "Write a poem about the sea."}])
    )
    engine = Engine(bundle, EngineConfig(max_batch=1, max_context=256, prefill_chunk=32))
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        (served,) = engine.generate(GenerationRequest("granite-4-micro", tuple(prompt), params))
    finally:
        engine.shutdown()
    hf = builds.root / case.name / "hf"
    assert list(served.token_ids) == transformers_greedy(hf, list(prompt), facts.context_length, 12)
