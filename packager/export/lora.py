"""Give a builder graph per-row LoRA adapter inputs (runtime/adapters/layout.py describes the computation).

Applied to the bundle's model graph before its prefill graphs are derived, so every graph the runtime runs takes
the same adapter inputs. The base matmuls are untouched: a GGUF's own blocks and a MatMulNBits stay as they are,
the adapter adds its delta in fp32 beside them.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from packager.errors import UserError
from runtime.adapters.layout import INDEX_INPUT, AdapterLayout, ModuleRange, Projection
from runtime.bundle import ModelFacts

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
_SLOTS = "adapter_slots"


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
    """Add the adapter inputs and each adapted projection's `+ (x @ A[index]) @ B[index]`, in place."""
    graph = model.graph
    nodes = {n.name: n for n in graph.node}
    graph.input.append(helper.make_tensor_value_info(INDEX_INPUT, TensorProto.INT64, [_BATCH]))
    producers = {o: n for n in graph.node for o in n.output}
    for layer in range(layout.num_layers):
        for projection in layout.projections:
            group = _GRAPH_PROJECTIONS[projection.name][0]
            matmul = _matmul(nodes, layer, group, projection.name)
            if matmul is None:
                raise UserError(f"layer {layer} of the exported graph has no {projection.name}; layers differ")
            x = matmul.input[0]
            out = f"/model/layers.{layer}/{group}/{projection.name}/MatMul/output_0"
            producer = producers[out]
            base = f"{out}/base"
            producer.output[list(producer.output).index(out)] = base
            a_name, b_name = layout.input_names(layer, projection.name)
            columns = layout.columns(projection)
            graph.input.append(
                helper.make_tensor_value_info(a_name, TensorProto.FLOAT, [_SLOTS, projection.in_features, columns])
            )
            graph.input.append(
                helper.make_tensor_value_info(b_name, TensorProto.FLOAT, [_SLOTS, columns, projection.out_features])
            )
            prefix = f"/model/layers.{layer}/{group}/{projection.name}/lora"
            added = [
                helper.make_node("Gather", [a_name, INDEX_INPUT], [f"{prefix}/A"], name=f"{prefix}/GatherA", axis=0),
                helper.make_node("MatMul", [x, f"{prefix}/A"], [f"{prefix}/xA"], name=f"{prefix}/MatMulA"),
                helper.make_node("Gather", [b_name, INDEX_INPUT], [f"{prefix}/B"], name=f"{prefix}/GatherB", axis=0),
                helper.make_node(
                    "MatMul", [f"{prefix}/xA", f"{prefix}/B"], [f"{prefix}/delta"], name=f"{prefix}/MatMulB"
                ),
                helper.make_node("Add", [base, f"{prefix}/delta"], [out], name=f"{prefix}/Add"),
            ]
            at = list(graph.node).index(producer) + 1
            for offset, node in enumerate(added):
                graph.node.insert(at + offset, node)


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
