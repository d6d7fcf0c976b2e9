"""Scale tables: the float32 per-block scales and residuals of a GGUF bundle's graphs, expanded where it runs.

MatMulNBits and GatherBlockQuantized take a float32 scale per block (and a GGUF type with a block minimum adds a
float32 residual per block: packager/export/gguf/blocks.py): 1-2 bits per weight, where the GGUF stores a float16
per block, or a K-quant's 6- or 8-bit integer per sub-block and a float16 per super-block (0.25-0.5 bits). A GGUF
bundle ships the file's own factors in `model.onnx.data` and `model.onnx.tables.json`, the recipe that expands them
(derived.py's format, tensors of kind `table`, with the sha256 of the result); its graphs name the float32 tables
as initializers of `model.onnx.tables`, a file the bundle does not hold (Llama-3.1-8B's shape, Q4_K_M: 1.8 GB of
tables, bundle / GGUF 1.40 -> 1.11).

The runtime writes that file once per bundle and machine, beside the derived prefill weights (recipes.py), checks
its digest, and hands the tables to ONNX Runtime as OrtValues over a read-only memory map of it
(`SessionOptions.add_external_initializers`): ONNX Runtime refuses external data reached through a link out of the
graph's directory, and the bundle's directory is verified and may be read-only. The tables are bit-equal to what
the packager verified (shared/probes/gguf-exact); once the session is built (its kernels packed the scales they
need), their pages are dropped, and any ONNX Runtime reads again fault back from the file.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.bundle import Bundle, BundleError
from runtime.engine.recipes import work_directory, write_data
from runtime.verified import file_identity

if TYPE_CHECKING:
    import onnxruntime as ort

TABLES_FILE = "model.onnx.tables"
TABLES_RECIPE = TABLES_FILE + ".json"
RECORD = "tables.json"
FORMAT = 1
log = logging.getLogger("runtime.engine")
_writing = threading.Lock()  # the decode and prefill sessions are built on two threads at once


def has_tables(bundle: Bundle) -> bool:
    return TABLES_RECIPE in bundle.manifest.files


def tables_path(bundle: Bundle) -> Path:
    """The bundle's tables file, written now (and checked against the recipe's digest) unless a valid one is there.

    Filed by that digest, of the tables themselves: bundles that differ only elsewhere (a rebuild with another
    snapshot or prompt) share one file."""
    return _tables_file(bundle, _recipe(bundle))


def _recipe(bundle: Bundle) -> dict[str, Any]:
    recipe: dict[str, Any] = json.loads(bundle.file(TABLES_RECIPE).read_text())
    return recipe


def _tables_file(bundle: Bundle, recipe: dict[str, Any]) -> Path:
    digest = recipe.get("sha256")
    if not isinstance(digest, str) or len(digest) != 64:
        raise BundleError(f"{TABLES_RECIPE} names no sha256 of the tables it makes; rebuild the bundle")
    path = work_directory() / f"tables-{digest[:32]}" / TABLES_FILE
    with _writing:
        problem = _problem(digest, path)
        if problem is not None:
            log.info("expanding the scale tables into %s (%s)", path, problem)
            _write(bundle, recipe, digest, path)
    return path


def _problem(digest: str, path: Path) -> str | None:
    try:
        record = json.loads((path.parent / RECORD).read_text())
    except (OSError, ValueError):
        return "none was written yet"
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return "the record has another format"
    if record.get("sha256") != digest:
        return "it holds other tables"
    try:
        identity = file_identity(path)
    except OSError:
        return "the file is missing"
    return None if record.get("identity") == identity else "the file changed since it was written"


def _write(bundle: Bundle, recipe: dict[str, Any], expected: str, path: Path) -> None:
    """The file, then its record (a partial write never counts); `expected`: its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / RECORD).unlink(missing_ok=True)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    try:
        digest = write_data(recipe, bundle_files(bundle), partial, TABLES_RECIPE)
        if digest != expected:
            raise BundleError(f"{TABLES_RECIPE} expands to other tables than the packager verified; rebuild the bundle")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    record = {"format": FORMAT, "sha256": digest, "identity": file_identity(path)}
    tmp = path.parent / f"{RECORD}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path.parent / RECORD)


