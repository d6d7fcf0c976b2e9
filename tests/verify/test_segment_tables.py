"""Tables a graph computes from initializers alone (a GGUF weight's scales from its float16s) in a segmented run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from packager.verify.segments import ExportSystem, partition, run_sequences

K = 64
BLOCK = 32


def _two_layers_reading_one_table(directory: Path) -> None:
    """x -> layer 0's MatMulNBits -> layer 1's MatMulNBits -> logits, both reading `w.scales`, a Cast of float16
    scales that comes first in the graph (as gguf/operators.py writes a tied weight's table, at its first reader)."""
    rng = np.random.default_rng(0)
    values = rng.integers(0, 16, (K, K // BLOCK, BLOCK // 2), dtype=np.uint8) * 17  # two nibbles a byte
    halves = (rng.random((K, K // BLOCK)) * 0.1 + 0.01).astype(np.float16)
    initializers = [numpy_helper.from_array(values, "w.blocks"), numpy_helper.from_array(halves, "w.scales.super")]
    table = helper.make_node("Cast", ["w.scales.super"], ["w.scales"], name="/gguf/w.scales/Cast", to=TensorProto.FLOAT)
    attributes = {"domain": "com.microsoft", "K": K, "N": K, "bits": 4, "block_size": BLOCK, "accuracy_level": 4}
    layers = [
        helper.make_node(
            "MatMulNBits", [x, "w.blocks", "w.scales"], [y], name=f"/model/layers.{i}/MatMulNBits", **attributes
        )
        for i, (x, y) in enumerate((("x", "hidden"), ("hidden", "logits")))
    ]
    nodes = [table, *layers]
    graph = helper.make_graph(
        nodes, "two-layers",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "S", K])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "S", K])],
        initializers,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=10), str(directory / "model.onnx"))


def test_each_segment_computes_the_tables_it_reads(tmp_path: Path) -> None:
    """Handed from segment to segment, the table reached layer 1's MatMulNBits as an input, not a constant: it then
    packs its weight without the scales, and its products came out 0. Each segment computes the table itself."""
    _two_layers_reading_one_table(tmp_path)
    system = ExportSystem(tmp_path, "gguf")
    segments = partition(system, budget=1)
    assert [[n.name for n in s] for s in segments] == [["/model/layers.0/MatMulNBits"], ["/model/layers.1/MatMulNBits"]]

    x = np.random.default_rng(1).standard_normal((1, 5, K)).astype(np.float32)
    kept, report = run_sequences(system, [(0,)], lambda _: {"x": x}, lambda i, logits: logits, budget=1)
    whole = ort.InferenceSession(str(tmp_path / "model.onnx")).run(["logits"], {"x": x})[0][0]
    assert report.segments == 2
    assert np.abs(whole).max() > 1.0
    np.testing.assert_allclose(kept[0], whole, rtol=1e-5, atol=1e-5)
