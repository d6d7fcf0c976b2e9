"""Turn the builder's fp32 graph into one that computes with the GGUF's own blocks.

Every MatMul whose weight is an initializer, and every Gather of an embedding table (the table itself or the
transposed lm_head weight of a tied model), is matched row by row to the GGUF (rows.py) and replaced by the
operators of operators.py on those rows' blocks. Everything else of the builder's graph (attention, norms,
rotary caches, inputs and outputs) stays as it is, so the runtime serves it like any builder graph.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from gguf import GGMLQuantizationType, GGUFReader
from onnx import NodeProto, TensorProto, numpy_helper

from packager.export.external_data import WeightFile
from packager.export.gguf.blocks import BlockWeight, read_blocks, supported_types
from packager.export.gguf.operators import FloatWeight, GraphBuilder, Weight
from packager.export.gguf.rows import FLOAT_TYPES, RowIndex, Run, source_rows
from packager.export.graph import drop_dead_nodes

_FLOAT_TYPE = {
    GGMLQuantizationType.F32: TensorProto.FLOAT,
    GGMLQuantizationType.F16: TensorProto.FLOAT16,
    GGMLQuantizationType.BF16: TensorProto.BFLOAT16,
}


@dataclass
class CarryReport:
    """What became of each graph weight: the GGUF rows it now holds, or why it stayed float32."""

    # the node that computed with a graph weight (the new nodes' names start with it) -> the weight's name in the
    # fp32 graph, whether that initializer holds the rows as columns (a MatMul's `[K, N]`), and its GGUF rows
    carried: dict[str, dict[str, object]] = field(default_factory=dict)
    kept_float: dict[str, str] = field(default_factory=dict)  # node -> why its weight stayed float32
    tensors: dict[str, str] = field(default_factory=dict)  # GGUF tensor carried -> its type

    def to_json(self) -> dict[str, object]:
        return {
            "carried": self.carried,
            "kept_float32": self.kept_float,
            "gguf_types": dict(sorted(Counter(self.tensors.values()).items())),  # type -> GGUF tensors carried
        }


class _Weights:
    """Each GGUF tensor read once into its exact operator form."""

    def __init__(self, index: RowIndex) -> None:
        self._index = index
        self._read: dict[str, Weight] = {}

    def of(self, tensor: str) -> Weight:
        if tensor not in self._read:
            source = self._index.tensor(tensor)
            rows = source_rows(source)
            if source.tensor_type in FLOAT_TYPES:
                stored = rows.view(np.uint16) if source.tensor_type == GGMLQuantizationType.BF16 else rows
                self._read[tensor] = FloatWeight(np.asarray(stored), _FLOAT_TYPE[source.tensor_type])
            else:
                self._read[tensor] = read_blocks(source.tensor_type, rows)
        return self._read[tensor]

    def type_name(self, tensor: str) -> str:
        return self._index.tensor(tensor).tensor_type.name

    def covers(self, run: Run) -> bool:
        """Whether `run` is the whole tensor in its own order."""
        return run.start == 0 and run.step == 1 and run.count == self.of(run.tensor).values.shape[0]

    def rows(self, run: Run) -> Weight:
        weight = self.of(run.tensor)
        if self.covers(run):
            return weight
        if isinstance(weight, FloatWeight):
            return FloatWeight(weight.values[run.indices()], weight.data_type)
        return weight.take(run.indices())


@dataclass(frozen=True)
class _Match:
    """A node of the fp32 graph whose weight was found in the GGUF."""

    node: NodeProto
    weight: str  # the fp32 initializer's name
    transposed: bool  # whether it holds the rows as columns
    runs: list[Run]
    parts: list[tuple[str, Weight]]  # the rows as consecutive groups of one layout each (`_layout_runs`)

    @property
    def layout(self) -> object:
        """The one layout of its rows, or None when they have several."""
        return self.parts[0][1].layout if len(self.parts) == 1 else None


def carry_gguf_weights(
    model: onnx.ModelProto, gguf_path: Path, accuracy_level: int, max_positions: int
) -> tuple[WeightFile, CarryReport]:
    """Rewrite `model` (loaded with its weights) in place; returns its initializers to save, and the report.

    The rotary tables (GroupQueryAttention's cos/sin caches, one row per position) keep `max_positions` rows.
    """
    reader = GGUFReader(str(gguf_path))
    unsupported = sorted(
        {t.tensor_type.name for t in reader.tensors if t.tensor_type not in (*supported_types(), *FLOAT_TYPES)}
    )
    index = RowIndex(reader)
    weights = _Weights(index)
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    report = CarryReport()
    matches: dict[str, _Match] = {}
    for node in graph.node:
        target = _weight_of(node, initializers, producers)
        if target is None:
            continue
        name, rows, transposed = target
        runs = index.locate(rows)
        if runs is None:
            report.kept_float[node.name] = "its rows are not rows of the GGUF" + (
                f" (the file also holds {', '.join(unsupported)}, which onnxfn cannot carry)" if unsupported else ""
            )
            continue
        match = _Match(node, name, transposed, runs, _layout_runs(runs, weights, name))
        if node.op_type == "Gather" and match.layout is None:  # a table of several GGUF layouts: keep it float
            report.kept_float[node.name] = "its rows come from GGUF tensors of different types"
            continue
        matches[node.name] = match
        for run in runs:
            report.tensors[run.tensor] = weights.type_name(run.tensor)

    files = WeightFile()
    rewritten: list[NodeProto] = []
    builder = GraphBuilder(files, accuracy_level, nodes=rewritten)
    fused = {m.node.name: group for group in _siblings(matches.values()) for m in group}
    for node in graph.node:
        matched = matches.get(node.name)
        if matched is None:
            rewritten.append(node)
        elif node.name in fused:
            group = fused[node.name]
            if group[0] is matched:  # emitted once, where the first of them was
                _emit_siblings(builder, group, report)
        elif node.op_type == "MatMul":
            builder.matmul(node.input[0], node.output[0], matched.parts, node.name)
            _report(report, matched, node.name, 0)
        else:
            (key, weight), *_ = matched.parts
            builder.gather(node.input[1], node.output[0], key, weight, node.name)
            _report(report, matched, node.name, 0)
    del graph.node[:]
    graph.node.extend(rewritten)
    drop_dead_nodes(graph)  # the Transpose a tied embedding no longer needs
    used = {i for node in graph.node for i in node.input} | {o.name for o in graph.output}
    rotary = {n.input[i] for n in graph.node if n.op_type == "GroupQueryAttention" for i in (7, 8) if len(n.input) > i}
    for tensor in graph.initializer:
        if tensor.name in used and tensor.name not in files:
            array = numpy_helper.to_array(tensor)
            files.add(tensor.name, array[:max_positions] if tensor.name in rotary else array)
    return files, report


def _siblings(matches: Iterable[_Match]) -> list[list[_Match]]:
    """MatMuls reading one input with weights of one layout (an MLP's gate and up projections): computed as one.

    One operator over their rows instead of two halves the residual nodes too: the gate/up pair ran ~9 % faster
    per decode step in the probe (shared/probes/gguf-exact).
    """
    by_input: dict[tuple[str, object], list[_Match]] = {}
    for match in matches:
        if match.node.op_type == "MatMul" and match.layout is not None:
            by_input.setdefault((match.node.input[0], match.layout), []).append(match)
    return [group for group in by_input.values() if len(group) > 1]


def _emit_siblings(builder: GraphBuilder, group: list[_Match], report: CarryReport) -> None:
    first = group[0].node
    name = f"{first.name}/siblings"
    weights = [m.parts[0][1] for m in group]
    joined: Weight
    if isinstance(weights[0], FloatWeight):
        joined = FloatWeight(np.concatenate([w.values for w in weights]), weights[0].data_type)  # type: ignore[union-attr]
    else:
        joined = BlockWeight.concatenate(weights)  # type: ignore[arg-type]
    sizes = [w.values.shape[0] for w in weights]
    builder.matmul_split(first.input[0], [m.node.output[0] for m in group], name, joined, sizes, name)
    offset = 0
    for match, size in zip(group, sizes, strict=True):
        _report(report, match, name, offset)
        offset += size


def _report(report: CarryReport, match: _Match, computed_by: str, first_row: int) -> None:
    report.carried[match.node.name] = {
        "weight": match.weight,
        "transposed": match.transposed,
        "computed_by": computed_by,
        "first_row": first_row,
        "runs": [{"tensor": r.tensor, "start": r.start, "step": r.step, "count": r.count} for r in match.runs],
    }


def _weight_of(
    node: NodeProto, initializers: dict[str, TensorProto], producers: dict[str, NodeProto]
) -> tuple[str, np.ndarray, bool] | None:
    """The weight a MatMul multiplies by, or an embedding Gather's table, as float32 rows `[out, K]`, with its
    initializer's name and whether that initializer holds the rows as columns; else None."""
    if node.op_type == "MatMul" and node.input[1] in initializers:
        tensor = initializers[node.input[1]]
        if tensor.data_type == TensorProto.FLOAT and len(tensor.dims) == 2:
            return tensor.name, np.ascontiguousarray(numpy_helper.to_array(tensor).T), True
    if node.op_type == "Gather" and node.input[1] not in initializers:
        table = node.input[0]
        if table in initializers and initializers[table].data_type == TensorProto.FLOAT:
            return table, numpy_helper.to_array(initializers[table]), False
        transpose = producers.get(table)
        if transpose is not None and transpose.op_type == "Transpose" and transpose.input[0] in initializers:
            tensor = initializers[transpose.input[0]]
            if tensor.data_type == TensorProto.FLOAT and len(tensor.dims) == 2:
                return tensor.name, np.ascontiguousarray(numpy_helper.to_array(tensor).T), True
    return None


def _layout_runs(runs: list[Run], weights: _Weights, name: str) -> list[tuple[str, Weight]]:
    """The rows of `runs` as consecutive groups of one layout each, keyed for sharing between nodes.

    A group that is one whole GGUF tensor in its own order is keyed by that tensor's name, so a tied embedding
    and lm_head read one copy of its blocks.
    """
    groups: list[list[Run]] = []
    for run in runs:
        if groups and weights.of(groups[-1][0].tensor).layout == weights.of(run.tensor).layout:
            groups[-1].append(run)
        else:
            groups.append([run])
    parts: list[tuple[str, Weight]] = []
    for i, group in enumerate(groups):
        pieces = [weights.rows(run) for run in group]
        whole = len(group) == 1 and weights.covers(group[0])
        key = f"gguf/{group[0].tensor}" if whole else (f"{name}/gguf" if len(groups) == 1 else f"{name}/gguf{i}")
        if isinstance(pieces[0], FloatWeight):
            weight: Weight = FloatWeight(np.concatenate([p.values for p in pieces]), pieces[0].data_type)  # type: ignore[union-attr]
        else:
            weight = BlockWeight.concatenate(pieces)  # type: ignore[arg-type]
        parts.append((key, weight))
    return parts