def write_tables_beside(directory: Path) -> Path | None:
    """The tables file of the graph in `directory` (an export, or a bundle's copy one may write into), written
    there from its recipe, where ONNX Runtime finds it without any override; checked against the recipe's digest.
    None when the graph has no tables."""
    if not (directory / TABLES_RECIPE).is_file():
        return None
    recipe = json.loads((directory / TABLES_RECIPE).read_text())
    path = directory / TABLES_FILE
    if write_data(recipe, lambda name: directory / name, path, TABLES_RECIPE) != recipe.get("sha256"):
        path.unlink()
        raise BundleError(f"{directory / TABLES_RECIPE} expands to other tables than the packager verified")
    return path


def bundle_files(bundle: Bundle) -> Callable[[str], Path]:
    """Where a recipe of `bundle` reads the files it names: the bundle's, and the scale tables derived from it."""

    def resolve(name: str) -> Path:
        return tables_path(bundle) if name == TABLES_FILE else bundle.file(name)

    return resolve


@dataclass(frozen=True)
class _Entry:
    name: str
    dims: tuple[int, ...]
    offset: int
    length: int


def _entries(recipe: dict[str, Any], graph: str) -> list[_Entry]:
    """The initializers of the bundle's graph `graph` stored in the tables file, as the recipe lists them (the bundle
    step records which graph names which: the runtime reads no graph, and its image has no `onnx` package)."""
    tables = {str(t["name"]): t for t in recipe["tensors"]}
    entries = []
    for name in recipe.get("graphs", {}).get(graph, []):
        if name not in tables:
            raise BundleError(f"{TABLES_RECIPE} says {graph} names a table it does not hold; rebuild the bundle")
        dims = tuple(int(d) for d in tables[name]["shape"])
        entries.append(_Entry(name, dims, int(tables[name]["offset"]), 4 * int(np.prod(dims))))
    return entries


class GraphTables:
    """The tables one graph names, as arrays over one read-only map of the tables file (kept for the session's life:
    ONNX Runtime uses the arrays' memory, it does not copy them)."""

    def __init__(self, entries: list[_Entry], tables: Path, graph: str) -> None:
        self.names = [e.name for e in entries]
        self._map: mmap.mmap | None = None
        self.arrays: list[np.ndarray[Any, np.dtype[np.float32]]] = []
        if not entries:
            return
        with tables.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        for entry in entries:
            count = int(np.prod(entry.dims))
            if count * 4 != entry.length or entry.offset < 0 or entry.offset + entry.length > len(self._map):
                raise BundleError(f"{graph}'s {entry.name} lies outside {TABLES_FILE}; rebuild the bundle")
            array = np.frombuffer(self._map, np.float32, count, entry.offset)
            self.arrays.append(array.reshape(entry.dims))

    def add_to(self, options: ort.SessionOptions) -> None:
        import onnxruntime as ort

        if self.names:
            values = [ort.OrtValue.ortvalue_from_numpy(array) for array in self.arrays]
            options.add_external_initializers(self.names, values)

    def release_pages(self) -> None:
        """Drop the map's resident pages: the session's kernels hold what they packed, and a page read again faults
        back from the file (8B shape: the server's RSS 10.3 -> 8.0 GiB)."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)


def graph_tables(graph: Path, bundle: Bundle | None) -> GraphTables | None:
    """The tables `graph` names when it is one of `bundle`'s graphs (a copy elsewhere, prepacked or derived, holds
    its weights itself); None when it names none."""
    if bundle is None or not has_tables(bundle) or graph.parent.resolve() != bundle.path.resolve():
        return None
    recipe = _recipe(bundle)
    entries = _entries(recipe, graph.name)
    return GraphTables(entries, _tables_file(bundle, recipe), graph.name) if entries else None


def inference_session(
    graph: Path, options: ort.SessionOptions, providers: list[Any], bundle: Bundle | None
) -> ort.InferenceSession:
    """`ort.InferenceSession` on a graph of `bundle`, with the scale tables it names."""
    import onnxruntime as ort

    tables = graph_tables(graph, bundle)
    if tables is not None:
        tables.add_to(options)
    session = ort.InferenceSession(str(graph), sess_options=options, providers=providers)
    if tables is not None:
        session._onnxfn_tables = tables  # the map lives as long as the session
        tables.release_pages()
    return session
