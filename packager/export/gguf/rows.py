"""Find which GGUF rows each weight of an exported graph holds, by value.

The fp32 graph was built from the GGUF dequantized by transformers (with the `gguf` package's arithmetic), so
each of its weight rows is bit for bit some row of some GGUF tensor: the converter's q/k row permutation, the
builder's fused q/k/v projection and a transposed tied embedding all move rows without changing them. Matching
rows by value therefore follows whatever an architecture's loader and the builder did, with no table of tensor
names per architecture; a row the builder changed arithmetically matches nothing and its weight stays float.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass(frozen=True)
class Run:
    """Rows `start, start + step, …` (`count` of them) of the GGUF tensor `tensor`."""

    tensor: str
    start: int
    step: int
    count: int

    def indices(self) -> np.ndarray:
        return self.start + self.step * np.arange(self.count)


def _row_key(row: np.ndarray) -> bytes:
    # `+ 0.0` makes -0.0 and 0.0 one value: the loader may produce either from the same block.
    return hashlib.blake2b((row + np.float32(0.0)).tobytes(), digest_size=16).digest()


def source_rows(tensor: ReaderTensor) -> np.ndarray:
    """The tensor's raw rows: `[rows, bytes]` for block types, `[rows, K]` for float types (GGUF: rows = ne[1:])."""
    data = np.asarray(tensor.data)
    return data.reshape(-1, data.shape[-1])


class RowIndex:
    """Row values → `(tensor, row)`, built per row length on first use (every tensor of that K is read once)."""

    def __init__(self, reader: GGUFReader) -> None:
        self._tensors = {t.name: t for t in reader.tensors if len(t.shape) >= 2}
        self._by_k: dict[int, dict[bytes, list[tuple[str, int]]]] = {}

    def tensor(self, name: str) -> ReaderTensor:
        return self._tensors[name]

    def _index(self, k: int) -> dict[bytes, list[tuple[str, int]]]:
        if k not in self._by_k:
            index: dict[bytes, list[tuple[str, int]]] = defaultdict(list)
            for name, tensor in self._tensors.items():
                if int(tensor.shape[0]) != k:
                    continue
                values = dequantize(source_rows(tensor), tensor.tensor_type).reshape(-1, k)
                for row, vector in enumerate(values):
                    index[_row_key(vector)].append((name, row))
            self._by_k[k] = dict(index)
        return self._by_k[k]

    def locate(self, weight: np.ndarray) -> list[Run] | None:
        """The runs of GGUF rows equal to the rows of `weight` (`[rows, K]` float32), in order; None if a row has none.

        A row found in several places (a repeated row, all zeros) is taken from the tensor the previous row came
        from, so runs stay long.
        """
        index = self._index(weight.shape[1])
        picked: list[tuple[str, int]] = []
        for vector in weight:
            candidates = index.get(_row_key(vector))
            if not candidates:
                return None
            previous = picked[-1][0] if picked else None
            picked.append(next((c for c in candidates if c[0] == previous), candidates[0]))
        return _runs(picked)


def _runs(picked: list[tuple[str, int]]) -> list[Run]:
    runs: list[Run] = []
    for tensor, row in picked:
        last = runs[-1] if runs else None
        if last is not None and last.tensor == tensor:
            if last.count == 1 and row != last.start:
                runs[-1] = Run(tensor, last.start, row - last.start, 2)
                continue
            if row == last.start + last.step * last.count:
                runs[-1] = Run(tensor, last.start, last.step, last.count + 1)
                continue
        runs.append(Run(tensor, row, 1, 1))
    return runs
