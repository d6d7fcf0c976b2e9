"""Write an ONNX graph's weights into one external data file as they are made, page-aligned, tensors sharing bytes.

Each initializer is written the moment it is added and then forgotten (only its place in the file is kept), so
writing a model holds one tensor at a time, never the model. ONNX Runtime maps a page-aligned external tensor
from the file instead of reading it into the heap, and two initializers may point at the same bytes (a tied
embedding read by GatherBlockQuantized as `[vocab, K * bits / 8]` and by MatMulNBits as
`[vocab, blocks, block bytes]`), so neither is stored twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper

PAGE = 4096
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

    def discard(self) -> None:
        self._out.close()
