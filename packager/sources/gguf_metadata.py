"""A GGUF file's metadata and tensor table, read without building its vocabulary's strings.

gguf's `GGUFReader` makes a numpy view of every element of every array: opening SmolLM2's file (49,152 tokens and
48,900 merges) takes ~7 s and ~1 M views, and a 128k-token Llama 3 vocabulary ~2.6x that; a build opened it four
times just to read `general.architecture` and the rope keys (29 s of a 1B model's config step). The readers here
decode scalars, strings and numeric arrays, and step over string arrays by their lengths (keeping only their
count), which is all the config and rope readers need; `mapped_tensors` gives the tensors as GGUFReader's own
`ReaderTensor`s over one mapping of the file, built from this table (weights.py: each build step that reads weights
opened a GGUFReader, and its views stay resident while the step runs).

The layout is the GGUF specification's (ggml/docs/gguf.md): header, key/value pairs, tensor infos, then the data,
aligned to `general.alignment` (32 by default).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types: their struct codes (the scalars), 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMENSIONS = 4  # ggml's GGML_MAX_DIMS


@dataclass(frozen=True)
class StringArray:
    """A string array's place: its length, not its strings (a vocabulary)."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first, as GGUFReader's `shape`
    type: int  # a gguf.GGMLQuantizationType value
    offset: int  # absolute, in the file

    @property
    def elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def n_bytes(self) -> int:
        """Bytes of its data in the file (whole blocks of its type)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type)]
        return self.elements * type_size // block_size


@dataclass(frozen=True)
class GgufMetadata:
    path: Path
    fields: dict[str, Any]
    tensors: dict[str, TensorInfo]
    byte_order: Literal["<", ">"]  # struct's and numpy's prefix

    @property
    def architecture(self) -> str:
        return str(self.fields["general.architecture"])

    def field(self, key: str, default: Any = None) -> Any:
        """`key`'s value, with `{arch}` replaced by the file's architecture."""
        return self.fields.get(key.format(arch=self.architecture), default)

    def float32(self, name: str) -> np.ndarray:
        """An F32 tensor's values (rope factor tables: small)."""
        info = self.tensors[name]
        if info.type != 0:
            raise ValueError(f"{name} is not F32")
        return np.fromfile(self.path, dtype=np.float32, count=info.elements, offset=info.offset)


def read_metadata(path: Path) -> GgufMetadata:
    """The metadata of the GGUF at `path`, read once per file version (size and modification time)."""
    stat = path.stat()
    return _read(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read(path: Path, size: int, mtime_ns: int) -> GgufMetadata:
    with path.open("rb") as file:
        return _Parser(file, path).parse()


class _Parser:
    def __init__(self, file: BinaryIO, path: Path) -> None:
        self.file, self.path = file, path
        self.order: Literal["<", ">"] = "<"
        # Every count and length is checked against what is left of the file before it is acted on: a damaged
        # or hostile file fails with one ValueError, never a huge read or a loop over a count it cannot hold.
        self.size = path.stat().st_size

    def parse(self) -> GgufMetadata:
        if self.file.read(4) != _MAGIC:
            raise ValueError(f"{self.path.name} does not start with GGUF's magic")
        (version,) = struct.unpack("<I", self.file.read(4))
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self.order = ">"
        tensor_count, field_count = self._unpack("QQ")
        self._fits(field_count, 12)  # a key's length and a value type, at least
        fields = {}
        for _ in range(field_count):
            key = self._string()
            (value_type,) = self._unpack("I")
            fields[key] = self._value(value_type)
        self._fits(tensor_count, 24)  # a name's length, a dimension count, a type and an offset, at least
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            (dimensions,) = self._unpack("I")
            if dimensions > _MAX_DIMENSIONS:
                raise ValueError(f"{self.path.name}: tensor {name!r} has {dimensions} dimensions")
            shape = self._unpack("Q" * dimensions)
            tensor_type, offset = self._unpack("IQ")
            infos.append((name, tuple(int(n) for n in shape), int(tensor_type), int(offset)))
        alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self.file.tell() // alignment) * alignment
        tensors = {name: TensorInfo(name, shape, kind, start + offset) for name, shape, kind, offset in infos}
        return GgufMetadata(self.path, fields, tensors, self.order)

    def _unpack(self, codes: str) -> tuple[Any, ...]:
        layout = struct.Struct(self.order + codes)
        data = self.file.read(layout.size)
        if len(data) != layout.size:
            raise ValueError(f"{self.path.name} ends inside its metadata")
        return layout.unpack(data)

    def _fits(self, count: int, each: int) -> None:
        if count * each > self.size - self.file.tell():
            raise ValueError(f"{self.path.name} ends inside its metadata")

    def _string(self) -> str:
        (length,) = self._unpack("Q")
        self._fits(length, 1)
        return self.file.read(length).decode("utf-8", errors="replace")

    def _value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self._unpack(_SCALARS[value_type])[0]
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise ValueError(f"{self.path.name} holds an unknown GGUF value type {value_type}")
        item_type, count = self._unpack("IQ")
        if item_type == _STRING:  # step over each string by its length
            self._fits(count, 8)
            length_of, read, seek = struct.Struct(self.order + "Q").unpack, self.file.read, self.file.seek
            for _ in range(count):
                length = read(8)
                if len(length) != 8:
                    raise ValueError(f"{self.path.name} ends inside its metadata")
                seek(length_of(length)[0], 1)
            if self.file.tell() > self.size:
                raise ValueError(f"{self.path.name} ends inside its metadata")
            return StringArray(count)
        if item_type in _SCALARS:
            dtype = np.dtype(self.order + _SCALARS[item_type])
            self._fits(count, dtype.itemsize)
            return np.frombuffer(self.file.read(dtype.itemsize * count), dtype=dtype).tolist()
        self._fits(count, 12)  # each an array's item type and count, at least
        return [self._value(item_type) for _ in range(count)]  # arrays of arrays: rare and small


# The types GGUFReader maps as typed arrays; every other type as its blocks' bytes.
_ARRAY_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


def mapped_tensors(path: Path) -> tuple[np.memmap, dict[str, Any]]:
    """`path` mapped once (read-only), and each tensor as the `ReaderTensor` GGUFReader would give (the same
    `data` view, shape and type), built from the quick table: `(the mapping, {name: tensor})`."""
    from gguf import GGMLQuantizationType
    from gguf.gguf_reader import ReaderTensor
    from gguf.quants import quant_shape_to_byte_shape

    metadata = read_metadata(path)
    mapping = np.memmap(path, mode="r")
    tensors = {}
    for name, info in metadata.tensors.items():
        kind = GGMLQuantizationType(info.type)
        elements, n_bytes = info.elements, info.n_bytes
        dims = tuple(reversed(info.shape))
        if info.type in _ARRAY_TYPES:
            dtype = np.dtype(_ARRAY_TYPES[info.type]).newbyteorder(metadata.byte_order)
        else:
            dtype, dims = np.dtype(np.uint8), quant_shape_to_byte_shape(dims, kind)
        data = mapping[info.offset : info.offset + n_bytes].view(dtype).reshape(dims)
        shape = np.array(info.shape, dtype=np.uint64)
        tensors[name] = ReaderTensor(name, kind, shape, elements, n_bytes, info.offset, data, None)  # type: ignore[arg-type]
    return mapping, tensors
