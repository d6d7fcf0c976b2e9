"""Export a decoder LLM: the structure once (the builder on a weightless model), then each precision from it.

The builder emits the fused graph we serve (GroupQueryAttention with rotary embedding inside,
SkipSimplifiedLayerNormalization). It runs once per source, in a subprocess (it imports torch and prints a
lot; its log is kept beside the structure), on a module tree without weights (structure.py): seconds and a few
hundred MB whatever the model's size. Each precision is then written from that structure and the source,
tensor by tensor (materialize.py), so an export never holds more than one weight in memory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packager.cache import cached_dir, digest_of, read_json, write_json
from packager.errors import UserError
from packager.export.architectures import architecture_of
from packager.export.external_data import WeightFile
from packager.export.graph import drop_dead_nodes
from packager.export.materialize import RECIPES_FILE, STRUCTURE_FILE, BlockQuantized, Float32, Rewrite, Structure
from packager.export.structure_process import OFFLINE, run_shared
from packager.sources import SourceModel
from runtime.bundle import file_digest

STRUCTURE_VERSION = 4  # bump when the structure step changes meaning, to invalidate cached structures
EXPORT_VERSION = 6  # bump when the options below or the graphs they make change meaning, to invalidate cached exports
LOG_NAME = "builder.log"
DIGESTS_NAME = "digests.json"
CARRY_REPORT = "gguf-weights.json"
MODEL_FILE = "model.onnx"
_NOT_COPIED = {STRUCTURE_FILE, STRUCTURE_FILE + ".data", RECIPES_FILE, LOG_NAME, ".complete", DIGESTS_NAME}


@dataclass(frozen=True)
class ExportOptions:
    precision: str  # fp32 | int8 | int4 | gguf
    block_size: int = 32
    accuracy_level: int = 4
    # `is_symmetric=false` produced a model that does not load here (FIELD-NOTES), so it is not offered.


@dataclass(frozen=True)
class StructureResult:
    directory: Path  # structure.onnx (+ its small .data), weights.json, genai_config.json, tokenizer files
    key: str
    reused: bool

    @property
    def structure(self) -> Structure:
        return Structure(self.directory)


@dataclass(frozen=True)
class ExportResult:
    directory: Path  # model.onnx, model.onnx.data, genai_config.json, tokenizer files
    options: ExportOptions
    key: str
    reused: bool
    digests: dict[str, dict[str, int | str]]  # file name -> {sha256, size}


def check_architecture(hf_dir: Path, max_context: int | None = None) -> str:
    """The model type of the folder's decoder, refused here (with the reason) when onnxfn cannot build it (into a
    bundle of `max_context` positions, when given)."""
    config = json.loads((hf_dir / "config.json").read_text())
    return architecture_of(config, f"{hf_dir}/config.json", max_context).model_type


def export_structure(source: SourceModel) -> StructureResult:
    """The builder's fp32 graph of `source` without its weights, and each weight's recipe (cached)."""
    key = digest_of("structure", STRUCTURE_VERSION, source.content_key, metadata.version("onnxruntime-genai"))
    directory, reused = cached_dir("structure", key, lambda out: _run_builder(source, out))
    return StructureResult(directory, key, reused)


def precision_rewrite(structure: Structure, source: SourceModel, options: ExportOptions, max_positions: int) -> Any:
    """The rewrite that makes `options.precision`'s graph from the structure (materialize.py)."""
    rewrite = Rewrite(structure, source.weights(), max_positions)
    if options.precision == "fp32":
        return Float32(rewrite)
    if options.precision in ("int8", "int4"):
        return BlockQuantized(rewrite, int(options.precision[3:]), options.block_size, options.accuracy_level)
    if options.precision == "gguf":
        from packager.export.gguf.carry import GgufCarry

        return GgufCarry(rewrite, options.accuracy_level)
    raise ValueError(f"unknown precision {options.precision!r}")


def export_key(structure: StructureResult, options: ExportOptions, max_positions: int) -> str:
    """What an export's figures are filed under (also for one only measured, never written)."""
    return digest_of("export", EXPORT_VERSION, structure.key, asdict(options), max_positions)


def export_decoder(
    source: SourceModel, structure: StructureResult, options: ExportOptions, max_positions: int
) -> ExportResult:
    """`options.precision`'s graph and weights file, written one weight at a time (cached)."""
    key = export_key(structure, options, max_positions)

    def produce(out: Path) -> None:
        model = structure.structure.model
        rewrite = precision_rewrite(structure.structure, source, options, max_positions)
        weights = WeightFile(out / MODEL_FILE)
        try:
            nodes = rewrite.nodes(list(model.graph.node), weights)
        except BaseException:
            weights.discard()
            raise
        written = type(model)()
        written.CopyFrom(model)
        del written.graph.node[:]
        written.graph.node.extend(nodes)
        drop_dead_nodes(written.graph)
        weights.save(written)
        if options.precision == "gguf":
            report = rewrite.report.to_json()
            (out / CARRY_REPORT).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
        for path in sorted(structure.directory.iterdir()):
            if path.is_file() and path.name not in _NOT_COPIED:
                _link_or_copy(path, out / path.name)
        digests = {p.name: file_digest(p).__dict__ for p in sorted(out.iterdir())}
        write_json(out / DIGESTS_NAME, digests)

    directory, reused = cached_dir("export", key, produce)
    return ExportResult(directory, options, key, reused, read_json(directory / DIGESTS_NAME))


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem
        shutil.copyfile(source, target)


def _run_builder(source: SourceModel, out: Path) -> None:
    cache = out / ".builder-cache"
    # Sliding-window layers get a full-length KV cache like every other layer (GroupQueryAttention's
    # `local_window_size` still windows their attention): the runtime binds one
    # `[slots, kv_heads, max_context, head_dim]` buffer per layer, and its prefix cache and
    # snapshots index that buffer by position, which a window-sized ring cannot offer.
    arguments = ["-i", str(source.hf_dir), "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(cache)]
    arguments += ["--weights", json.dumps(source.weights().describe()), "--extra_options", "windowed_kv_cache=false"]
    log_path = out.parent / f"{out.name}.{LOG_NAME}"
    log_path.write_text("")
    env = {**os.environ, **OFFLINE}  # the builder must read only the local folder, never reach for a hub
    returncode = run_shared(arguments, env, log_path)  # a session exporting many models shares the imports
    if returncode is None:
        with log_path.open("w") as log:
            command = [sys.executable, "-m", "packager.export.structure", *arguments]
            returncode = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode
    log_text = log_path.read_text(errors="replace")
    log_path.unlink()
    (out / LOG_NAME).write_text(log_text)
    shutil.rmtree(cache, ignore_errors=True)
    if returncode != 0 or not (out / STRUCTURE_FILE).is_file():
        tail = "\n".join(log_text.splitlines()[-15:])
        raise UserError(f"the ONNX export failed (exit {returncode}); builder log tail:\n{tail}")
