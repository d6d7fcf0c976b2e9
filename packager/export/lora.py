"""Give a builder graph per-row LoRA adapter inputs (runtime/adapters/layout.py describes the computation).

Applied to the bundle's model graph before its prefill graphs are derived, so every graph the runtime runs takes
the same adapter inputs. The base matmuls are untouched: a GGUF's own blocks and a MatMulNBits stay as they are,
the adapter adds its delta in fp32 beside them.
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx import TensorProto, helper

from packager.errors import UserError
from runtime.adapters.layout import INDEX_INPUT, AdapterLayout, ModuleRange, Projection
from runtime.bundle import ModelFacts

LORA_GRAPH_VERSION = 5  # bump when the adapter nodes change, to rebuild bundles and adapted exports

# The builder's projection names (`/model/layers.N/{group}/{name}/MatMul`) and the modules each computes.
_GRAPH_PROJECTIONS = {
    "qkv_proj": ("attn", ("q_proj", "k_proj", "v_proj")),
    "q_proj": ("attn", ("q_proj",)),
    "k_proj": ("attn", ("k_proj",)),
    "v_proj": ("attn", ("v_proj",)),
    "o_proj": ("attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "gate_proj": ("mlp", ("gate_proj",)),
    "up_proj": ("mlp", ("up_proj",)),
    "down_proj": ("mlp", ("down_proj",)),
}
_BATCH = "batch_size"
_ONE = "/adapters/one"
_ZERO = "/adapters/zero"
_ZERO_FLOAT = "/adapters/zero_float"
_AXIS_0 = "/adapters/axes_0"
_AXIS_1 = "/adapters/axes_1"
_INDEX_COLUMN = "/adapters/index_column"


def plan_layout(model: onnx.ModelProto, facts: ModelFacts, modules: tuple[str, ...], rank: int) -> AdapterLayout:
    """The layout adapting `modules` at up to `rank` in `model`, read from layer 0's matmuls (every layer alike)."""
    nodes = {n.name: n for n in model.graph.node}
    initializers = {t.name: t for t in model.graph.initializer}
    projections: list[Projection] = []
    covered: list[str] = []
    for name, (group, computes) in _GRAPH_PROJECTIONS.items():
        targeted = [m for m in computes if m in modules]
        node = _matmul(nodes, 0, group, name)
        if node is None or not targeted:
            continue
        in_features, out_features = _shape(node, initializers)
        ranges = _module_ranges(computes, out_features, facts)
        projections.append(Projection(name, in_features, out_features, tuple(r for r in ranges if r.module in modules)))
        covered += targeted
    missing = [m for m in modules if m not in covered]
    if missing:
        raise UserError(
            f"the exported graph has no projection computing {', '.join(missing)}; adapters can target "
            f"{', '.join(m for _, ms in _GRAPH_PROJECTIONS.values() for m in ms if m in covered) or 'nothing here'}"
        )
    return AdapterLayout(rank=rank, num_layers=facts.num_layers, projections=tuple(projections))


def add_adapter_inputs(model: onnx.ModelProto, layout: AdapterLayout) -> None:
    """Add the adapter inputs and each adapted projection's masked delta (layout.py), in place."""
    graph = model.graph
    nodes = {n.name: n for n in graph.node}
    producers = {o: n for n in graph.node for o in n.output}
    graph.input.append(helper.make_tensor_value_info(INDEX_INPUT, TensorProto.INT64, [_BATCH]))
    for layer in range(layout.num_layers):
        for projection in layout.projections:
            group = _GRAPH_PROJECTIONS[projection.name][0]
            matmul = _matmul(nodes, layer, group, projection.name)
            if matmul is None:
                raise UserError(f"layer {layer} of the exported graph has no {projection.name}; layers differ")
            out = f"/model/layers.{layer}/{group}/{projection.name}/MatMul/output_0"
            producer = producers[out]
            base = f"{out}/base"
            producer.output[list(producer.output).index(out)] = base
            a_name, b_name = layout.input_names(layer, projection.name)
            # Stacks of one column count share a symbolic width (the runtime binds them alike); others do not, or
            # ONNX Runtime's memory planner would take them for one size.
            bound = f"adapter_columns_{layout.columns(projection)}"
            shapes: dict[str, list[int | str]] = {
                a_name: [projection.in_features, bound],
                b_name: [bound, projection.out_features],
            }
            for name, shape in shapes.items():
                graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
            at = list(graph.node).index(producer) + 1
            prefix = f"/model/layers.{layer}/{group}/{projection.name}/lora"
            delta = _delta(matmul.input[0], (a_name, b_name), layout.columns(projection), base, out, prefix)
            for offset, node in enumerate(delta):
                graph.node.insert(at + offset, node)
    # The masks read only graph inputs: computed once per run, first.
    for offset, node in enumerate(_masks(layout)):
        graph.node.insert(offset, node)
    constants = {_ONE: ([], [1]), _ZERO: ([], [0]), _AXIS_0: ([1], [0]), _AXIS_1: ([1], [1])}
    constants |= {_rank(layout.columns(p)): ([], [layout.columns(p)]) for p in layout.projections}
    graph.initializer.extend(helper.make_tensor(n, TensorProto.INT64, dims, v) for n, (dims, v) in constants.items())
    graph.initializer.append(helper.make_tensor(_ZERO_FLOAT, TensorProto.FLOAT, [], [0.0]))


