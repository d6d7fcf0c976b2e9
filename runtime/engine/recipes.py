"""Weights files written from a bundle's own bytes where it runs, by a recipe the bundle carries.

Two kinds of file are made this way (their recipes share one format): the fp32 prefill graph's weights, dequantized
from the quantized model's blocks (derived.py), and a GGUF bundle's float32 scale tables, expanded from the file's
own factors (tables.py). A recipe lists the file's tensors in order, each one bytes copied from a file, a quantized
matmul weight dequantized, or a table expanded; the file's sha256 comes out of the write.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from runtime.bundle import BundleError
from runtime.verified import default_record_dir

if TYPE_CHECKING:
    from numpy.typing import NDArray

RECIPE_SUFFIX = ".derive.json"  # a derived graph's recipe: GRAPH + this


def work_directory() -> Path:
    """`$ONNXFN_STATE_DIR/derived` (beside the verification records), where the files recipes make are written; under
    the temporary directory where the state directory cannot be written (a read-only home: Lambda's `/tmp` then)."""
    state = default_record_dir().parent
    try:
        state.mkdir(parents=True, exist_ok=True)
        writable = os.access(state, os.W_OK)
    except OSError:
        writable = False
    return (state if writable else Path(tempfile.gettempdir()) / "onnxfn") / "derived"


def dequantize_nbits(
    packed: NDArray[np.uint8],
    scales: NDArray[np.floating[Any]],
    bits: int,
    k: int,
    zero_points: NDArray[np.uint8] | None = None,
    residual: NDArray[np.floating[Any]] | None = None,
) -> NDArray[np.float32]:
    """MatMulNBits' weight (`[N, blocks, block_bytes]` uint8, scales `[N, blocks]`) as fp32 `[K, N]`.

    4-bit values and zero points are packed low nibble first; without zero points the zero point is
    2^(bits-1). `residual` (`[N, blocks]`) is the per-block term a GGUF type with a minimum adds.
    """
    n, blocks, _ = packed.shape
    values = (packed if bits == 8 else _nibbles(packed)).astype(np.float32)
    if zero_points is None:
        values -= float(1 << (bits - 1))
    else:
        zero = zero_points.reshape(n, -1)
        if bits == 4:
            zero = _nibbles(zero)
        values -= zero[:, :blocks, None].astype(np.float32)
    values *= scales.reshape(n, blocks)[:, :, None]
    if residual is not None:
        values += residual.reshape(n, blocks)[:, :, None]
    return np.ascontiguousarray(values.reshape(n, -1)[:, :k].T)


def expand_factors(
    super_: NDArray[np.floating[Any]], sub: NDArray[np.integer[Any]] | None, negate: bool
) -> NDArray[np.float32]:
    """Per-block float32 values from a GGUF type's factors (packager/export/gguf/blocks.py's `Factors`):
    `super_` `[rows, supers]` float16, `sub` `[rows, blocks]` small integers or None (`super_` per block)."""
    table = super_.astype(np.float32)
    if sub is not None:
        rows, blocks = sub.shape
        if super_.ndim != 2 or super_.shape[0] != rows or super_.shape[1] == 0 or blocks % super_.shape[1]:
            raise BundleError(f"scale factors of shapes {super_.shape} and {sub.shape} do not fit together")
        table = np.repeat(table, blocks // super_.shape[1], axis=1) * sub.astype(np.float32)
    return -table if negate else table


def residual_table(
    minimum: NDArray[np.float32], zero: NDArray[np.uint8], scale: NDArray[np.float32]
) -> NDArray[np.float32]:
    """A GGUF type's block minimum as MatMulNBits' zero point `zero` leaves it: `minimum + zero * scale`, float32."""
    return (minimum + zero.astype(np.float32) * scale).astype(np.float32)


def table_array(rule: dict[str, Any], read: Any) -> NDArray[np.float32]:
    """The float32 table `rule` (a recipe's `table`) makes of the factors `read(ref)` returns: a weight's scales, or,
    with a `minimum`, its residual; `[rows, blocks]`, or `[blocks, rows]` when `transposed`."""

    def factors(spec: dict[str, Any]) -> NDArray[np.float32]:
        sub = spec.get("sub")
        return expand_factors(read(spec["super"]), None if sub is None else read(sub), bool(spec.get("negate", False)))

    table = factors(rule["scales"])
    if "minimum" in rule:
        minimum = factors(rule["minimum"])
        zero = read(rule["zero_points"])
        if int(rule["bits"]) == 4:
            zero = _nibbles(zero)
        zero = zero[:, : table.shape[1]]
        if minimum.shape != table.shape or zero.shape != table.shape:
            raise BundleError(f"a residual's parts have shapes {minimum.shape}, {zero.shape} and {table.shape}")
        table = residual_table(minimum, zero, table)
    return np.ascontiguousarray(table.T) if rule.get("transposed") else table


def ref_array(ref: dict[str, Any], read_bytes: Callable[[str, int, int], Any], recipe_file: str) -> NDArray[Any]:
    """The tensor a recipe's `ref` names, of its dtype and shape: inline (base64), or the `nbytes` that
    `read_bytes(file, offset, nbytes)` returns (bytes, or a uint8 array such as a slice of a map)."""
    dtype, shape = np.dtype(ref["dtype"]), tuple(int(d) for d in ref["shape"])
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if "inline" in ref:
        raw = base64.b64decode(ref["inline"])
    else:
        raw = read_bytes(str(ref["file"]), int(ref["offset"]), nbytes)
    if len(raw) != nbytes:
        raise BundleError(f"{recipe_file} holds a tensor of the wrong size; rebuild the bundle")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _nibbles(packed: NDArray[np.uint8]) -> NDArray[np.uint8]:
    """Two 4-bit values from each byte of the last axis, low nibble first: `[..., 2 * bytes]` uint8."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def write_data(recipe: dict[str, Any], files: Callable[[str], Path], out: Path | None, recipe_file: str) -> str:
    """Write the weights file `recipe` (the bundle's `recipe_file`) describes to `out` (None: only compute it), reading
    the files it names through `files` (name -> path); returns the sha256 of the file's bytes.

    The recipe is a bundle file, verified with the others, but it steers reads and writes, so it is held to
    what a packager writes: it reads only files `files` resolves (the manifest's) and ranges inside them, its
    tensors lie in order inside the size it declares. Anything else is refused (`BundleError`) before it is done.

    One tensor at a time: each source range is read into memory of its own (not through a mapping of the whole
    file, whose pages would stay resident) and freed once its weight is written, so the process holds the largest
    weight and its sources, whatever the model's size.
    """
    sources: dict[str, int] = {}  # file -> an open descriptor
    size = int(recipe["size"])
    if out is not None:
        _check_space(out.parent, size, recipe_file)

    def read_bytes(name: str, offset: int, nbytes: int) -> bytearray:
        if name not in sources:
            sources[name] = os.open(files(name), os.O_RDONLY | os.O_CLOEXEC)
        if offset < 0 or offset + nbytes > os.fstat(sources[name]).st_size:
            raise BundleError(f"{recipe_file} reads past the end of {name}; rebuild the bundle")
        return _read_range(sources[name], offset, nbytes)

    def read(ref: dict[str, Any]) -> NDArray[Any]:
        return ref_array(ref, read_bytes, recipe_file)

    def read_optional(ref: dict[str, Any] | None) -> NDArray[Any] | None:
        return None if ref is None else read(ref)

    def derive(tensor: dict[str, Any]) -> NDArray[Any]:
        if "copy" in tensor:
            return read(tensor["copy"])
        if "table" in tensor:
            table = table_array(tensor["table"], read)
            if list(table.shape) != [int(d) for d in tensor["shape"]]:
                raise BundleError(f"{recipe_file} makes a table of another shape than it declares; rebuild the bundle")
            return table
        spec = tensor["dequantize"]
        residual_t = read_optional(spec.get("residual_t"))  # stored as the graph multiplies by it: [blocks, N]
        return dequantize_nbits(
            read(spec["blocks"]),
            read(spec["scales"]),
            int(spec["bits"]),
            int(spec["K"]),
            read_optional(spec.get("zero_points")),
            None if residual_t is None else residual_t.T,
        )

    digest, position = hashlib.sha256(), 0
    f: BinaryIO | None = None
    try:
        f = out.open("wb") if out is not None else None
        for tensor in recipe["tensors"]:
            offset, data = int(tensor["offset"]), np.ascontiguousarray(derive(tensor)).reshape(-1).view(np.uint8)
            if offset + data.nbytes > size:
                raise BundleError(f"{recipe_file} writes past the size it declares; rebuild the bundle")
            if offset < position:
                raise BundleError(f"{recipe_file} writes its tensors out of order; rebuild the bundle")
            digest.update(bytes(offset - position))
            digest.update(data.data)
            if f is not None:
                f.seek(offset)
                f.write(data.data)  # no second copy as bytes
            position = offset + data.nbytes
        digest.update(bytes(size - position))
        if f is not None:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
    finally:
        if f is not None:
            f.close()
        for descriptor in sources.values():
            os.close(descriptor)
    return digest.hexdigest()


def _read_range(descriptor: int, offset: int, nbytes: int) -> bytearray:
    """`nbytes` from `offset` of an open file (fewer only at its end)."""
    buffer = bytearray(nbytes)
    view, done = memoryview(buffer), 0
    while done < nbytes:
        count = os.preadv(descriptor, [view[done:]], offset + done)
        if count == 0:
            return buffer[:done]
        done += count
    return buffer


def _check_space(directory: Path, size: int, recipe_file: str) -> None:
    """Refuse before writing a weights file the file system cannot hold (it would fail gigabytes in)."""
    free = shutil.disk_usage(directory).free
    what = "fp32 prefill weights" if recipe_file.endswith(RECIPE_SUFFIX) else "scale tables"
    if size > free:
        raise OSError(
            errno.ENOSPC,
            f"deriving {size / 2**30:.2f} GiB of {what} needs that much space in {directory}, "
            f"which has {free / 2**30:.2f} GiB free",
        )
