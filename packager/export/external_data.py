"""Write an ONNX graph's weights into one external data file as they are made, page-aligned, tensors sharing bytes.

Each initializer is written the moment it is added and then forgotten (only its place in the file is kept), so
writing a model holds one tensor at a time, never the model. ONNX Runtime maps a page-aligned external tensor
from the file instead of reading it into the heap, and two initializers may point at the same bytes (a tied
embedding read by GatherBlockQuantized as `[vocab, K * bits / 8]` and by MatMulNBits as
`[vocab, blocks, block bytes]`), so neither is stored twice.

A GGUF weight's float32 scale tables are not written at all: the file holds the GGUF's own factors they are made
of, and `model.onnx.tables.json` the recipe the runtime expands them by (runtime/engine/tables.py). Each table is
checked here against the runtime's expansion of those factors, bit for bit, and the recipe records the sha256 of
the tables file, which the bundle step and the runtime check again.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper

from runtime.engine.recipes import table_array
from runtime.engine.tables import TABLES_FILE, TABLES_RECIPE

PAGE = 4096
_TABLE_ALIGN = 64  # a table's start in the tables file (float32 arrays over a map need 4; a cache line)
INLINE_LIMIT = 1024  # smaller tensors stay inside the graph file
_CHUNK = 64 << 20  # bytes written per call: a view of the array, never a copy of all of it


def external_tensor(
    name: str, data_type: int, dims: tuple[int, ...], location: str, offset: int, length: int
) -> TensorProto:
    tensor = TensorProto(name=name, data_type=data_type, dims=list(dims))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def write_array(out: BinaryIO, array: np.ndarray) -> None:
    """`array`'s bytes in C order, in chunks (a `tobytes()` of a multi-GB tensor would double it in memory)."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    for start in range(0, flat.size, _CHUNK):
        out.write(flat[start : start + _CHUNK].data)