def _masks(layout: AdapterLayout) -> list[onnx.NodeProto]:
    """Per column count C, the mask `[batch, 1, slots * C]`: true where a row runs the adapter owning that column
    (slot j owns columns `(j - 1) * C .. j * C`; the row's index is j), over the columns bound this run."""

    def node(op: str, inputs: list[str], output: str, **attrs: Any) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [output], name=output, **attrs)

    masks = [node("Unsqueeze", [INDEX_INPUT, _AXIS_1], _INDEX_COLUMN)]  # [batch, 1]
    for columns in sorted({layout.columns(p) for p in layout.projections}):
        sample = next(p for p in layout.projections if layout.columns(p) == columns)
        stack, mask = layout.input_names(0, sample.name)[0], _mask(columns)
        masks += [
            node("Shape", [stack], f"{mask}/bound_1d", start=1, end=2),  # [slots * C]: as many as are bound
            node("Squeeze", [f"{mask}/bound_1d", _AXIS_0], f"{mask}/bound"),
            node("Range", [_ZERO, f"{mask}/bound", _ONE], f"{mask}/column"),
            node("Div", [f"{mask}/column", _rank(columns)], f"{mask}/slot_from_0"),
            node("Add", [f"{mask}/slot_from_0", _ONE], f"{mask}/slot"),  # the index owning each column
            node("Equal", [_INDEX_COLUMN, f"{mask}/slot"], f"{mask}/owned"),  # [batch, slots * C]
            node("Unsqueeze", [f"{mask}/owned", _AXIS_1], mask),  # [batch, 1, slots * C]
        ]
    return masks


def _delta(x: str, stacks: tuple[str, str], columns: int, base: str, out: str, prefix: str) -> list[onnx.NodeProto]:
    """`out = base + Where(mask, x @ A, 0) @ B` over every bound slot at once: two matmuls on the run's rows.

    `Where`, not a multiplication by the mask: another slot's column of `x @ A` may be NaN or inf (its A holds one,
    or a finite A overflows on this row's activations), and `NaN * 0` is NaN, which the second matmul would add to
    every output of the row. `Where` writes an exact 0 whatever the column held. The second matmul then sums
    over every bound slot's rows of B, adding exact zeros (`fma(0, b, acc) == acc` for any finite b: the slots
    hold finite values only, runtime/adapters/files.py refuses any other) for all but the row's own, and a slot's
    columns sit at the same place whatever else is bound: a row's delta depends neither on its batch nor on its
    neighbours' adapters. With no adapter in the run nothing is bound (zero columns), and the delta is zeros.
    """
    a_name, b_name = stacks

    def node(op: str, inputs: list[str], output: str) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [f"{prefix}/{output}"], name=f"{prefix}/{output}")

    return [
        node("MatMul", [x, a_name], "xA"),  # [batch, seq, slots * C]
        node("Where", [_mask(columns), f"{prefix}/xA", _ZERO_FLOAT], "xA_own"),
        node("MatMul", [f"{prefix}/xA_own", b_name], "delta"),  # [batch, seq, out]
        helper.make_node("Add", [base, f"{prefix}/delta"], [out], name=f"{prefix}/Add"),
    ]


def _rank(columns: int) -> str:
    return f"/adapters/columns_{columns}"


def _mask(columns: int) -> str:
    return f"/adapters/mask_{columns}"


def _matmul(nodes: dict[str, onnx.NodeProto], layer: int, group: str, name: str) -> onnx.NodeProto | None:
    """The projection's weight matmul: the builder's fp32 `MatMul`, its int8/int4 `MatMul_Q8`/`MatMul_Q4`, or a GGUF
    export's `MatMul/MatMulNBits` (whose block residual adds to it after: the projection's output is `MatMul/output_0`
    in every case)."""
    stem = f"/model/layers.{layer}/{group}/{name}/MatMul"
    for candidate in (stem, f"{stem}_Q8", f"{stem}_Q4", f"{stem}/MatMulNBits"):
        node = nodes.get(candidate)
        if node is not None and node.op_type in ("MatMul", "MatMulNBits"):
            return node
    return None


def _shape(node: onnx.NodeProto, initializers: dict[str, TensorProto]) -> tuple[int, int]:
    if node.op_type == "MatMulNBits":
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        return int(attrs["K"]), int(attrs["N"])
    weight = initializers.get(node.input[1])
    if weight is None or len(weight.dims) != 2:
        raise UserError(f"{node.name} multiplies by {node.input[1]!r}, not a 2-D weight; cannot adapt it")
    return int(weight.dims[0]), int(weight.dims[1])


def _module_ranges(computes: tuple[str, ...], out_features: int, facts: ModelFacts) -> list[ModuleRange]:
    """Each computed module's output columns; a fused qkv splits by the head counts, gate_up in halves."""
    if len(computes) == 1:
        widths = [out_features]
    elif computes == ("q_proj", "k_proj", "v_proj"):
        kv = facts.num_kv_heads * facts.head_dim
        widths = [facts.num_heads * facts.head_dim, kv, kv]
    else:
        widths = [out_features // 2, out_features // 2]
    if sum(widths) != out_features:
        raise UserError(f"{'+'.join(computes)} writes {out_features} columns, not the {sum(widths)} the heads make")
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return [ModuleRange(m, s, s + w) for m, s, w in zip(computes, starts, widths, strict=True)]
