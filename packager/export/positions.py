"""Position ids computed inside the graph, for the builder graphs that rotate q and k outside attention.

Most builder graphs rotate inside GroupQueryAttention, which derives each token's position from the attention
mask. Where the builder rotates with separate RotaryEmbedding nodes (HunYuan: q/k norms after the rotation) the
graph takes a `position_ids` input instead, which the runtime, the verifier and every bundle's prefill graph do not
feed. Here that input is replaced by the positions GroupQueryAttention would use (its `GeneratePositionIds`),
from `input_ids` (S new tokens) and `attention_mask` (T wide, a row's ones covering its past and new tokens):
- a first prompt (S == T, rows right-padded): 0 .. S-1 in every row;
- else (a chunk after a past, a ragged decode step): `sum(mask[row]) - S + i` for the i-th new token,
clamped at 0 for the padding of an empty row. So a bundle serves these graphs exactly as it serves the others.
"""

from __future__ import annotations

from typing import Any

import numpy as np

POSITION_IDS = "position_ids"
_PREFIX = "/model/position_ids"


def derive_position_ids(graph: Any) -> bool:
    """Replace `graph`'s (an onnx_ir graph) `position_ids` input by positions computed from the mask; False if it
    has no such input."""
    import onnx_ir as ir

    inputs = {value.name: value for value in graph.inputs}
    if POSITION_IDS not in inputs:
        return False
    position_ids, input_ids, mask = inputs[POSITION_IDS], inputs["input_ids"], inputs["attention_mask"]

    def constant(name: str, values: list[int]) -> Any:
        value = ir.val(f"{_PREFIX}/{name}", const_value=ir.tensor(np.asarray(values, np.int64), name=name))
        graph.register_initializer(value)
        return value

    def op(op_type: str, *args: Any, **attributes: Any) -> Any:
        node = ir.node(op_type, list(args), attributes or None, name=f"{_PREFIX}/{op_type}_{len(nodes)}")
        node.outputs[0].name = f"{node.name}/output_0"
        nodes.append(node)
        return node.outputs[0]

    nodes: list[Any] = []
    zero, one, axis1 = constant("zero", [0]), constant("one", [1]), constant("axis1", [1])
    new = op("Gather", op("Shape", input_ids), one, axis=0)  # S, as [1]
    total = op("Gather", op("Shape", mask), one, axis=0)  # T, as [1]
    steps = op("Unsqueeze", op("Range", op("Squeeze", zero), op("Squeeze", new), op("Squeeze", one)), zero)  # [1, S]
    seen = op("ReduceSum", op("Cast", mask, to=ir.DataType.INT64), axis1, keepdims=1)  # [B, 1]
    after_past = op("Max", op("Add", op("Sub", seen, new), steps), zero)  # [B, S]
    first_prompt = op("Equal", new, total)
    positions = op("Where", first_prompt, op("Add", op("Mul", seen, zero), steps), after_past)  # [B, S] either way
    position_ids.replace_all_uses_with(positions)
    graph.inputs.remove(position_ids)
    graph.extend(nodes)
    return True
