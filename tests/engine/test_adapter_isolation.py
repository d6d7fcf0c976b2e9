"""One row's adapter never reaches another row of the batch, whatever its values (issue 47, row 2).

The real adapter rewrite (packager/export/lora.py) on a small graph shaped like the builder's (a fused qkv projection
and o_proj), run by ONNX Runtime with the runtime's own slots (AdapterSlots) bound as the engine binds them. Slot 2
is poisoned directly in the bound stacks, past every check a file goes through: a NaN, an infinity, or finite
weights so large that `x @ A` overflows. The base row and slot 1's row must come out bit for bit as they do beside a
harmless slot 2. With the mask multiplied in (`(x @ A) * mask`), NaN * 0 = NaN reached every row.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from packager.export.lora import add_adapter_inputs
from runtime.adapters.files import AdapterFile, AdapterFileError, pack
from runtime.adapters.layout import INDEX_INPUT, AdapterLayout, ModuleRange, Projection
from runtime.engine.adapter_slots import AdapterSlots, RequestAdapter

HIDDEN, RANK = 8, 2
QKV = Projection("qkv_proj", HIDDEN, 16, (ModuleRange("q_proj", 0, 8), ModuleRange("k_proj", 8, 12),
                                          ModuleRange("v_proj", 12, 16)))  # fmt: skip
O_PROJ = Projection("o_proj", HIDDEN, HIDDEN, (ModuleRange("o_proj", 0, HIDDEN),))
LAYOUT = AdapterLayout(rank=RANK, num_layers=1, projections=(QKV, O_PROJ))
OUTPUTS = ("qkv", "o")


def builder_like_graph() -> onnx.ModelProto:
    """`x [batch, seq, 8]` through the builder's projection names, each output a graph output."""
    rng = np.random.default_rng(0)
    nodes, weights, outputs = [], [], []
    for name, projection in (("qkv", QKV), ("o", O_PROJ)):
        stem = f"/model/layers.0/attn/{projection.name}/MatMul"
        weight = rng.normal(0, 0.5, (HIDDEN, projection.out_features)).astype(np.float32)
        weights.append(helper.make_tensor(f"{stem}/weight", TensorProto.FLOAT, weight.shape, weight.ravel()))
        nodes.append(helper.make_node("MatMul", ["x", f"{stem}/weight"], [f"{stem}/output_0"], name=stem))
        nodes.append(helper.make_node("Identity", [f"{stem}/output_0"], [name], name=f"{name}/out"))
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch_size", "seq", None]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", "seq", HIDDEN])
    graph = helper.make_graph(nodes, "projections", [x], outputs, initializer=weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10  # onnx 1.23 writes 14, which ONNX Runtime 1.31 does not load (FIELD-NOTES)
    add_adapter_inputs(model, LAYOUT)
    return model


def adapter(seed: int) -> RequestAdapter:
    rng = np.random.default_rng(seed)
    tensors = {}
    for projection in LAYOUT.projections:
        for module in projection.modules:
            tensors[f"layers.0.{module.module}.a"] = rng.normal(0, 1, (HIDDEN, RANK)).astype(np.float32)
            tensors[f"layers.0.{module.module}.b"] = rng.normal(0, 1, (RANK, module.stop - module.start)).astype(
                np.float32
            )
    return RequestAdapter(f"a{seed}", f"sha256:{seed}", AdapterFile(RANK, 1.5, {}, tensors))


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    return ort.InferenceSession(builder_like_graph().SerializeToString(), providers=["CPUExecutionProvider"])


def run(session: ort.InferenceSession, slots: AdapterSlots, x: np.ndarray) -> dict[str, np.ndarray]:
    """One run over the rows of `slots.rows`, binding the slots they use as the engine does."""
    feeds = {"x": x, INDEX_INPUT: slots.rows, **slots.views(slots.bound_slots(0, len(slots.rows)))}
    return dict(zip(OUTPUTS, session.run(list(OUTPUTS), feeds), strict=True))


def poison(slots: AdapterSlots, value: float) -> None:
    """Write `value` into slot 2's columns of every A stack, behind every check (as a bug or a hostile file would)."""
    for name, levels in slots.a_levels.items():
        columns = slots.columns[name]
        for level, stack in levels.items():
            if level >= 2:
                stack[:, columns : 2 * columns] = value


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 3e38], ids=["nan", "inf", "-inf", "finite-overflowing-x@A"])
def test_a_poisoned_slot_leaves_the_base_row_and_other_adapters_rows_bit_identical(
    session: ort.InferenceSession, value: float
) -> None:
    x = np.random.default_rng(1).normal(0, 1, (4, 3, HIDDEN)).astype(np.float32)
    slots = AdapterSlots(LAYOUT, capacity=2, pool_rows=4)
    assert (slots.acquire(adapter(1)), slots.acquire(adapter(2))) == (1, 2)
    slots.rows[:] = [0, 1, 2, 1]  # base, slot 1, slot 2, slot 1 again
    clean = run(session, slots, x)
    poison(slots, value)
    poisoned = run(session, slots, x)
    for name in OUTPUTS:
        assert np.isfinite(clean[name]).all()
        for row in (0, 1, 3):
            assert np.array_equal(poisoned[name][row], clean[name][row]), (name, row)
        assert not np.array_equal(poisoned[name][2], clean[name][2]), "the poisoned row itself must change"
    # The rows without slot 2 alone bind one slot: the same values as in the mixed batch.
    alone = AdapterSlots(LAYOUT, capacity=2, pool_rows=2)
    alone.acquire(adapter(1))
    alone.rows[:] = [0, 1]
    for name, values in run(session, alone, x[[0, 1]]).items():
        assert np.array_equal(values, poisoned[name][[0, 1]]), name


@pytest.mark.parametrize(
    ("side", "value", "scale", "expected"),
    [
        ("a", np.nan, 1.0, "1 NaN and 0 infinite values"),
        ("b", np.inf, 1.0, "0 NaN and 1 infinite values"),
        ("b", 2.0, 3e38, "beyond float32's range"),
        ("a", 1e30, 1e9, "beyond float32's range"),
    ],
)
def test_a_slot_never_takes_a_value_that_could_reach_other_rows(
    side: str, value: float, scale: float, expected: str
) -> None:
    """The second matmul adds `0 * b` for other slots' rows of B, exact only for a finite b: packing (the one way
    into a slot) refuses any adapter whose values or scaled values are not finite, before writing anything."""
    good = adapter(3).weights
    tensors = dict(good.tensors)
    key = f"layers.0.k_proj.{side}"
    tensors[key] = tensors[key].copy()
    tensors[key][0, 0] = value
    broken = AdapterFile(RANK, scale, {}, tensors)
    with pytest.raises(AdapterFileError, match=expected):
        pack(broken, LAYOUT)
    slots = AdapterSlots(LAYOUT, capacity=1, pool_rows=1)
    with pytest.raises(AdapterFileError, match=expected):
        slots.acquire(RequestAdapter("broken", "sha256:broken", broken))
    assert slots.resident() == {}
    for stack in [*slots.b_stacks.values(), *(s for levels in slots.a_levels.values() for s in levels.values())]:
        assert not stack.any()
