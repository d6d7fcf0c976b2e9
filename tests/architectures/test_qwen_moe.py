"""Qwen3-MoE and Qwen2-MoE from GGUFs written as llama.cpp writes them (per-expert matrices stacked into
`ffn_*_exps`, the router F32; Qwen2-MoE's shared expert as 2-D `ffn_*_shexp`), built at precision `gguf`: experts in
symmetric types carried into `QMoE` bit for bit, experts with block minimums (Q4_K, Q4_K_M's choice) re-quantized to
int8 with their error reported; checked against the file's fp32 model and served. The fp32 builds from Hugging Face
folders are test_decoders.py's `qwen3-moe` and `qwen2-moe` cases.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from packager.export.moe import QuantizedExperts, qmoe_layout
from runtime.bundle import open_bundle
from runtime.engine.request import SamplingParams
from tests.architectures.cases import Case
from tests.architectures.cases_moe import QWEN2_MOE, QWEN3_MOE
from tests.architectures.conftest import (
    GGUF_SPEC,
    Builds,
    assert_batched_with_a_shared_prefix_as_alone,
    assert_gguf_parity_and_quality,
    make_model,
)
from tests.fixtures.gguf_bundle import BundleWeights, interleaved
from tests.fixtures.hf_to_gguf import Q4_K_M_LIKE, hf_to_gguf
from tests.packager.conftest import write_function

Q = GGMLQuantizationType
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Rows of 256 so that K-quants apply (as in Qwen3-30B-A3B's: hidden 2048, experts' 768).
_ROWS = {"hidden_size": 256, "moe_intermediate_size": 256}
CASE = dataclasses.replace(QWEN3_MOE, shrink={**QWEN3_MOE.shrink, **_ROWS})
CASES = {"qwen3-moe": CASE, "qwen2-moe": dataclasses.replace(QWEN2_MOE, shrink={**QWEN2_MOE.shrink, **_ROWS})}
# Every expert projection in a symmetric type, of three widths and two block sizes.
SYMMETRIC = {**Q4_K_M_LIKE, "ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_0, "ffn_down_exps": Q.Q6_K}


def _build(
    root: Path, name: str, mix: dict[str, GGMLQuantizationType], cache: Path, case: Case = CASE
) -> tuple[Path, Path]:
    """The tiny model of `case` written as a GGUF of `mix` and built: (GGUF, bundle)."""
    from packager.build import build_function
    from packager.progress import StepProgress
    from packager.spec import load_spec

    hf = make_model(case, root / "hf")
    gguf_path = root / "gguf" / f"{name}.gguf"
    gguf_path.parent.mkdir(parents=True)
    hf_to_gguf(hf, gguf_path, mix)
    function = write_function(root, name, f"gguf:{gguf_path}", GGUF_SPEC)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONNXFN_CACHE_DIR", str(cache))
        patch.chdir(root)
        return gguf_path, root / build_function(load_spec(function), StepProgress()).bundle


@pytest.fixture(scope="module", params=sorted(CASES))
def symmetric(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.conftest import tiny_model_cache

    name = f"{request.param}-symmetric"
    root = tmp_path_factory.mktemp(name)
    return _build(root, name, SYMMETRIC, tiny_model_cache(tmp_path_factory), CASES[request.param])


def _experts(weights: BundleWeights, layer: int) -> tuple[tuple[int, int], QuantizedExperts, QuantizedExperts]:
    pairs = [n for n in weights.model.graph.node if n.op_type == "QMoE" and f"layers.{layer}/" in n.name]
    assert len(pairs) in (2, 4)  # 4 or 8 experts a token, mixed two at a time (moe.qmoe_nodes)
    assert {tuple(n.input[2:8]) for n in pairs} == {tuple(pairs[0].input[2:8])}  # one copy of the experts
    return qmoe_layout(pairs[0]), *weights.qmoe_experts(pairs[0])


def test_symmetric_experts_are_the_files_own_blocks(symmetric: tuple[Path, Path]) -> None:
    """Q8_0 gate, Q4_0 up and Q6_K down experts: in QMoE's 8-bit container with Q6_K's blocks of 16, every value
    the file's own (gate and up rows interleaved for the fused SwiGLU)."""
    gguf_path, bundle_dir = symmetric
    weights = BundleWeights(bundle_dir)
    file = {t.name: dequantize(t.data, t.tensor_type) for t in GGUFReader(str(gguf_path)).tensors}
    for layer in (0, 1):
        entry = weights.report["experts"][f"/model/layers.{layer}/moe/MoE"]
        assert entry["fc1"]["carried"] == entry["fc2"]["carried"] == "exact", entry
        assert entry["fc1"]["tensors"] == {
            f"blk.{layer}.ffn_gate_exps.weight": "Q8_0", f"blk.{layer}.ffn_up_exps.weight": "Q4_0"
        }  # fmt: skip
        layout, fc1, fc2 = _experts(weights, layer)
        assert layout == (8, 16)
        gate, up = file[f"blk.{layer}.ffn_gate_exps.weight"], file[f"blk.{layer}.ffn_up_exps.weight"]
        np.testing.assert_array_equal(fc1.dequantize(), interleaved(gate, up))
        np.testing.assert_array_equal(fc2.dequantize(), file[f"blk.{layer}.ffn_down_exps.weight"])
    # Only Qwen2-MoE's shared-expert gate (one row; `[hidden]` in the file, `[1, hidden]` in the model) stays float.
    kept = weights.report.get("kept_float32") or {}
    assert all("shared_expert_gate" in name for name in kept), kept


