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


class AdapterMisfit(AdapterFileError):
    """A well-formed adapter file that does not fit the bundle's adapter layout (`misfit` says why)."""


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


@dataclass(frozen=True)
class AdapterHeader:
    """What an adapter file's header says, before any tensor is read: enough to check its fit (`misfit`)."""

    rank: int
    scale: float
    base: dict[str, int | str]
    shapes: dict[str, tuple[int, ...]]  # layers.N.MODULE.a / .b

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(sorted({key.split(".")[2] for key in self.shapes}))


def read_adapter_file(path: Path) -> AdapterFile:
    """The whole adapter, checked (`AdapterFileError` says what is wrong): what the engine loads into a slot."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    header = read_adapter_header(path)
    try:
        tensors = load_file(str(path))
    except (OSError, ValueError, SafetensorError) as exc:
        raise AdapterFileError(f"cannot read adapter file {path.name}: {exc}") from exc
    adapter = AdapterFile(header.rank, header.scale, header.base, tensors)
    problem = _malformed(adapter)
    if problem is not None:
        raise AdapterFileError(f"adapter file {path.name} is malformed: {problem}")
    return adapter


def verify_adapter_file(path: Path, layout: AdapterLayout, label: str | None = None) -> AdapterHeader:
    """Check the file as `read_adapter_file` does, and its fit to `layout` (`AdapterMisfit`), holding one tensor at
    a time: an upload's memory is bounded by its largest tensor, not its size. `label` names it in messages."""
    from safetensors import SafetensorError, safe_open

    label = label or path.name
    header = read_adapter_header(path, label)
    problem = _header_problem(header)
    if problem is None:
        misfit = misfit_shapes(header.rank, header.shapes, layout)
        if misfit is not None:
            raise AdapterMisfit(misfit)
        try:
            with safe_open(str(path), framework="numpy") as handle:
                for key in header.shapes:
                    problem = _tensor_problem(key, handle.get_tensor(key), header.scale)
                    if problem is not None:
                        break
        except (OSError, ValueError, SafetensorError) as exc:
            raise AdapterFileError(f"cannot read adapter file {label}: {exc}") from exc
    if problem is not None:
        raise AdapterFileError(f"adapter file {label} is malformed: {problem}")
    return header


def read_adapter_header(path: Path, label: str | None = None) -> AdapterHeader:
    """The header's metadata and tensor shapes; `AdapterFileError` for a file that is not an onnxfn adapter file."""
    label = label or path.name
    try:
        header = safetensors_header(path)
    except (OSError, ValueError) as exc:
        raise AdapterFileError(f"cannot read adapter file {label}: {exc}") from exc
    meta = header.get("__metadata__", {})
    # The format says a map of strings to strings; anything else in a hostile file is refused, not indexed.
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise AdapterFileError(
            f"adapter file {label}: its safetensors __metadata__ is a JSON {type(meta).__name__}, not an object of "
            "strings; convert a PEFT folder or GGUF LoRA with `pkg adapter add`"
        )
    if meta.get("format") != FORMAT:
        raise AdapterFileError(
            f"{label} is not an onnxfn adapter file (format {meta.get('format')!r}); "
            "convert a PEFT folder or GGUF LoRA with `pkg adapter add`"
        )
    try:
        rank, scale, base = int(meta["rank"]), float(meta["scale"]), json.loads(meta["base"])
    except (KeyError, ValueError) as exc:
        raise AdapterFileError(f"cannot read adapter file {label}: its metadata lacks or garbles {exc}") from exc
    if not isinstance(base, dict):
        raise AdapterFileError(f"adapter file {label}: its metadata's base is not a JSON object")
    shapes = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise AdapterFileError(f"adapter file {label}: tensor {key!r} has no valid shape in its header")
        shapes[key] = tuple(shape)
    return AdapterHeader(rank, scale, base, shapes)


def unusable_values(adapter: AdapterFile) -> str | None:
    """Why the adapter's values cannot be served (a non-finite value, or one that `scale` takes past float32's
    range), or None. The mixed batch's isolation rests on every bound value being finite (packager/export/lora.py)."""
    for key, tensor in adapter.tensors.items():
        problem = _value_problem(key, tensor, adapter.scale)
        if problem is not None:
            return problem
    return None


