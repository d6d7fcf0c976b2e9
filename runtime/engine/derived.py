"""Weights derived from a bundle where it runs instead of shipped in it: the fp32 prefill graph's.

A quantized bundle carries `prefill.onnx` (a graph of a few hundred KB) and `prefill.onnx.derive.json`, the
recipe for its weights file: for each of the graph's external tensors, either bytes copied from the bundle's
`model.onnx.data` or a quantized matmul weight (MatMulNBits' blocks, scales, zero points, and the residual of
a GGUF type with a block minimum) dequantized to fp32. The weights file is 4-8x the quantized model, and only
CPUs without int8 dot products (or `decode = "throughput"`) run that graph, so it is written where it is
needed: by the `local` target at deploy, else by the engine on the first start that wants it. It lives in a
directory of its own (`$ONNXFN_STATE_DIR/derived/DIGEST/` unless configured), beside a copy of the graph, with a
record that ties it to the bundle and to the files' identities (as runtime.verified trusts them).
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from runtime.bundle import Bundle, BundleError
from runtime.verified import default_record_dir, file_identity

if TYPE_CHECKING:
    from numpy.typing import NDArray

RECIPE_SUFFIX = ".derive.json"
RECORD = "derived.json"
FORMAT = 1
log = logging.getLogger("runtime.engine")


def recipe_name(graph: str) -> str:
    return graph + RECIPE_SUFFIX


def default_directory(bundle: Bundle) -> Path:
    """`$ONNXFN_STATE_DIR/derived/DIGEST` (beside the verification records), one directory per bundle; under the
    temporary directory where the state directory cannot be written (a read-only home: Lambda's `/tmp` then)."""
    name = bundle.manifest.digest.removeprefix("sha256:")[:32]
    state = default_record_dir().parent
    try:
        state.mkdir(parents=True, exist_ok=True)
        writable = os.access(state, os.W_OK)
    except OSError:
        writable = False
    return (state if writable else Path(tempfile.gettempdir()) / "onnxfn") / "derived" / name


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


def _nibbles(packed: NDArray[np.uint8]) -> NDArray[np.uint8]:
    """Two 4-bit values from each byte of the last axis, low nibble first: `[..., 2 * bytes]` uint8."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


@dataclass(frozen=True)
class DerivedGraphs:
    """A directory of graphs derived from one bundle, and the record saying they are complete and unchanged."""

    directory: Path

    def graph(self, bundle: Bundle, name: str) -> Path:
        """The derived copy of the bundle's graph `name`, written now unless a valid one is there already."""
        problem = self.problem(bundle, name)
        if problem is None:
            return self.directory / name
        log.info("deriving %s's weights into %s (%s)", name, self.directory, problem)
        self._write(bundle, name)
        return self.directory / name

    def problem(self, bundle: Bundle, name: str) -> str | None:
        """Why there is no usable derived copy of graph `name`; None when there is."""
        try:
            record = json.loads((self.directory / RECORD).read_text())
        except (OSError, ValueError):
            return "none was written yet"
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            return "the record has another format"
        if record.get("bundle_digest") != bundle.manifest.digest:
            return "it was written for another bundle"
        recorded = record.get("files", {}).get(name)
        try:
            current = self._identities(name)
        except OSError:
            return "its files are missing"
        return None if recorded == current else "its files changed since they were written"

    def _identities(self, name: str) -> dict[str, list[int]]:
        recipe = self._recipe_of(self.directory / name)
        return {file: file_identity(self.directory / file) for file in (name, recipe["data"])}

    @staticmethod
    def _recipe_of(graph: Path) -> dict[str, Any]:
        recipe: dict[str, Any] = json.loads(graph.with_name(recipe_name(graph.name)).read_text())
        return recipe

    def _write(self, bundle: Bundle, name: str) -> None:
        """Write the graph, its recipe and its weights file; the record goes last, so a partial write never counts."""
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / RECORD).unlink(missing_ok=True)
        recipe = self._recipe_of(bundle.file(name))
        data = self.directory / recipe["data"]
        partial = data.with_name(data.name + ".partial")
        try:
            write_data(recipe, bundle, partial, recipe_name(name))
            partial.replace(data)
        finally:
            partial.unlink(missing_ok=True)
        for file in (name, recipe_name(name)):
            shutil.copyfile(bundle.file(file), self.directory / file)
        try:
            record = json.loads((self.directory / RECORD).read_text())
        except (OSError, ValueError):
            record = {}
        files = record.get("files", {}) if record.get("bundle_digest") == bundle.manifest.digest else {}
        files[name] = self._identities(name)
        record = {"format": FORMAT, "bundle_digest": bundle.manifest.digest, "files": files}
        tmp = self.directory / (RECORD + ".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(self.directory / RECORD)


def write_data(recipe: dict[str, Any], bundle: Bundle, out: Path, recipe_file: str) -> None:
    """Write the weights file `recipe` (the bundle's `recipe_file`) describes from the bundle's files.

    The recipe is a bundle file, verified with the others, but it steers reads and writes, so it is held to
    what a packager writes: it reads only files the manifest lists and ranges inside them, and every tensor
    it writes lies inside the size it declares. Anything else is refused (`BundleError`) before it is done.

    One tensor at a time: each source range is read into memory of its own (not through a mapping of the whole
    file, whose pages would stay resident) and freed once its weight is written, so the process holds the largest
    weight and its sources, whatever the model's size.
    """
    sources: dict[str, int] = {}  # bundle file -> an open descriptor
    size = int(recipe["size"])
    _check_space(out.parent, size)

    def read(ref: dict[str, Any]) -> NDArray[Any]:
        """The tensor `ref` points at: inline, or a byte range of a bundle file; its dtype is the recipe's."""
        dtype, shape = np.dtype(ref["dtype"]), tuple(int(d) for d in ref["shape"])
        nbytes = int(np.prod(shape)) * dtype.itemsize
        raw: bytes | bytearray
        if "inline" in ref:
            raw = base64.b64decode(ref["inline"])
        else:
            name, offset = str(ref["file"]), int(ref["offset"])
            if name not in sources:
                sources[name] = os.open(bundle.file(name), os.O_RDONLY | os.O_CLOEXEC)
            if offset < 0 or offset + nbytes > os.fstat(sources[name]).st_size:
                raise BundleError(f"{recipe_file} reads past the end of {name}; rebuild the bundle")
            raw = _read_range(sources[name], offset, nbytes)
        if len(raw) != nbytes:
            raise BundleError(f"{recipe_file} holds a tensor of the wrong size; rebuild the bundle")
        return np.frombuffer(raw, dtype=dtype).reshape(shape)

    def read_optional(ref: dict[str, Any] | None) -> NDArray[Any] | None:
        return None if ref is None else read(ref)

    def write(f: BinaryIO, offset: int, data: NDArray[Any]) -> None:
        if offset < 0 or offset + data.nbytes > size:
            raise BundleError(f"{recipe_file} writes past the size it declares; rebuild the bundle")
        f.seek(offset)
        f.write(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)  # no second copy as bytes

    try:
        with out.open("wb") as f:
            for tensor in recipe["tensors"]:
                if "copy" in tensor:
                    write(f, int(tensor["offset"]), read(tensor["copy"]))
                    continue
                spec = tensor["dequantize"]
                residual_t = read_optional(spec.get("residual_t"))  # stored as the graph multiplies by it: [blocks, N]
                weight = dequantize_nbits(
                    read(spec["blocks"]),
                    read(spec["scales"]),
                    int(spec["bits"]),
                    int(spec["K"]),
                    read_optional(spec.get("zero_points")),
                    None if residual_t is None else residual_t.T,
                )
                write(f, int(tensor["offset"]), weight)
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
    finally:
        for descriptor in sources.values():
            os.close(descriptor)


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


def _check_space(directory: Path, size: int) -> None:
    """Refuse before writing a weights file the file system cannot hold (it would fail gigabytes in)."""
    free = shutil.disk_usage(directory).free
    if size > free:
        raise OSError(
            errno.ENOSPC,
            f"deriving {size / 2**30:.2f} GiB of fp32 prefill weights needs that much space in {directory}, "
            f"which has {free / 2**30:.2f} GiB free",
        )
