"""A precision's graph made from the structure, weight by weight, into a file (the export) or into memory.

The structure (structure.py) is the builder's fp32 graph with its weights as recipes. Each precision rewrites
its nodes and computes their initializers one at a time:
- `fp32`: the nodes as they are; each weight is its recipe evaluated on the source;
- `int8`, `int4`: every MatMul on a 2-D weight becomes MatMulNBits, its weight quantized by ONNX Runtime's own
  block quantizer (the call the builder's `MatMulNBitsQuantizer` makes, symmetric, the same node and
  initializer names), so the graph is the builder's int8/int4 graph, made with one weight in memory; a
  Mixture-of-Experts layer's `MoE` becomes `QMoE`, its experts quantized with the same quantizer (moe.py);
- `gguf`: the GGUF's own blocks carried into MatMulNBits / GatherBlockQuantized (gguf/carry.py).

The same rewrite serves a whole graph written to disk (`WeightFile`) and a few layers computed in memory for
verification (`MemoryWeights`, verify/segments.py), so what is verified is exactly what is shipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
from onnx import NodeProto, TensorProto, helper, numpy_helper

from packager.export.lazy import Recipe, evaluate, from_json, leaves
from packager.export.moe import FC1, FC1_BIAS, FC2, FC2_BIAS, qmoe_nodes, quantize_experts
from packager.export.rotary import table_for
from packager.sources.weights import WeightSource, load_any

MS_DOMAIN = "com.microsoft"
STRUCTURE_FILE = "structure.onnx"  # the builder's graph without the weights it was given (structure.py)
RECIPES_FILE = "weights.json"  # each of those weights' dtype, shape and recipe
_TORCH_TO_ONNX = {"FLOAT": TensorProto.FLOAT, "FLOAT16": TensorProto.FLOAT16, "BFLOAT16": TensorProto.BFLOAT16}


class Sink(Protocol):
    """Where a rewrite puts initializers: `WeightFile` (external data on disk) or `MemoryWeights`."""

    def add(self, name: str, array: np.ndarray, data_type: int | None = None) -> str: ...

    def alias(self, name: str, of: str, dims: tuple[int, ...]) -> str: ...

    def add_table(self, name: str, array: np.ndarray, rule: dict[str, Any], factors: dict[str, np.ndarray]) -> str:
        """A float32 table (scales, a residual) the runtime may expand from `factors` by `rule`, which names them
        (runtime/engine/derived.py's `table_array`); `array` is what it expands to."""
        ...

    def __contains__(self, name: str) -> bool: ...


@dataclass
class MemoryWeights:
    """Initializers kept as arrays (a segment's, for one verification session)."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    types: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, array: np.ndarray, data_type: int | None = None) -> str:
        if name in self.arrays:
            raise ValueError(f"initializer {name!r} added twice")
        self.arrays[name] = np.ascontiguousarray(array)
        if data_type is not None:
            self.types[name] = data_type
        return name

    def alias(self, name: str, of: str, dims: tuple[int, ...]) -> str:
        self.arrays[name] = self.arrays[of].reshape(dims)
        if of in self.types:
            self.types[name] = self.types[of]
        return name

    def add_table(self, name: str, array: np.ndarray, rule: dict[str, Any], factors: dict[str, np.ndarray]) -> str:
        return self.add(name, array)  # a session in memory takes the table itself

    def __contains__(self, name: str) -> bool:
        return name in self.arrays

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


class Structure:
    """An exported structure folder: the graph without its recorded weights, and each weight's recipe."""

    def __init__(self, directory: Path, model: onnx.ModelProto | None = None) -> None:
        """`model`: the graph to use instead of the folder's own (the same graph given LoRA adapter inputs)."""
        self.directory = directory
        self.graph_path = directory / STRUCTURE_FILE
        self._model = model

    @cached_property
    def model(self) -> onnx.ModelProto:
        return self._model if self._model is not None else onnx.load(str(self.graph_path), load_external_data=False)

    @cached_property
    def _recipe_data(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.directory / RECIPES_FILE).read_text())
        return data

    @cached_property
    def recipes(self) -> dict[str, Recipe]:
        return from_json(self._recipe_data)

    @property
    def weights(self) -> dict[str, dict[str, Any]]:
        """Each recorded weight's `{"dtype", "shape"}`."""
        return self._recipe_data["initializers"]  # type: ignore[no-any-return]

    @cached_property
    def builder_initializers(self) -> dict[str, TensorProto]:
        """The initializers the builder computed itself (rotary tables, constants): small, stored in the structure."""
        return {t.name: t for t in self.model.graph.initializer}

    def builder_array(self, name: str) -> np.ndarray:
        return numpy_helper.to_array(self.builder_initializers[name], base_dir=str(self.directory))

    def nbytes(self, name: str) -> int:
        """An initializer's size in float32 (a recorded weight's, or the builder's own)."""
        if name in self.weights:
            return 4 * int(np.prod(self.weights[name]["shape"]))
        tensor = self.builder_initializers[name]
        return 4 * int(np.prod(tensor.dims))

    def is_initializer(self, name: str) -> bool:
        return name in self.weights or name in self.builder_initializers

    def max_positions_inputs(self) -> set[str]:
        """The rotary tables (GroupQueryAttention's cos/sin caches, one row per position)."""
        return {
            n.input[i] for n in self.model.graph.node if n.op_type == "GroupQueryAttention" for i in (7, 8)
            if len(n.input) > i and n.input[i]
        }  # fmt: skip


