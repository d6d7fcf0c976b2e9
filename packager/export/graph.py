"""Read an exported graph's structure (not its weights) to check the contract the runtime relies on."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import onnx
from onnx import NodeProto

from packager.errors import UserError

REQUIRED_FUSED_OPS = ("GroupQueryAttention",)
QUANTIZED_OP = "MatMulNBits"


def op_counts(model_path: Path) -> Counter[str]:
    model = onnx.load(str(model_path), load_external_data=False)
    return Counter(node.op_type for node in model.graph.node)


def all_inputs(node: NodeProto) -> Iterable[str]:
    """The node's inputs, and the outer values its subgraphs read (an If choosing rotary tables)."""
    yield from node.input
    for attribute in node.attribute:
        for graph in [attribute.g, *attribute.graphs] if attribute.type in (5, 10) else []:
            inner = {o for n in graph.node for o in n.output} | {i.name for i in graph.initializer}
            for inner_node in graph.node:
                for name in all_inputs(inner_node):
                    if name not in inner:
                        yield name


def drop_dead_nodes(graph: onnx.GraphProto) -> None:
    """Remove the nodes none of whose outputs is read, until none is left (after a rewrite bypassed some)."""
    while True:
        read = {i for node in graph.node for i in node.input} | {o.name for o in graph.output}
        live = [node for node in graph.node if any(o in read for o in node.output)]
        if len(live) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(live)


def check_decoder_graph(model_path: Path, precision: str) -> Counter[str]:
    """Fail the build when the graph lacks the fused ops the runtime's KV-cache design assumes."""
    counts = op_counts(model_path)
    # `gguf` keeps what the file holds: an F16 or BF16 GGUF gives a graph without MatMulNBits.
    required = list(REQUIRED_FUSED_OPS) + ([QUANTIZED_OP] if precision in ("int8", "int4") else [])
    missing = [op for op in required if counts[op] == 0]
    if missing:
        raise UserError(
            f"the exported {precision} graph {model_path} has no {', '.join(missing)} nodes; "
            "the runtime needs them (shared-buffer KV cache, quantized weights). Check the builder log."
        )
    return counts
