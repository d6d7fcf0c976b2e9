"""Precision `gguf`: every weight of the bundle is the source GGUF's own, for every block type onnxfn carries.

Three levels: each type's blocks read into the operators' form (vs the `gguf` package's dequantization);
ONNX Runtime computing with that form (vs a float matmul on the `gguf` package's weights); and whole bundles,
a tiny generated GGUF holding every type and the demo, read back from their ONNX operators alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from onnx import TensorProto, helper

from packager.build import build_function
from packager.export.external_data import WeightFile
from packager.export.gguf.blocks import read_blocks, supported_types
from packager.export.gguf.operators import GraphBuilder, loaded
from packager.export.materialize import Rewrite, Structure
from packager.progress import StepProgress
from packager.sources.weights import GgufWeights
from packager.spec import load_spec
from runtime.bundle import open_bundle
from runtime.engine.tables import write_tables_beside
from tests.fixtures.gguf_bundle import BundleWeights, GgufSource
from tests.fixtures.tiny_gguf import EMBEDDING_TYPE, LAYER_TYPES, random_blocks, write_tiny_gguf
from tests.packager.conftest import write_function

TYPES = supported_types()


def _close_to_fp32_rounding(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal up to a few float32 roundings of the row's largest weight (the residual form adds two)."""
    scale = np.abs(expected).max(axis=-1, keepdims=True) + np.float32(1e-30)
    assert np.all(np.abs(actual - expected) <= 4 * np.finfo(np.float32).eps * scale), np.abs(actual - expected).max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_read_as_the_gguf_package_dequantizes_them(qtype: GGMLQuantizationType) -> None:
    raw = random_blocks(qtype, 48, 512, np.random.default_rng(int(qtype)))
    weight = read_blocks(qtype, raw)
    expected = dequantize(raw, qtype).reshape(48, 512)
    assert weight.values.max() < (1 << weight.bits)
    _close_to_fp32_rounding(weight.dequantize(), expected)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_onnx_runtime_computes_with_the_blocks_as_the_gguf_package_defines_them(
    qtype: GGMLQuantizationType, tmp_path: Path
) -> None:
    """MatMulNBits (fp32 compute) and GatherBlockQuantized on a type's blocks: nibble order, zero points, residual."""
    rng = np.random.default_rng(int(qtype))
    rows, k = 64, 512
    raw = random_blocks(qtype, rows, k, rng)
    expected = dequantize(raw, qtype).reshape(rows, k)
    x = rng.standard_normal((3, 2, k)).astype(np.float32)
    ids = np.array([[0, 7, 63], [5, 5, 1]], np.int64)

    weights = WeightFile(tmp_path / "m.onnx")
    builder = GraphBuilder(weights, accuracy_level=0)  # fp32 compute: only the weights' exactness shows
    builder.matmul("x", "y", [loaded("w", read_blocks(qtype, raw))], "/proj/MatMul")
    builder.gather("ids", "e", loaded("w", read_blocks(qtype, raw)), "/embed/Gather")
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, k]),
        helper.make_tensor_value_info("ids", TensorProto.INT64, [None, None]),
    ]
    graph = helper.make_graph(
        builder.nodes, "g", inputs,
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "e")],
    )  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )
    weights.save(model)
    write_tables_beside(tmp_path)  # what the runtime expands where the bundle runs (runtime/engine/tables.py)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    y, e = session.run(["y", "e"], {"x": x, "ids": ids})
    reference = x.astype(np.float64) @ expected.T.astype(np.float64)
    np.testing.assert_allclose(y, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
    _close_to_fp32_rounding(e, expected[ids])


@pytest.fixture(scope="module")
def tiny_gguf_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The tiny GGUF built at precision `gguf` through `pkg build`: (gguf file, bundle, the build cache)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    gguf_path = write_tiny_gguf(root / "tiny.gguf")
    cache = root / "cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONNXFN_CACHE_DIR", str(cache))
        patch.chdir(root)
        # Random blocks are no language model: the budget only has to admit the int8 activations' rounding.
        extra = '[export]\nprecision = "gguf"\nmax_context = 256\n[export.quality]\nmin_top1_agreement = 0.5\n'
        extra += "max_mean_kl = 1.0\nmax_perplexity_increase_pct = 100.0\n"
        function = write_function(root, "tiny-gguf", f"gguf:{gguf_path}", extra)
        result = build_function(load_spec(function), StepProgress())
    return gguf_path, root / result.bundle, cache


