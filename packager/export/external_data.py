"""Save an ONNX graph with its weights in one external data file, page-aligned, and tensors that share bytes.

ONNX Runtime maps a page-aligned external tensor from the file instead of reading it into the heap, and
two initializers may point at the same bytes (a tied embedding read by GatherBlockQuantized as
`[vocab, K * bits / 8]` and by MatMulNBits as `[vocab, blocks, block bytes]`), so neither is stored twice.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

PAGE = 4096
INLINE_LIMIT = 1024  # smaller tensors stay inside the graph file


def external_tensor(
    name: str, data_type: int, dims: tuple[int, ...], location: str, offset: int, length: int
) -> TensorProto:
    tensor = TensorProto(name=name, data_type=data_type, dims=list(dims))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


class WeightFile:
    """Collects a graph's initializers as arrays, then writes them to `<graph>.data` and the graph beside it."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._types: dict[str, int] = {}  # data types numpy has no dtype for (bfloat16, stored as uint16 bits)
        self._aliases: dict[str, tuple[str, tuple[int, ...]]] = {}  # name -> (array name, its dims)

    def add(self, name: str, array: np.ndarray, data_type: int | None = None) -> str:
        """`data_type`: the TensorProto type of the bytes when it is not `array`'s own (BFLOAT16 in uint16)."""
        if name in self._arrays or name in self._aliases:
            raise ValueError(f"initializer {name!r} added twice")
        self._arrays[name] = np.ascontiguousarray(array)
        if data_type is not None:
            self._types[name] = data_type
        return name

    def alias(self, name: str, of: str, dims: tuple[int, ...]) -> str:
        """`name` reads the bytes of `of` with other (same-sized) dims."""
        if int(np.prod(dims)) != self._arrays[of].size:
            raise ValueError(f"{name!r}: dims {dims} do not cover {of!r}'s {self._arrays[of].size} elements")
        self._aliases[name] = (of, dims)
        return name

    def __contains__(self, name: str) -> bool:
        return name in self._arrays or name in self._aliases

    def save(self, model: onnx.ModelProto, path: Path) -> None:
        """Replace the graph's initializers with the collected ones and write `path` and `path.data`."""
        location = path.name + ".data"
        tensors: dict[str, TensorProto] = {}
        offset = 0
        with (path.parent / location).open("wb") as out:
            for name, array in self._arrays.items():
                data_type = self._types.get(name, helper.np_dtype_to_tensor_dtype(array.dtype))
                if array.nbytes < INLINE_LIMIT:
                    tensors[name] = TensorProto(
                        name=name, data_type=data_type, dims=array.shape, raw_data=array.tobytes()
                    )
                    continue
                if array.nbytes >= PAGE:
                    padding = -offset % PAGE
                    out.write(b"\0" * padding)
                    offset += padding
                tensors[name] = external_tensor(name, data_type, array.shape, location, offset, array.nbytes)
                out.write(array.tobytes())
                offset += array.nbytes
        for name, (of, dims) in self._aliases.items():
            alias = TensorProto()
            alias.CopyFrom(tensors[of])
            alias.name = name
            del alias.dims[:]
            alias.dims.extend(dims)
            tensors[name] = alias
        del model.graph.initializer[:]
        model.graph.initializer.extend(tensors.values())
        onnx.save(model, str(path))