@dataclass
class Rewrite:
    """What every precision shares: the structure, the weights' source and how to add initializers."""

    structure: Structure
    source: WeightSource
    max_positions: int

    def weight(self, name: str) -> np.ndarray:
        """The recorded weight `name` computed from the source (float32 unless its recipe says otherwise)."""
        recipe = self.structure.recipes[name]
        value = evaluate(recipe, lambda leaf: self._leaf(recipe, leaf))
        wanted = self.structure.weights[name]["dtype"]
        if wanted == "FLOAT":
            return value.float().numpy()
        import torch

        dtype = {"FLOAT16": torch.float16, "BFLOAT16": torch.bfloat16}[wanted]
        converted = value.to(dtype)
        return converted.view(torch.uint16).numpy() if wanted == "BFLOAT16" else converted.numpy()

    def _leaf(self, recipe: Recipe, leaf: str) -> Any:
        aliases = next((n.aliases for n in _leaf_nodes(recipe) if n.leaf == leaf), ())
        return load_any(self.source, [leaf, *aliases])

    def add_input(self, name: str, sink: Sink) -> None:
        """Put the initializer `name` (a recorded weight or the builder's own) into `sink`, once."""
        if name in sink or not self.structure.is_initializer(name):
            return
        if name in self.structure.weights:
            dtype = _TORCH_TO_ONNX[self.structure.weights[name]["dtype"]]
            sink.add(name, self.weight(name), None if dtype == TensorProto.FLOAT else dtype)
            return
        if name in self.structure.max_positions_inputs():  # the tables cover the model's whole context
            names = set(self.structure.builder_initializers)
            array = table_for(name, self.max_positions, self.structure.builder_array, names)
        else:
            array = self.structure.builder_array(name)
        tensor = self.structure.builder_initializers[name]
        sink.add(name, array, tensor.data_type if tensor.data_type == TensorProto.BFLOAT16 else None)

    def add_inputs(self, nodes: Iterable[NodeProto], sink: Sink) -> None:
        for node in nodes:
            for name in node.input:
                self.add_input(name, sink)
            for attribute in node.attribute:  # subgraphs (an If picking long or short rotary tables)
                for graph in [attribute.g, *attribute.graphs]:
                    self.add_inputs(graph.node, sink)


def _leaf_nodes(recipe: Recipe) -> Iterable[Recipe]:
    return leaves(recipe)


class Float32:
    """The builder's fp32 graph: nodes unchanged, every weight computed from its recipe."""

    precision = "fp32"

    def __init__(self, rewrite: Rewrite) -> None:
        self.rewrite = rewrite

    def nodes(self, nodes: list[NodeProto], sink: Sink) -> list[NodeProto]:
        self.rewrite.add_inputs(nodes, sink)
        return nodes


def _transposed_weight(node: NodeProto, structure: Structure) -> bool:
    if node.op_type != "Transpose" or node.input[0] not in structure.weights:
        return False
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
    return len(structure.weights[node.input[0]]["shape"]) == 2 and perm == [1, 0]