class _Fp32Weights:
    """The fp32 graph's weights as its recipes compute them from the source (what the fp32 reference runs with)."""

    def __init__(self, cache: Path, gguf_path: Path) -> None:
        (structure,) = (cache / "structure").glob("*/structure.onnx")
        (config,) = (cache / "gguf-config").glob("*/config.json")
        self._rewrite = Rewrite(Structure(structure.parent), GgufWeights(gguf_path, config.parent), 256)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._rewrite.weight(name)


def _check_bundle(bundle_dir: Path, gguf_path: Path, reference: _Fp32Weights | None) -> dict[str, int]:
    weights, source = BundleWeights(bundle_dir), GgufSource(gguf_path)
    assert weights.report["kept_float32"] == {}
    for node, carried in weights.report["carried"].items():
        actual = weights.rows(node)
        _close_to_fp32_rounding(actual, source.rows(carried["runs"]))
        if reference is not None:  # and they are the rows the fp32 graph computed with, in its order
            expected = reference[carried["weight"]]
            _close_to_fp32_rounding(actual, expected.T if carried["transposed"] else expected)
    return weights.report["gguf_types"]


def test_a_tiny_gguf_of_every_type_builds_with_each_weight_the_files_own(
    tiny_gguf_build: tuple[Path, Path, Path],
) -> None:
    gguf_path, bundle_dir, cache = tiny_gguf_build
    bundle = open_bundle(bundle_dir)
    assert bundle.manifest.model.precision == "gguf"
    types = _check_bundle(bundle_dir, gguf_path, _Fp32Weights(cache, gguf_path))
    expected = {t.name for layer in LAYER_TYPES for t in layer.values()} | {EMBEDDING_TYPE.name}
    assert set(types) == expected
    assert {t.name for t in TYPES} <= expected  # the fixture covers every carried type
    computed_by = {c["computed_by"] for c in BundleWeights(bundle_dir).report["carried"].values()}
    assert "/model/layers.2/mlp/gate_proj/MatMul/siblings" in computed_by  # gate and up as one operator


def test_the_tiny_gguf_bundle_is_about_the_files_size(tiny_gguf_build: tuple[Path, Path, Path]) -> None:
    gguf_path, bundle_dir, _ = tiny_gguf_build
    bundle = open_bundle(bundle_dir)
    weights = bundle.manifest.files["model.onnx.data"].size
    assert weights <= 1.5 * gguf_path.stat().st_size, (weights, gguf_path.stat().st_size)
    assert "prefill.onnx.data" not in bundle.manifest.files  # derived where it runs (runtime/engine/derived.py)


@pytest.mark.real_model
def test_the_demo_bundle_holds_the_ggufs_own_blocks(demo_bundle: Path) -> None:
    from packager.sources import locate_source
    from tests.conftest import DEMO_FUNCTION

    spec = load_spec(DEMO_FUNCTION)
    gguf_path = locate_source(spec.model.source, DEMO_FUNCTION).paths[0]  # type: ignore[union-attr]
    bundle = open_bundle(demo_bundle)
    assert bundle.manifest.model.precision == "gguf"
    types = _check_bundle(demo_bundle, gguf_path, None)
    assert types == {"Q4_1": 210, "Q8_0": 1}  # every linear weight; the tied embedding (also lm_head)
    quality = json.loads(bundle.file("quality.json").read_text())
    (int8,) = quality["compared"]
    gguf = next(c for c in quality["candidates"] if c["precision"] == "gguf")
    assert gguf["mean_kl"] <= int8["mean_kl"]
    total = sum(f.size for f in bundle.manifest.files.values())
    assert total <= 1.5 * gguf_path.stat().st_size, (total, gguf_path.stat().st_size)