def test_the_gguf_matches_transformers_and_serves_a_batch_as_each_row_alone(symmetric: tuple[Path, Path]) -> None:
    """The file's fp32 model is transformers' on the same weights (parity); the bundle, with int8 activations in
    QMoE, is within the quality budget of it; served, each row of a batch gets the tokens it gets alone."""
    _, bundle_dir = symmetric
    assert_gguf_parity_and_quality(bundle_dir)
    bundle = open_bundle(bundle_dir)
    assert bundle.manifest.model.architecture in ("qwen3_moe", "qwen2_moe")
    assert bundle.manifest.model.precision == "gguf"
    assert_batched_with_a_shared_prefix_as_alone(bundle, GREEDY)


def test_q4_k_experts_are_requantized_to_int8_with_their_error_reported(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Q4_K_M's experts: Q4_K gate and up (a block minimum QMoE has no place for) re-quantized to int8 blocks from
    the dequantized rows, the report giving the error; Q6_K down carried exactly."""
    from tests.conftest import tiny_model_cache

    root = tmp_path_factory.mktemp("qwen3-moe-q4-k-m")
    gguf_path, bundle_dir = _build(root, "qwen3-moe-q4-k-m", Q4_K_M_LIKE, tiny_model_cache(tmp_path_factory))
    weights = BundleWeights(bundle_dir)
    file = {t.name: dequantize(t.data, t.tensor_type) for t in GGUFReader(str(gguf_path)).tensors}
    for layer in (0, 1):
        entry = weights.report["experts"][f"/model/layers.{layer}/moe/MoE"]
        assert entry["fc1"]["carried"] == "re-quantized to int8, blocks of 16", entry
        assert 0 < entry["fc1"]["relative_rms_error"] < 0.01, entry
        assert entry["fc2"]["carried"] == "exact", entry
        _, fc1, fc2 = _experts(weights, layer)
        gate, up = file[f"blk.{layer}.ffn_gate_exps.weight"], file[f"blk.{layer}.ffn_up_exps.weight"]
        expected = interleaved(gate, up)
        error = np.linalg.norm(fc1.dequantize() - expected) / np.linalg.norm(expected)
        assert error == pytest.approx(entry["fc1"]["relative_rms_error"], rel=1e-4)
        np.testing.assert_array_equal(fc2.dequantize(), file[f"blk.{layer}.ffn_down_exps.weight"])
    quality = json.loads((bundle_dir / "quality.json").read_text())
    assert quality["torch_parity"]["identical_greedy"] == 8, quality["torch_parity"]
    assert quality["candidates"][0]["passes"], quality["candidates"][0]


def test_layers_the_config_keeps_dense_are_built_as_the_builders_mlp(builds: Builds) -> None:
    """`mlp_only_layers` keeps a Qwen3-MoE layer dense (a plain SwiGLU MLP of `intermediate_size`): that layer is the
    builder's MLP, the other an MoE node, and the model still matches transformers (parity at fp32)."""
    published = {**QWEN3_MOE.published, "mlp_only_layers": [0]}
    _, bundle_dir = builds.get(dataclasses.replace(QWEN3_MOE, name="qwen3-moe-dense-first", published=published))
    parity = json.loads((bundle_dir / "quality.json").read_text())["torch_parity"]
    assert parity["identical_greedy"] == parity["prompts"] == 8, parity
    assert parity["max_probability_delta"] < 1e-4, parity
    graph = onnx.load(str(bundle_dir / "model.onnx"), load_external_data=False).graph
    assert {n.name.split("/")[2] for n in graph.node if n.op_type == "MoE"} == {"layers.1"}
    assert any(n.name.startswith("/model/layers.0/mlp/") for n in graph.node)
