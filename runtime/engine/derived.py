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

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.bundle import Bundle
from runtime.engine.recipes import RECIPE_SUFFIX, work_directory, write_data
from runtime.engine.tables import bundle_files
from runtime.verified import file_identity

RECORD = "derived.json"
FORMAT = 1
log = logging.getLogger("runtime.engine")


def recipe_name(graph: str) -> str:
    return graph + RECIPE_SUFFIX


def default_directory(bundle: Bundle) -> Path:
    """`$ONNXFN_STATE_DIR/derived/DIGEST`, one directory per bundle (recipes.work_directory says where else)."""
    return work_directory() / bundle.manifest.digest.removeprefix("sha256:")[:32]


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
            write_data(recipe, bundle_files(bundle), partial, recipe_name(name))
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
