"""Run a decoder graph a few layers at a time over fixed token sequences, in memory bounded by those layers.

The graph is cut into segments along the builder's layer names (`/model/layers.N/...`; what comes before the
first layer, the embedding and the attention-mask preprocessing, is one segment, lm_head another), merged while
their weights stay under a budget. Each segment becomes a session of its own, runs every sequence (one forward
each, no KV cache: the sequences are teacher-forced), hands on the values later segments read, and is freed
before the next one is made. A segment's weights come from a `System`: an export's file mapped from disk, or a
precision's rewrite of the structure computed in memory (export/materialize.py) — the fp32 reference is never
whole, in memory or on disk.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx
import onnxruntime as ort
from onnx import NodeProto, TensorProto, helper

from packager.export.external_data import INLINE_LIMIT, external_tensor
from packager.export.graph import all_inputs
from packager.export.materialize import MemoryWeights, Structure
from packager.export.moe import QuantizedExperts, float_moe_nodes, qmoe_layout, unpack
from packager.mapped import release
from runtime.engine.heap import release_free_memory
from runtime.engine.recipes import ref_array, table_array
from runtime.engine.tables import TABLES_FILE, TABLES_RECIPE

_LAYER = re.compile(r"^/model/layers\.(\d+)/")
DEFAULT_BUDGET = 256 << 20  # bytes of weights per segment, beyond its largest layer
Progress = Callable[[int, int], None]
Keep = Callable[[int, np.ndarray], np.ndarray]  # (sequence index, its logits [S, vocab]) -> what to keep


class System(Protocol):
    """A graph whose weights can be had a segment at a time."""

    @property
    def name(self) -> str: ...

    @property
    def graph(self) -> onnx.GraphProto: ...

    @property
    def opsets(self) -> list[onnx.OperatorSetIdProto]: ...

    @property
    def prepack(self) -> bool:
        """Whether ONNX Runtime may pack the weights (a copy: worth it for block-quantized matmuls)."""
        ...

    def weight_bytes(self, node: NodeProto) -> int: ...

    def segment(self, nodes: list[NodeProto]) -> tuple[list[NodeProto], MemoryWeights]:
        """The nodes to run for these graph nodes, and their initializers."""
        ...

    def release(self) -> None:
        """Give back what the last segment mapped."""
        ...


class ExportSystem:
    """A written export (model.onnx + model.onnx.data): each segment's initializers mapped from the file.

    `accuracy_level`: run its MatMulNBits at this level instead of their own; at 0 a `gguf` export computes
    `x @ W` in float32 on the GGUF's own blocks, dequantized by ONNX Runtime: the fp32 model, made from the file
    without a float copy of any weight (the reference of a GGUF source). A Mixture-of-Experts layer's `QMoE` has
    no fp32 kernel for 8-bit experts: at 0 it runs as `MoE` on its experts dequantized here, one layer's at a time,
    or on `float_experts(packed weight name)` where that gives them (experts the carry re-quantized: the reference
    computes with the file's own values, not with their int8 copy).
    """

    def __init__(
        self,
        directory: Path,
        name: str,
        accuracy_level: int | None = None,
        float_experts: Callable[[str], np.ndarray | None] | None = None,
    ) -> None:
        self.name = name
        self.directory = directory
        self.accuracy_level = accuracy_level
        self.float_experts = float_experts
        self._maps: dict[str, np.memmap] = {}

    @cached_property
    def _model(self) -> onnx.ModelProto:
        return onnx.load(str(self.directory / "model.onnx"), load_external_data=False)

    @property
    def graph(self) -> onnx.GraphProto:
        return self._model.graph

    @property
    def opsets(self) -> list[onnx.OperatorSetIdProto]:
        return list(self._model.opset_import)

    @cached_property
    def prepack(self) -> bool:
        return any(n.op_type in ("MatMulNBits", "QMoE") for n in self.graph.node)

    @cached_property
    def _initializers(self) -> dict[str, TensorProto]:
        return {t.name: t for t in self.graph.initializer}

    def weight_bytes(self, node: NodeProto) -> int:
        return sum(_tensor_bytes(self._initializers[n]) for n in all_inputs(node) if n in self._initializers)

    def segment(self, nodes: list[NodeProto]) -> tuple[list[NodeProto], MemoryWeights]:
        weights = MemoryWeights()
        for name in {n for node in nodes for n in all_inputs(node)}:
            tensor = self._initializers.get(name)
            if tensor is not None:
                weights.add(name, self._array(tensor), tensor.data_type)
        if self.accuracy_level is not None:
            nodes = [_with_accuracy(node, self.accuracy_level) for node in nodes]
        if self.accuracy_level == 0:  # QMoE's 8-bit experts have no fp32 kernel: compute them dequantized
            nodes = [
                n
                for node in nodes
                for n in (_float_experts(node, weights, self.float_experts) if node.op_type == "QMoE" else [node])
            ]
            read = {name for node in nodes for name in all_inputs(node)}
            for name in [n for n in weights.arrays if n not in read]:  # the blocks the float experts replace
                del weights.arrays[name]
        return nodes, weights

    def release(self) -> None:
        for mapping in self._maps.values():
            release(mapping)

    @cached_property
    def _tables(self) -> dict[int, dict[str, object]]:
        """The tables recipe's entries by offset (an export ships factors, not tables: runtime/engine/tables.py)."""
        recipe = json.loads((self.directory / TABLES_RECIPE).read_text())
        return {int(entry["offset"]): entry["table"] for entry in recipe["tensors"]}

    def _array(self, tensor: TensorProto) -> np.ndarray:
        if tensor.data_location != TensorProto.EXTERNAL:
            return onnx.numpy_helper.to_array(tensor)
        info = {e.key: e.value for e in tensor.external_data}
        offset, length = int(info.get("offset", 0)), int(info["length"])
        if info["location"] == TABLES_FILE:  # expanded from its factors, as the runtime does
            return table_array(self._tables[offset], lambda ref: ref_array(ref, self._bytes, TABLES_RECIPE))
        return (
            self._bytes(info["location"], offset, length)
            .view(_numpy_dtype(tensor.data_type))
            .reshape(tuple(tensor.dims))
        )

    def _bytes(self, location: str, offset: int, length: int) -> np.ndarray:
        if location not in self._maps:
            self._maps[location] = np.memmap(self.directory / location, dtype=np.uint8, mode="r")
        return self._maps[location][offset : offset + length]


class StructureSystem:
    """A precision of the structure (fp32, int8, ...), each segment's weights computed in memory when run."""

    def __init__(self, structure: Structure, rewrite: object, name: str) -> None:
        self.name = name
        self.structure = structure
        self.rewrite = rewrite  # materialize.Float32 | BlockQuantized | gguf.carry.GgufCarry
        self.graph = structure.model.graph
        self.opsets = list(structure.model.opset_import)
        self.prepack = getattr(rewrite, "precision", "fp32") != "fp32"

    def weight_bytes(self, node: NodeProto) -> int:
        structure = self.structure
        return sum(structure.nbytes(n) for n in all_inputs(node) if structure.is_initializer(n))

    def segment(self, nodes: list[NodeProto]) -> tuple[list[NodeProto], MemoryWeights]:
        weights = MemoryWeights()
        rewritten = self.rewrite.nodes(nodes, weights)  # type: ignore[attr-defined]
        return rewritten, weights

    def release(self) -> None:
        source = self.rewrite.rewrite.source  # type: ignore[attr-defined]
        if hasattr(source, "release"):
            source.release()


@dataclass
class RunReport:
    """How a system's run went: time, segments and the largest segment's weights in memory."""

    seconds: float = 0.0
    segments: int = 0
    largest_segment_bytes: int = 0
    per_segment: list[tuple[str, float]] = field(default_factory=list)


def partition(system: System, budget: int = DEFAULT_BUDGET) -> list[list[NodeProto]]:
    """The graph's nodes in segments: whole layers (and the parts before and after them), merged under `budget`."""
    groups: list[tuple[str, list[NodeProto]]] = []
    seen_layer = False
    for node in system.graph.node:
        match = _LAYER.match(node.name)
        if match:
            key, seen_layer = f"layer{match.group(1)}", True
        else:
            key = "after" if seen_layer else "before"
        if groups and groups[-1][0] == key:
            groups[-1][1].append(node)
        else:
            groups.append((key, [node]))
    segments: list[list[NodeProto]] = []
    size = 0
    for _, nodes in groups:
        group_bytes = sum(system.weight_bytes(n) for n in nodes)
        if segments and size + group_bytes <= budget:
            segments[-1].extend(nodes)
            size += group_bytes
        else:
            segments.append(list(nodes))
            size = group_bytes
    return segments


def run_sequences(
    system: System,
    sequences: list[tuple[int, ...]],
    feeds: Callable[[tuple[int, ...]], dict[str, np.ndarray]],
    keep: Keep,
    *,
    threads: int = 2,
    budget: int = DEFAULT_BUDGET,
    progress: Progress | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> tuple[list[np.ndarray], RunReport]:
    """Each sequence's logits (what `keep` keeps of them), computed a segment at a time.

    `feeds(sequence)` gives the graph's inputs for one sequence (ids, mask, empty past); `extra`: inputs every
    sequence gets (a LoRA adapter's).
    """
    report = RunReport()
    started = time.perf_counter()
    segments = partition(system, budget)
    graph_outputs = {o.name for o in system.graph.output}
    logits_name = "logits"
    values: list[dict[str, np.ndarray]] = [{**feeds(s), **(extra or {})} for s in sequences]
    readers = _last_reader(segments)
    kept: list[np.ndarray] = [np.empty(0)] * len(sequences)
    for index, nodes in enumerate(segments):
        segment_started = time.perf_counter()
        run_nodes, weights = system.segment(nodes)
        report.largest_segment_bytes = max(report.largest_segment_bytes, weights.nbytes)
        produced = {o for node in run_nodes for o in node.output}
        inputs = sorted({n for node in run_nodes for n in all_inputs(node)} - produced - set(weights.arrays) - {""})
        later = {name for name, last in readers.items() if last > index}
        outputs = sorted(o for o in produced if o and (o in later or (o == logits_name and o in graph_outputs)))
        session = _session(system, run_nodes, weights, inputs, values[0], outputs, threads)
        for i, sequence_values in enumerate(values):
            results = session.run(outputs, {name: sequence_values[name] for name in inputs})
            for name, value in zip(outputs, results, strict=True):
                if name == logits_name:
                    kept[i] = keep(i, value[0])
                else:
                    sequence_values[name] = value
            for name in [n for n in sequence_values if readers.get(n, -1) <= index and n not in later]:
                del sequence_values[name]
        del session, weights
        system.release()
        report.per_segment.append((nodes[0].name, time.perf_counter() - segment_started))
        if progress is not None:
            progress(index + 1, len(segments))
    # glibc keeps what the sessions freed in its arenas (measured on the 8B shape: the parity step after the
    # reference peaked at 4.65 GB, 4.23 GB once handed back; the verify step after it 4.22 GB, then 1.97 GB). Once
    # per run, not per segment: a trim after every segment made the reference 15-35 % slower (fresh page faults).
    release_free_memory()
    report.segments = len(segments)
    report.seconds = time.perf_counter() - started
    return kept, report


def _float_experts(
    qmoe: NodeProto, weights: MemoryWeights, given: Callable[[str], np.ndarray | None] | None
) -> list[NodeProto]:
    """The MoE node computing with the QMoE node's experts in float32, as `given` has them or else dequantized
    (they replace the blocks in `weights`)."""
    bits, block = qmoe_layout(qmoe)
    names = []
    for packed_name, scales_name in ((qmoe.input[2], qmoe.input[3]), (qmoe.input[5], qmoe.input[6])):
        name = f"{packed_name}/fp32"
        if name not in weights:  # a layer's experts are read by each of its QMoE nodes (moe.qmoe_nodes)
            experts = given(packed_name) if given is not None else None
            if experts is None:
                values = unpack(weights.arrays[packed_name], bits)
                experts = QuantizedExperts(bits, block, values, weights.arrays[scales_name]).dequantize()
            weights.add(name, experts)
        names.append(name)
    return float_moe_nodes(qmoe, names[0], names[1])


def _with_accuracy(node: NodeProto, level: int) -> NodeProto:
    if node.op_type not in ("MatMulNBits", "QMoE"):
        return node
    copy = NodeProto()
    copy.CopyFrom(node)
    for attribute in copy.attribute:
        if attribute.name == "accuracy_level":
            attribute.i = level
            return copy
    copy.attribute.append(helper.make_attribute("accuracy_level", level))
    return copy


def _last_reader(segments: list[list[NodeProto]]) -> dict[str, int]:
    """Each value's last reading segment."""
    last: dict[str, int] = {}
    for index, nodes in enumerate(segments):
        for node in nodes:
            for name in all_inputs(node):
                last[name] = index
    return last


def _session(
    system: System,
    nodes: list[NodeProto],
    weights: MemoryWeights,
    inputs: list[str],
    sample: dict[str, np.ndarray],
    outputs: list[str],
    threads: int,
) -> ort.InferenceSession:
    declared = []
    shared: list[str] = []  # handed to ONNX Runtime as arrays; small ones (shapes, split sizes) stay in the graph
    for name, array in weights.arrays.items():
        data_type = weights.types.get(name, helper.np_dtype_to_tensor_dtype(array.dtype))
        if array.nbytes < INLINE_LIMIT:
            declared.append(TensorProto(name=name, data_type=data_type, dims=array.shape, raw_data=array.tobytes()))
        else:
            declared.append(external_tensor(name, data_type, array.shape, "memory", 0, array.nbytes))
            shared.append(name)
    inputs_info = [_value_info(name, sample[name]) for name in inputs]
    types = _element_types(system, nodes, inputs_info, declared, outputs)
    graph = helper.make_graph(
        nodes, "segment", inputs_info,
        [helper.make_tensor_value_info(name, types[name], None) for name in outputs],
        declared,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=system.opsets, ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not system.prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    values = [_ort_value(weights.arrays[n], weights.types.get(n)) for n in shared]
    if shared:
        options.add_external_initializers(shared, values)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _ort_value(array: np.ndarray, data_type: int | None) -> ort.OrtValue:
    """The array as ONNX Runtime's value, sharing its memory (a bfloat16 weight's bits come as uint16)."""
    array = np.ascontiguousarray(array)
    if data_type is not None and data_type != helper.np_dtype_to_tensor_dtype(array.dtype):
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, data_type)
    return ort.OrtValue.ortvalue_from_numpy(array)


def _element_types(
    system: System,
    nodes: list[NodeProto],
    inputs: list[onnx.ValueInfoProto],
    declared: list[TensorProto],
    outputs: list[str],
) -> dict[str, int]:
    """Each output's element type: as the builder recorded it (it types every value it makes), else as ONNX's
    shape inference finds it in the segment (nodes added after the builder: adapter masks), else float32."""
    graph = system.graph
    known = {
        info.name: int(info.type.tensor_type.elem_type)
        for info in (*graph.value_info, *graph.output, *graph.input)
        if info.type.tensor_type.elem_type
    }
    missing = [name for name in outputs if name not in known]
    if missing:
        probe = helper.make_graph(nodes, "probe", inputs, [], declared)
        inferred = onnx.shape_inference.infer_shapes(helper.make_model(probe, opset_imports=system.opsets))
        for info in inferred.graph.value_info:
            if info.name in missing and info.type.tensor_type.elem_type:
                known[info.name] = int(info.type.tensor_type.elem_type)
    return {name: known.get(name, TensorProto.FLOAT) for name in outputs}


def _value_info(name: str, array: np.ndarray) -> onnx.ValueInfoProto:
    dims = [f"{name}_{i}" for i in range(array.ndim)]
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), dims)


def _tensor_bytes(tensor: TensorProto) -> int:
    return int(np.prod(tensor.dims)) * np.dtype(_numpy_dtype(tensor.data_type)).itemsize


def _numpy_dtype(data_type: int) -> np.dtype:
    if data_type == TensorProto.BFLOAT16:
        return np.dtype(np.uint16)
    return np.dtype(helper.tensor_dtype_to_np_dtype(data_type))
