"""Precision `gguf`: the structure's matmuls and embedding lookups computing with the GGUF's own blocks.

A weight's recipe says which source rows it holds (lazy.row_sources: the builder only concatenated and
transposed them), the source says which GGUF rows those are (sources/weights.py: the converter's q/k
permutation undone as a row permutation), so each weight is carried by name, never matched by value. Its rows'
blocks are read from the mapped file when its node is written, and forgotten after (operators.WeightRef).
A weight whose recipe computes anything (a norm's `+ 1`) is a float weight, evaluated from its recipe.
Mixture-of-Experts layers' experts go into `QMoE` (experts.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from onnx import NodeProto, TensorProto

from packager.export.gguf.blocks import BlockWeight, read_blocks, supported_types
from packager.export.gguf.experts import ExpertCarry
from packager.export.gguf.operators import FloatWeight, GraphBuilder, Weight, WeightRef
from packager.export.lazy import Recipe, leaves
from packager.export.materialize import Rewrite, Sink
from packager.export.recipe_rows import row_sources
from packager.sources.weights import GgufWeights

FLOAT_TYPES = {
    GGMLQuantizationType.F32: TensorProto.FLOAT,
    GGMLQuantizationType.F16: TensorProto.FLOAT16,
    GGMLQuantizationType.BF16: TensorProto.BFLOAT16,
}


@dataclass(frozen=True)
class Run:
    """Rows `start, start + step, …` (`count` of them) of the GGUF tensor `tensor`."""

    tensor: str
    start: int
    step: int
    count: int

    def indices(self) -> np.ndarray:
        return self.start + self.step * np.arange(self.count)

    def to_json(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "start": self.start, "step": self.step, "count": self.count}


def runs_of(tensor: str, rows: np.ndarray) -> list[Run]:
    """`rows` of `tensor` as arithmetic runs (a permuted q projection: one run per head half)."""
    runs: list[Run] = []
    for row in rows.tolist():
        last = runs[-1] if runs else None
        if last is not None:
            if last.count == 1 and row != last.start:
                runs[-1] = Run(tensor, last.start, row - last.start, 2)
                continue
            if row == last.start + last.step * last.count:
                runs[-1] = Run(tensor, last.start, last.step, last.count + 1)
                continue
        runs.append(Run(tensor, row, 1, 1))
    return runs


@dataclass
class CarryReport:
    """What became of each graph weight: the GGUF rows it now holds, or why it stayed float32."""

    # the node that computed with a graph weight (the new nodes' names start with it) -> the weight's name in the
    # fp32 graph, whether that initializer holds the rows as columns (a MatMul's `[K, N]`), and its GGUF rows
    carried: dict[str, dict[str, object]] = field(default_factory=dict)
    kept_float: dict[str, str] = field(default_factory=dict)  # node -> why its weight stayed float32
    tensors: dict[str, str] = field(default_factory=dict)  # GGUF tensor carried -> its type
    experts: dict[str, dict[str, Any]] = field(default_factory=dict)  # MoE node -> its projections (experts.py)

    def to_json(self) -> dict[str, object]:
        report: dict[str, object] = {
            "carried": self.carried,
            "kept_float32": self.kept_float,
            "gguf_types": dict(sorted(Counter(self.tensors.values()).items())),  # type -> GGUF tensors carried
        }
        if self.experts:
            report["experts"] = self.experts
        return report


@dataclass(frozen=True)
class _Match:
    """A node of the structure whose weight is rows of the GGUF."""

    node: NodeProto
    weight: str  # the structure's initializer name
    transposed: bool  # whether that initializer holds the rows as columns
    runs: list[Run]
    parts: list[WeightRef]  # the rows as consecutive groups of one layout each

    @property
    def layout(self) -> object:
        """The one layout of its rows, or None when they have several."""
        return self.parts[0].layout if len(self.parts) == 1 else None


class GgufCarry:
    """The `gguf` precision (materialize.py's interface): rewrite nodes, carrying blocks into a sink."""

    precision = "gguf"

    def __init__(self, rewrite: Rewrite, accuracy_level: int) -> None:
        if not isinstance(rewrite.source, GgufWeights):
            raise ValueError("precision gguf needs a GGUF source")
        self.rewrite = rewrite
        self.source: GgufWeights = rewrite.source
        self.accuracy_level = accuracy_level
        self.report = CarryReport()
        self._layouts: dict[str, object] = {}
        self._experts = ExpertCarry(rewrite, self.source, accuracy_level)
        self._experts.report = self.report.experts
        self._experts.tensors = self.report.tensors

    @cached_property
    def _plan(self) -> tuple[dict[str, _Match], set[str]]:
        """Every node's match (from the file's metadata alone), and the nodes no longer needed once they are
        rewritten (the Transpose that fed a tied embedding's Gather the lm_head weight)."""
        graph = self.rewrite.structure.model.graph
        producers = {output: node for node in graph.node for output in node.output}
        matches: dict[str, _Match] = {}
        for node in graph.node:
            match, why = self._match(node, producers)
            if match is not None:
                matches[node.name] = match
            elif why is not None:
                self.report.kept_float[node.name] = why
        return matches, _dead_nodes(graph, matches)

    def nodes(self, nodes: list[NodeProto], sink: Sink) -> list[NodeProto]:
        matches, dead = self._plan
        rewritten: list[NodeProto] = []
        builder = GraphBuilder(sink, self.accuracy_level, nodes=rewritten)
        local = {n.name: matches[n.name] for n in nodes if n.name in matches}
        fused = {m.node.name: group for group in _siblings(local.values()) for m in group}
        for node in nodes:
            matched = local.get(node.name)
            if node.name in dead:
                continue
            if node.op_type == "MoE":
                rewritten.extend(self._experts.nodes(node, sink))
            elif matched is None:
                self.rewrite.add_inputs([node], sink)
                rewritten.append(node)
            elif node.name in fused:
                group = fused[node.name]
                if group[0] is matched:  # emitted once, where the first of them was
                    self._emit_siblings(builder, group)
            elif node.op_type == "MatMul":
                builder.matmul(node.input[0], node.output[0], matched.parts, node.name)
                self._record(matched, node.name, 0)
            else:
                builder.gather(node.input[1], node.output[0], matched.parts[0], node.name)
                self._record(matched, node.name, 0)
        return rewritten

    def _match(self, node: NodeProto, producers: dict[str, NodeProto]) -> tuple[_Match | None, str | None]:
        """The node's GGUF rows, or `(None, why its weight stays float)` (`(None, None)`: it has no weight)."""
        target = _weight_of(node, self.rewrite.structure.weights, producers)
        if target is None:
            return None, None
        name, flipped = target
        recipe = self.rewrite.structure.recipes[name]
        found = row_sources(recipe, self._leaf_rows)
        if found is None:
            return None, "its recipe computes with the source's values instead of moving rows"
        if found.transposed != (node.op_type == "MatMul" or flipped):
            return None, "its recipe holds the source's rows across the weight's input features"
        runs: list[Run] = []
        for leaf, rows in found.rows:
            located = self._gguf_rows(leaf)
            if located is None:
                return None, f"{leaf} is not rows of a GGUF tensor onnxfn can carry"
            tensor, permutation = located
            runs.extend(runs_of(tensor, permutation[rows]))
        parts = self._parts(runs, name)
        if node.op_type == "Gather" and len(parts) > 1:
            return None, "its rows come from GGUF tensors of different types"
        for run in runs:
            self.report.tensors[run.tensor] = self.source.tensor(run.tensor).tensor_type.name
        return _Match(node, name, found.transposed, runs, parts), None

    @cached_property
    def _leaves(self) -> dict[str, Recipe]:
        return {n.leaf: n for r in self.rewrite.structure.recipes.values() for n in leaves(r) if n.leaf is not None}

    def _leaf_rows(self, leaf: str) -> int:
        return int(self._leaves[leaf].shape[0])

    def _gguf_rows(self, leaf: str) -> tuple[str, np.ndarray] | None:
        for name in (leaf, *self._leaves[leaf].aliases):
            if not self.source.has(name):
                continue
            rows = self.source.rows(name)
            if rows is None:
                return None
            tensor = self.source.tensor(rows.tensor)
            if tensor.tensor_type not in (*supported_types(), *FLOAT_TYPES):
                return None
            return rows.tensor, rows.rows
        return None

    def _layout(self, tensor: str) -> object:
        if tensor not in self._layouts:
            source = self.source.tensor(tensor)
            if source.tensor_type in FLOAT_TYPES:
                self._layouts[tensor] = ("float", FLOAT_TYPES[source.tensor_type])
            else:
                self._layouts[tensor] = read_blocks(source.tensor_type, _raw_rows(source)[:1]).layout
        return self._layouts[tensor]

    def _parts(self, runs: list[Run], name: str) -> list[WeightRef]:
        """The rows of `runs` as consecutive groups of one layout each, keyed for sharing between nodes.

        A group that is one whole GGUF tensor in its own order is keyed by that tensor's name, so a tied embedding
        and lm_head read one copy of its blocks.
        """
        groups: list[list[Run]] = []
        for run in runs:
            if groups and self._layout(groups[-1][0].tensor) == self._layout(run.tensor):
                groups[-1].append(run)
            else:
                groups.append([run])
        parts = []
        for i, group in enumerate(groups):
            whole = len(group) == 1 and self._covers(group[0])
            key = f"gguf/{group[0].tensor}" if whole else (f"{name}/gguf" if len(groups) == 1 else f"{name}/gguf{i}")
            k = int(self.source.tensor(group[0].tensor).shape[0])
            rows = sum(run.count for run in group)
            parts.append(WeightRef(key, self._layout(group[0].tensor), (rows, k), _reader(self.source, group)))
        return parts

    def _covers(self, run: Run) -> bool:
        tensor = self.source.tensor(run.tensor)
        return run.start == 0 and run.step == 1 and run.count == _raw_rows(tensor).shape[0]

    def _emit_siblings(self, builder: GraphBuilder, group: list[_Match]) -> None:
        first = group[0].node
        name = f"{first.name}/siblings"
        sizes = [m.parts[0].shape[0] for m in group]
        k = group[0].parts[0].shape[1]
        runs = [run for m in group for run in m.runs]
        joined = WeightRef(name, group[0].layout, (sum(sizes), k), _reader(self.source, runs))
        builder.matmul_split(first.input[0], [m.node.output[0] for m in group], joined, sizes, name)
        offset = 0
        for match, size in zip(group, sizes, strict=True):
            self._record(match, name, offset)
            offset += size

    def _record(self, match: _Match, computed_by: str, first_row: int) -> None:
        self.report.carried[match.node.name] = {
            "weight": match.weight,
            "transposed": match.transposed,
            "computed_by": computed_by,
            "first_row": first_row,
            "runs": [run.to_json() for run in match.runs],
        }


def _raw_rows(tensor: Any) -> np.ndarray:
    """A GGUF tensor's raw rows: `[rows, bytes]` for block types, `[rows, K]` for float types (rows = ne[1:])."""
    data = np.asarray(tensor.data)
    return data.reshape(-1, data.shape[-1])


def _reader(source: GgufWeights, runs: list[Run]) -> Any:
    """Reads `runs`' rows of the GGUF (one layout) into one weight, when called."""

    def read() -> Weight:
        pieces: list[Weight] = []
        for run in runs:
            tensor = source.tensor(run.tensor)
            raw = _raw_rows(tensor)[run.indices()]
            if tensor.tensor_type in FLOAT_TYPES:
                stored = raw.view(np.uint16) if tensor.tensor_type == GGMLQuantizationType.BF16 else raw
                pieces.append(FloatWeight(np.array(stored), FLOAT_TYPES[tensor.tensor_type]))
            else:
                pieces.append(read_blocks(tensor.tensor_type, raw))
        source.release()  # the blocks are copied out: the mapped pages may go
        if len(pieces) == 1:
            return pieces[0]
        if isinstance(pieces[0], FloatWeight):
            return FloatWeight(np.concatenate([p.values for p in pieces]), pieces[0].data_type)
        return BlockWeight.concatenate(pieces)  # type: ignore[arg-type]

    return read


def _siblings(matches: Any) -> list[list[_Match]]:
    """MatMuls reading one input with weights of one layout (an MLP's gate and up projections): computed as one.

    One operator over their rows instead of two halves the residual nodes too: the gate/up pair ran ~9 % faster
    per decode step in the probe (shared/probes/gguf-exact).
    """
    by_input: dict[tuple[str, object], list[_Match]] = {}
    for match in matches:
        if match.node.op_type == "MatMul" and match.layout is not None:
            by_input.setdefault((match.node.input[0], match.layout), []).append(match)
    return [group for group in by_input.values() if len(group) > 1]


def _dead_nodes(graph: Any, matches: dict[str, _Match]) -> set[str]:
    """Nodes none of whose outputs anything reads once the matched nodes stop reading their weights."""
    weight_inputs = {(name, m.weight) for name, m in matches.items()}
    nodes = list(graph.node)
    dead: set[str] = set()
    while True:
        read = {o.name for o in graph.output}
        for node in nodes:
            if node.name in dead:
                continue
            for index, name in enumerate(node.input):
                carried_weight = (node.name, name) in weight_inputs or (
                    node.name in matches and node.op_type == "Gather" and index == 0
                )
                if not carried_weight:
                    read.add(name)
        newly = {n.name for n in nodes if n.name not in dead and n.output and not any(o in read for o in n.output)}
        if not newly:
            return dead
        dead |= newly


def _weight_of(node: NodeProto, weights: dict[str, Any], producers: dict[str, NodeProto]) -> tuple[str, bool] | None:
    """The recorded weight a MatMul multiplies by or a Gather looks up, and whether the node reads it transposed
    (a tied embedding's Gather reads lm_head's `[K, vocab]` weight through a Transpose); else None."""
    if node.op_type == "MatMul" and node.input[1] in weights and len(weights[node.input[1]]["shape"]) == 2:
        return node.input[1], False
    if node.op_type == "Gather" and node.input[0] in weights:
        return node.input[0], False
    if node.op_type == "Gather":
        transpose = producers.get(node.input[0])
        if transpose is not None and transpose.op_type == "Transpose" and transpose.input[0] in weights:
            return transpose.input[0], True
    return None