def _malformed(adapter: AdapterFile) -> str | None:
    """What makes a file that parsed unusable (the runtime may be handed any bytes), or None."""
    header = AdapterHeader(adapter.rank, adapter.scale, adapter.base, {k: t.shape for k, t in adapter.tensors.items()})
    problem = _header_problem(header)
    if problem is not None:
        return problem
    for key, tensor in adapter.tensors.items():
        problem = _tensor_problem(key, tensor, adapter.scale)
        if problem is not None:
            return problem
    return None


def _header_problem(header: AdapterHeader) -> str | None:
    if not 1 <= header.rank <= 4096 or not math.isfinite(header.scale):
        return f"rank {header.rank} and scale {header.scale}; a rank is 1-4096, a scale finite"
    if not header.shapes:
        return "it holds no tensors"
    for key in header.shapes:
        match = _TENSOR_KEY.match(key)
        if match is None:
            return f"tensor {key!r}: expected layers.N.MODULE.a or .b"
        partner = key[:-1] + ("b" if match[3] == "a" else "a")
        if partner not in header.shapes:
            return f"tensor {key!r} has no {partner!r}"
    return None


def _tensor_problem(key: str, tensor: NDArray[Any], scale: float) -> str | None:
    if tensor.dtype not in (np.float32, np.float16) or tensor.ndim != 2:
        return f"tensor {key!r} is {tensor.dtype}{list(tensor.shape)}; expected a float32 or float16 matrix"
    return _value_problem(key, tensor, scale)


def _value_problem(key: str, tensor: NDArray[np.floating], scale: float) -> str | None:
    """A non-finite value, or one that times `scale` overflows float32 (where `pack` multiplies them)."""
    if tensor.size == 0:
        return None
    low, high = float(tensor.min()), float(tensor.max())  # NaN and inf propagate: one pass each, no copy
    if not (math.isfinite(low) and math.isfinite(high)):
        nan, inf = int(np.isnan(tensor).sum()), int(np.isinf(tensor).sum())
        return f"tensor {key!r} holds {nan} NaN and {inf} infinite values; every value must be finite"
    # Both factors are float32 values: their product is exact in float64, so this is float32's own overflow test.
    largest = max(abs(low), abs(high)) * abs(float(np.float32(scale)))
    if largest > float(np.finfo(np.float32).max):
        return (
            f"scale {scale} times tensor {key!r} (largest magnitude {max(abs(low), abs(high)):.4g}) is {largest:.4g}, "
            "beyond float32's range; the adapter's weights or its scale are broken"
        )
    return None


def misfit(adapter: AdapterFile, layout: AdapterLayout) -> str | None:
    """Why `adapter` cannot be loaded into a graph with `layout`, or None when it fits."""
    return misfit_shapes(adapter.rank, {key: tensor.shape for key, tensor in adapter.tensors.items()}, layout)


def misfit_shapes(rank: int, shapes: dict[str, tuple[int, ...]], layout: AdapterLayout) -> str | None:
    """`misfit` from the tensors' shapes alone (an adapter file's header)."""
    if rank > layout.rank:
        return f"its rank {rank} exceeds the bundle's adapter rank {layout.rank}"
    modules = sorted({key.split(".")[2] for key in shapes})
    outside = [m for m in modules if m not in layout.modules]
    if outside:
        return f"it adapts {', '.join(outside)}; the bundle's graph takes adapters on {', '.join(layout.modules)}"
    widths = {m.module: (p.in_features, m.stop - m.start) for p in layout.projections for m in p.modules}
    for key, shape in shapes.items():
        _, layer, module, side = key.split(".")
        if not 0 <= int(layer) < layout.num_layers:
            return f"{key}: the base has {layout.num_layers} layers"
        in_features, out_features = widths[module]
        expected = (in_features, rank) if side == "a" else (rank, out_features)
        if tuple(shape) != expected:
            return f"{key} is {list(shape)}, the base needs {list(expected)}"
    return None


def pack(adapter: AdapterFile, layout: AdapterLayout) -> dict[str, tuple[NDArray[np.float32], NDArray[np.float32]]]:
    """The adapter as one slot of each graph input pair: `{A input name: (A [in, columns], B [columns, out])}`."""
    problem = misfit(adapter, layout) or unusable_values(adapter)
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
