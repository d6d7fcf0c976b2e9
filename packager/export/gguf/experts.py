"""Precision `gguf` for Mixture-of-Experts layers: a GGUF's expert blocks carried into ONNX Runtime's `QMoE`.

Each expert weight of the structure's `MoE` node (moe.py) is, by its recipe, a leaf with its last two axes swapped
or not and its rows maybe reordered (recipe_rows.leaf_rows); the source says which GGUF expert rows that leaf holds
(sources/gguf_experts.py); so every row of every expert is a named row of the file, carried without computing
anything, like a 2-D weight (carry.py). QMoE holds a projection as MatMulNBits holds a matrix, but with no zero
points per block that the kernel can add a residual to and one block size and width for both projections, so:
- symmetric types (Q4_0, Q5_0, Q8_0, Q3_K, Q6_K, MXFP4: `w = d * (q - center)`) are carried exactly; both
  projections take the wider container (a 4-bit value fits an 8-bit one) and the smaller block (a block of 32 is
  two of 16 with one scale). MXFP4 (every published gpt-oss GGUF's experts) needs the 8-bit container: its e2m1
  values doubled are the integers -12..12, which no evenly spaced 4-bit grid holds; QMoE's own MXFP4 mode has no
  CPU kernel in ONNX Runtime 1.31.
- types with a block minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) and float rows among quantized ones are
  re-quantized to int8 blocks of the other projection's size (32 by default) with ONNX Runtime's quantizer, from
  the dequantized rows; the report gives each such projection's relative RMS error, and the build's fp32
  reference computes them with the file's own values (build._reference), so the quality check measures the loss.
  (The 2-D carry keeps those types exactly with a residual term after MatMulNBits; inside QMoE there is no place
  for it.)
- experts that are all float (F32, F16, BF16) stay the fp32 `MoE` the structure has.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from onnx import NodeProto

from packager.export.gguf.blocks import BlockWeight, read_blocks
from packager.export.materialize import Rewrite, Sink
from packager.export.moe import FC1, FC1_BIAS, FC2, FC2_BIAS, QuantizedExperts, qmoe_nodes, quantize_experts
from packager.export.recipe_rows import leaf_rows
from packager.sources.weights import GgufWeights

Q = GGMLQuantizationType
EXACT_TYPES = (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q3_K, Q.Q6_K, Q.MXFP4)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
REQUANTIZED_BITS = 8
DEFAULT_BLOCK = 32


@dataclass(frozen=True)
class _Rows:
    """A projection's rows as GGUF rows: weight row n of expert e is row `e * counts[p] + row[n]` of `parts[p]`,
    p = `part[n]`."""

    weight: str
    parts: tuple[str, ...]
    counts: tuple[int, ...]  # rows per expert of each part
    part: np.ndarray
    row: np.ndarray
    types: tuple[GGMLQuantizationType, ...]

    @property
    def exact(self) -> bool:
        return all(t in EXACT_TYPES for t in self.types)

    @property
    def all_float(self) -> bool:
        return all(t in FLOAT_TYPES for t in self.types)


class ExpertCarry:
    """Rewrites the structure's MoE nodes for precision `gguf` (called by carry.GgufCarry)."""

    def __init__(self, rewrite: Rewrite, source: GgufWeights, accuracy_level: int) -> None:
        self.rewrite = rewrite
        self.source = source
        self.accuracy_level = accuracy_level
        self.report: dict[str, dict[str, Any]] = {}  # MoE node -> what became of each projection
        self.tensors: dict[str, str] = {}  # GGUF tensor carried -> its type

    def nodes(self, node: NodeProto, sink: Sink) -> list[NodeProto]:
        rows = [self._rows(node.input[index]) for index in (FC1, FC2)]
        if any(r is None for r in rows) or all(r.all_float for r in rows):  # type: ignore[union-attr]
            why = "its experts are float in the file" if all(rows) else "its experts are not rows of GGUF tensors"
            self.report[node.name] = {"kept": "MoE (fp32)", "why": why}
            self.rewrite.add_inputs([node], sink)
            return [node]
        exact = [r for r in rows if r is not None and r.exact]
        bits = max([self._container(r) for r in exact] + ([REQUANTIZED_BITS] if len(exact) < 2 else []))
        block = min([self._block(r) for r in exact], default=DEFAULT_BLOCK)
        names = []
        entry: dict[str, Any] = {}
        for key, found in zip(("fc1", "fc2"), rows, strict=True):
            assert found is not None
            experts, facts = self._exact(found, bits, block) if found.exact else self._requantized(found, block)
            base = found.weight.removesuffix(".weight")
            names.append((_packed_name(found.weight), f"{base}.scales"))
            if names[-1][0] not in sink:
                sink.add(names[-1][0], experts.packed())
                sink.add(names[-1][1], experts.scales)
            entry[key] = {"weight": found.weight, **facts}
            del experts
        entry |= {"bits": bits, "block_size": block}
        self.report[node.name] = entry
        for index in (0, FC1_BIAS, FC2_BIAS):
            self.rewrite.add_input(node.input[index], sink)
        return qmoe_nodes(node, names[0], names[1], bits, block, self.accuracy_level)

    def _rows(self, weight: str) -> _Rows | None:
        structure = self.rewrite.structure
        if weight not in structure.recipes or len(structure.weights[weight]["shape"]) != 3:
            return None
        found = leaf_rows(structure.recipes[weight])
        if found is None:
            return None
        leaf = found.leaf
        composite = next(
            (c for c in (self.source.experts(n) for n in (leaf.leaf, *leaf.aliases) if n) if c is not None), None
        )
        if composite is None or composite.columns != found.swapped:
            return None  # the weight's rows would be the file's columns
        tensors = [self.source.tensor(part) for part in composite.parts]
        counts = tuple(int(np.asarray(t.data).shape[1]) for t in tensors)
        part, row = composite.rows(list(counts))
        if found.order is not None:  # the structure reorders the leaf's rows (gate and up interleaved)
            part, row = part[found.order], row[found.order]
        for part_name, tensor in zip(composite.parts, tensors, strict=True):
            self.tensors[part_name] = tensor.tensor_type.name
        return _Rows(weight, composite.parts, counts, part, row, tuple(t.tensor_type for t in tensors))

    def _container(self, rows: _Rows) -> int:
        return max(self._first_block(rows, p).bits for p in range(len(rows.parts)))

    def _block(self, rows: _Rows) -> int:
        return min(self._first_block(rows, p).block_size for p in range(len(rows.parts)))

    def _first_block(self, rows: _Rows, index: int) -> BlockWeight:
        tensor = self.source.tensor(rows.parts[index])
        return read_blocks(tensor.tensor_type, _expert_rows(tensor, 0, np.arange(1)))

    def _exact(self, rows: _Rows, bits: int, block: int) -> tuple[QuantizedExperts, dict[str, Any]]:
        """Every expert's rows read from the file's blocks, in `bits`-wide values with blocks of `block`."""
        values: np.ndarray | None = None
        scales: np.ndarray | None = None
        for expert, experts, parts in self._each_expert(rows):
            for chosen, kind, raw in parts:
                weight = _widened(read_blocks(kind, raw), bits, block)
                if values is None or scales is None:
                    k = weight.values.shape[1]
                    values = np.empty((experts, len(rows.part), k), np.uint8)
                    scales = np.empty((experts, len(rows.part), k // block), np.float32)
                values[expert, chosen] = weight.values
                scales[expert, chosen] = weight.scales
        assert values is not None and scales is not None
        return QuantizedExperts(bits, block, values, scales), {
            "carried": "exact",
            "tensors": {p: t.name for p, t in zip(rows.parts, rows.types, strict=True)},
        }

    def _requantized(self, rows: _Rows, block: int) -> tuple[QuantizedExperts, dict[str, Any]]:
        """The rows dequantized and quantized to int8 blocks, one expert at a time (a Qwen3-30B-A3B layer's gate and
        up experts are 1.6 GB in float32: whole, with the copies around them, they took 8.4 GB)."""
        from gguf.quants import dequantize

        values: np.ndarray | None = None
        scales: np.ndarray | None = None
        squared_error = squared_total = 0.0
        for expert, experts, parts in self._each_expert(rows):
            weight: np.ndarray | None = None
            for chosen, kind, raw in parts:
                part = dequantize(raw, kind)
                if weight is None:
                    weight = np.empty((len(rows.part), part.shape[-1]), np.float32)
                weight[chosen] = part
            assert weight is not None
            one = quantize_experts(weight[None], REQUANTIZED_BITS, block)
            if values is None or scales is None:
                values = np.empty((experts, *one.values.shape[1:]), np.uint8)
                scales = np.empty((experts, *one.scales.shape[1:]), np.float32)
            values[expert], scales[expert] = one.values[0], one.scales[0]
            squared_error += float(np.sum((one.dequantize()[0] - weight).astype(np.float64) ** 2))
            squared_total += float(np.sum(weight.astype(np.float64) ** 2))
        assert values is not None and scales is not None
        return QuantizedExperts(REQUANTIZED_BITS, block, values, scales), {
            "carried": f"re-quantized to int{REQUANTIZED_BITS}, blocks of {block}",
            "tensors": {p: t.name for p, t in zip(rows.parts, rows.types, strict=True)},
            "relative_rms_error": (squared_error / max(squared_total, 1e-60)) ** 0.5,
        }

    def _each_expert(
        self, rows: _Rows
    ) -> Iterator[tuple[int, int, list[tuple[np.ndarray, GGMLQuantizationType, np.ndarray]]]]:
        """`(expert, experts, parts)` for each expert: per GGUF part, which of the weight's rows it gives, its type
        and those rows' raw blocks; the mapped pages read are given back after each expert."""
        tensors = [self.source.tensor(part) for part in rows.parts]
        experts = int(np.asarray(tensors[0].data).shape[0])
        for expert in range(experts):
            parts = []
            for index, tensor in enumerate(tensors):
                chosen = np.flatnonzero(rows.part == index)
                parts.append((chosen, tensor.tensor_type, _expert_rows(tensor, expert, rows.row[chosen])))
            yield expert, experts, parts
            self.source.release()


def requantized_experts(carry_report: dict[str, Any]) -> dict[str, str]:
    """From a carry report (gguf-weights.json): each re-quantized projection's QMoE weight -> the structure's weight
    it was made from (whose recipe computes the file's own values)."""
    found = {}
    for entry in carry_report.get("experts", {}).values():
        for key in ("fc1", "fc2"):
            projection = entry.get(key, {})
            if str(projection.get("carried", "")).startswith("re-quantized"):
                found[_packed_name(projection["weight"])] = projection["weight"]
    return found


def _packed_name(weight: str) -> str:
    return f"{weight.removesuffix('.weight')}.qweight"


def _expert_rows(tensor: Any, expert: int, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` of expert `expert` of a 3-D GGUF tensor, as raw bytes `[rows, bytes]`."""
    data = np.asarray(tensor.data)
    return np.ascontiguousarray(data[expert][rows])


def _widened(weight: BlockWeight, bits: int, block: int) -> BlockWeight:
    """The same weights in a `bits`-wide container with blocks of `block` (a divisor of the weight's own)."""
    if weight.zero_points is not None or weight.residual is not None:
        raise ValueError("only symmetric blocks are carried into QMoE")
    values = weight.values
    if bits != weight.bits:
        values = (values.astype(np.int16) + ((1 << (bits - 1)) - (1 << (weight.bits - 1)))).astype(np.uint8)
    scales = np.repeat(weight.scales, weight.block_size // block, axis=1)
    return BlockWeight(bits, block, values, scales, None, None)