class WeightFile:
    """The initializers of the graph to be saved at `graph_path`, written to `graph_path.data` as they are added."""

    def __init__(self, graph_path: Path) -> None:
        self.graph_path = graph_path
        self.location = graph_path.name + ".data"
        self._out = (graph_path.parent / self.location).open("wb")
        self._offset = 0
        self._tensors: dict[str, TensorProto] = {}  # name -> its proto: external (offset, length) or inline
        self._sizes: dict[str, int] = {}  # name -> element count
        self._raw: dict[str, dict[str, Any]] = {}  # a table's factor -> where it is in the data file
        self._tables: list[dict[str, Any]] = []  # the tables recipe's tensors
        self._tables_size = 0
        self._tables_digest = hashlib.sha256()  # of the tables file the recipe makes
        self.bytes_written = 0

    def add(self, name: str, array: np.ndarray, data_type: int | None = None) -> str:
        """`data_type`: the TensorProto type of the bytes when it is not `array`'s own (BFLOAT16 in uint16)."""
        if name in self._tensors:
            raise ValueError(f"initializer {name!r} added twice")
        data_type = data_type if data_type is not None else helper.np_dtype_to_tensor_dtype(array.dtype)
        if array.nbytes < INLINE_LIMIT:
            proto = TensorProto(name=name, data_type=data_type, dims=array.shape, raw_data=array.tobytes())
        else:
            if array.nbytes >= PAGE:
                padding = -self._offset % PAGE
                self._out.write(b"\0" * padding)
                self._offset += padding
            proto = external_tensor(name, data_type, array.shape, self.location, self._offset, array.nbytes)
            write_array(self._out, array)
            self._offset += array.nbytes
            self.bytes_written += array.nbytes
        self._tensors[name] = proto
        self._sizes[name] = int(array.size)
        return name

    def add_table(self, name: str, array: np.ndarray, rule: dict[str, Any], factors: dict[str, np.ndarray]) -> str:
        """The float32 table `array`, stored as `factors` (those not in the file yet are written) and the `rule` that
        expands them, which names them; a table under `INLINE_LIMIT` stays inside the graph as it is."""
        if name in self._tensors:
            raise ValueError(f"initializer {name!r} added twice")
        array = np.ascontiguousarray(array, np.float32)
        if array.nbytes < INLINE_LIMIT:
            return self.add(name, array)
        expanded = table_array(rule, lambda factor: factors[factor])
        if expanded.shape != array.shape or not np.array_equal(expanded.view(np.uint32), array.view(np.uint32)):
            raise ValueError(f"{name}: the runtime's expansion of its factors is not the table the export holds")
        refs = {factor: self._factor_ref(factor, values) for factor, values in factors.items()}
        offset = self._tables_size + (-self._tables_size % _TABLE_ALIGN)
        self._tables_digest.update(bytes(offset - self._tables_size))
        self._tables_digest.update(array.reshape(-1).view(np.uint8).data)
        self._tables_size = offset + array.nbytes
        self._tables.append({"name": name, "offset": offset, "shape": list(array.shape), "table": _named(rule, refs)})
        self._tensors[name] = external_tensor(name, TensorProto.FLOAT, array.shape, TABLES_FILE, offset, array.nbytes)
        self._sizes[name] = int(array.size)
        return name

    def _factor_ref(self, name: str, values: np.ndarray) -> dict[str, Any]:
        """Where factor `name` is: an initializer already written (zero points), or bytes of the data file."""
        values = np.ascontiguousarray(values)
        described = {"dtype": values.dtype.str, "shape": list(values.shape)}
        tensor = self._tensors.get(name)
        if tensor is not None and tensor.data_location != TensorProto.EXTERNAL:
            return {"inline": base64.b64encode(tensor.raw_data).decode(), **described}
        if tensor is not None:
            info = {e.key: e.value for e in tensor.external_data}
            return {"file": self.location, "offset": int(info["offset"]), **described}
        if name not in self._raw:
            padding = -self._offset % _TABLE_ALIGN
            self._out.write(b"\0" * padding)
            self._offset += padding
            self._raw[name] = {"file": self.location, "offset": self._offset, **described}
            write_array(self._out, values)
            self._offset += values.nbytes
            self.bytes_written += values.nbytes
        return self._raw[name]

    def alias(self, name: str, of: str, dims: tuple[int, ...]) -> str:
        """`name` reads the bytes of `of` with other (same-sized) dims."""
        if int(np.prod(dims)) != self._sizes[of]:
            raise ValueError(f"{name!r}: dims {dims} do not cover {of!r}'s {self._sizes[of]} elements")
        alias = TensorProto()
        alias.CopyFrom(self._tensors[of])
        alias.name = name
        del alias.dims[:]
        alias.dims.extend(dims)
        self._tensors[name] = alias
        self._sizes[name] = self._sizes[of]
        return name

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def save(self, model: onnx.ModelProto) -> None:
        """Close the data file and write `model` with the added initializers (replacing its own) at `graph_path`."""
        self._out.close()
        del model.graph.initializer[:]
        model.graph.initializer.extend(self._tensors.values())
        onnx.save(model, str(self.graph_path))
        if self._tables:
            self._tables_digest.update(bytes(-self._tables_size % _TABLE_ALIGN))
            size = self._tables_size + (-self._tables_size % _TABLE_ALIGN)
            recipe = {"format": 1, "data": TABLES_FILE, "size": size, "sha256": self._tables_digest.hexdigest()}
            (self.graph_path.parent / TABLES_RECIPE).write_text(json.dumps({**recipe, "tensors": self._tables}) + "\n")

    def discard(self) -> None:
        self._out.close()


def _named(rule: Any, refs: dict[str, dict[str, Any]]) -> Any:
    """`rule` with each factor name replaced by where that factor is."""
    if isinstance(rule, dict):
        return {key: _named(value, refs) for key, value in rule.items()}
    return refs.get(rule, rule) if isinstance(rule, str) else rule