class BlockQuantized:
    """int8 / int4: every MatMul with a 2-D weight as MatMulNBits, quantized per tensor as the builder does."""

    def __init__(self, rewrite: Rewrite, bits: int, block_size: int, accuracy_level: int) -> None:
        self.rewrite = rewrite
        self.precision = f"int{bits}"
        self.bits = bits
        self.block_size = block_size
        self.accuracy_level = accuracy_level

    def nodes(self, nodes: list[NodeProto], sink: Sink) -> list[NodeProto]:
        structure = self.rewrite.structure
        out: list[NodeProto] = []
        for node in nodes:
            if _transposed_weight(node, structure):
                # A tied embedding's table, read through a Transpose of lm_head's weight: once that weight is
                # quantized, the table is its own float32 initializer (as the builder's int graphs have it).
                if node.output[0] not in sink:
                    sink.add(node.output[0], np.ascontiguousarray(self.rewrite.weight(node.input[0]).T))
                continue
            if node.op_type == "MoE" and self._experts_fit(node):
                out.extend(self._quantized_experts(node, sink))
                continue
            weight = node.input[1] if node.op_type == "MatMul" and len(node.input) > 1 else None
            if weight is None or weight not in structure.weights or len(structure.weights[weight]["shape"]) != 2:
                self.rewrite.add_inputs([node], sink)
                out.append(node)
                continue
            self.rewrite.add_input(node.input[0], sink)
            out.append(self._quantized(node, weight, sink))
        return out

    def _experts_fit(self, node: NodeProto) -> bool:
        """Whether both expert weights are recorded and their rows split into whole blocks (QMoE needs that)."""
        weights = self.rewrite.structure.weights
        names = [node.input[FC1], node.input[FC2]]
        return all(n in weights and weights[n]["shape"][-1] % self.block_size == 0 for n in names)

    def _quantized_experts(self, node: NodeProto, sink: Sink) -> list[NodeProto]:
        """A Mixture-of-Experts layer as QMoE, each expert quantized as the builder's CPU path does (moe.py)."""
        names = []
        for index in (FC1, FC2):
            weight = node.input[index]
            base = weight.removesuffix(".weight")
            names.append((f"{base}.qweight", f"{base}.scales"))
            if names[-1][0] not in sink:
                experts = quantize_experts(self.rewrite.weight(weight), self.bits, self.block_size)
                sink.add(names[-1][0], experts.packed())
                sink.add(names[-1][1], experts.scales)
                del experts
        for index in (0, FC1_BIAS, FC2_BIAS):
            self.rewrite.add_input(node.input[index], sink)
        return qmoe_nodes(node, names[0], names[1], self.bits, self.block_size, self.accuracy_level)

    def _quantized(self, node: NodeProto, weight: str, sink: Sink) -> NodeProto:
        from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

        k, n = self.rewrite.structure.weights[weight]["shape"]
        blocks = (k + self.block_size - 1) // self.block_size
        packed_name, scales_name = f"{weight}_Q{self.bits}", f"{weight}_scales"
        if packed_name not in sink:
            values = self.rewrite.weight(weight)
            if blocks * self.block_size != k:
                values = np.pad(values, ((0, blocks * self.block_size - k), (0, 0)))
            blob = (self.block_size * self.bits + 7) // 8
            packed = np.zeros((n, blocks, blob), np.uint8)
            scales = np.zeros((n, blocks), np.float32)
            zero_points = np.zeros((n, (blocks * self.bits + 7) // 8), np.uint8)
            quantize = quantize_matmul_8bits if self.bits == 8 else quantize_matmul_4bits
            quantize(packed, np.ascontiguousarray(values), scales, zero_points, self.block_size, n, k, True)
            del values
            sink.add(packed_name, packed)
            sink.add(scales_name, scales)
        attributes: dict[str, Any] = {"K": k, "N": n, "bits": self.bits, "block_size": self.block_size}
        if self.accuracy_level:
            attributes["accuracy_level"] = self.accuracy_level
        return helper.make_node(
            "MatMulNBits", [node.input[0], packed_name, scales_name], list(node.output),
            name=f"{node.name}_Q{self.bits}", domain=MS_DOMAIN, **attributes,
        )  # fmt: skip
