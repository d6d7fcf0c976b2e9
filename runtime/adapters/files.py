"""onnxfn's adapter file: one LoRA adapter, converted once by the packager, read by the runtime without torch.

A safetensors file (the field's format for adapters) holding, per adapted `(layer, module)`,
`layers.N.MODULE.a` `[in, rank]` and `layers.N.MODULE.b` `[rank, out]` in the adapter's own precision
(float32 or float16), and in its metadata the format, rank, scale and the base it was validated against.
The runtime packs it into a slot of the graph's stacked inputs (`pack`), scaling `b` in float32 there.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.adapters.layout import AdapterLayout

if TYPE_CHECKING:
    from numpy.typing import NDArray

FORMAT = "onnxfn-lora/1"
_TENSOR_KEY = re.compile(r"^layers\.(\d{1,6})\.([a-z_]{1,32})\.(a|b)$")
SUFFIX = ".safetensors"


class AdapterFileError(Exception):
    """An adapter file that cannot be read, or that does not fit the bundle's adapter layout."""


@dataclass(frozen=True)
class AdapterFile:
    rank: int
    scale: float
    base: dict[str, int | str]  # what it was validated against: architecture, hidden_size, num_layers
    tensors: dict[str, NDArray[np.floating]]  # layers.N.MODULE.a / .b

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(sorted({key.split(".")[2] for key in self.tensors}))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def write_adapter_file(path: Path, adapter: AdapterFile) -> None:
    from safetensors.numpy import save_file  # imported on use: a server without adapters never loads it

    meta = {"format": FORMAT, "rank": str(adapter.rank), "scale": repr(adapter.scale), "base": json.dumps(adapter.base)}
    save_file({k: np.ascontiguousarray(v) for k, v in sorted(adapter.tensors.items())}, str(path), metadata=meta)


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: a little-endian u64 length, then that many bytes of JSON (its tensors' dtypes,
    shapes and offsets, and `__metadata__`). `ValueError` when the length claims more than the file holds."""
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if not 0 < length <= path.stat().st_size - 8:
            raise ValueError(f"its header claims {length} bytes; the file holds {path.stat().st_size}")
        header = json.loads(file.read(length))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return header


def read_adapter_file(path: Path) -> AdapterFile:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        meta = safetensors_header(path).get("__metadata__") or {}
        if meta.get("format") != FORMAT:
            raise AdapterFileError(
                f"{path.name} is not an onnxfn adapter file (format {meta.get('format')!r}); "
                "convert a PEFT folder or GGUF LoRA with `pkg adapter add`"
            )
        tensors = load_file(str(path))
        adapter = AdapterFile(int(meta["rank"]), float(meta["scale"]), json.loads(meta["base"]), tensors)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise AdapterFileError(f"cannot read adapter file {path.name}: {exc}") from exc
    problem = _malformed(adapter)
    if problem is not None:
        raise AdapterFileError(f"adapter file {path.name} is malformed: {problem}")
    return adapter


def _malformed(adapter: AdapterFile) -> str | None:
    """What makes a file that parsed unusable (the runtime may be handed any bytes), or None."""
    if not 1 <= adapter.rank <= 4096 or not math.isfinite(adapter.scale):
        return f"rank {adapter.rank} and scale {adapter.scale}; a rank is 1-4096, a scale finite"
    if not adapter.tensors:
        return "it holds no tensors"
    for key, tensor in adapter.tensors.items():
        match = _TENSOR_KEY.match(key)
        if match is None:
            return f"tensor {key!r}: expected layers.N.MODULE.a or .b"
        if tensor.dtype not in (np.float32, np.float16) or tensor.ndim != 2:
            return f"tensor {key!r} is {tensor.dtype}{list(tensor.shape)}; expected a float32 or float16 matrix"
        partner = key[:-1] + ("b" if match[3] == "a" else "a")
        if partner not in adapter.tensors:
            return f"tensor {key!r} has no {partner!r}"
    return None


def misfit(adapter: AdapterFile, layout: AdapterLayout) -> str | None:
    """Why `adapter` cannot be loaded into a graph with `layout`, or None when it fits."""
    if adapter.rank > layout.rank:
        return f"its rank {adapter.rank} exceeds the bundle's adapter rank {layout.rank}"
    outside = [m for m in adapter.modules if m not in layout.modules]
    if outside:
        return f"it adapts {', '.join(outside)}; the bundle's graph takes adapters on {', '.join(layout.modules)}"
    widths = {m.module: (p.in_features, m.stop - m.start) for p in layout.projections for m in p.modules}
    for key, tensor in adapter.tensors.items():
        _, layer, module, side = key.split(".")
        if not 0 <= int(layer) < layout.num_layers:
            return f"{key}: the base has {layout.num_layers} layers"
        in_features, out_features = widths[module]
        expected = (in_features, adapter.rank) if side == "a" else (adapter.rank, out_features)
        if tensor.shape != expected:
            return f"{key} is {list(tensor.shape)}, the base needs {list(expected)}"
    return None


def pack(adapter: AdapterFile, layout: AdapterLayout) -> dict[str, tuple[NDArray[np.float32], NDArray[np.float32]]]:
    """The adapter as one slot of each graph input pair: `{A input name: (A [in, columns], B [columns, out])}`."""
    problem = misfit(adapter, layout)
    if problem is not None:
        raise AdapterFileError(problem)
    packed = {}
    for layer in range(layout.num_layers):
        for projection in layout.projections:
            columns = layout.columns(projection)
            a = np.zeros((projection.in_features, columns), np.float32)
            b = np.zeros((columns, projection.out_features), np.float32)
            for j, module in enumerate(projection.modules):
                key = f"layers.{layer}.{module.module}"
                if f"{key}.a" not in adapter.tensors:
                    continue
                first = j * layout.rank
                a[:, first : first + adapter.rank] = adapter.tensors[f"{key}.a"]
                b[first : first + adapter.rank, module.start : module.stop] = adapter.tensors[f"{key}.b"].astype(
                    np.float32
                ) * np.float32(adapter.scale)
            packed[layout.input_names(layer, projection.name)[0]] = (a, b)
    return packed
