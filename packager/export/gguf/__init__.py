"""Precision `gguf`: the fp32 export, computing with the source GGUF's own quantized blocks, cached.

The graph is the builder's fp32 graph (so it has the structure every other precision has); only its weights
change (rewrite.py). `gguf-weights.json` records, for every weight, the GGUF rows it carries.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import onnx

from packager.cache import cached_dir, digest_of, read_json, write_json
from packager.export.builder import DIGESTS_NAME, ExportOptions, ExportResult
from packager.export.gguf.rewrite import carry_gguf_weights
from runtime.bundle import file_digest

GGUF_EXPORT_VERSION = 5  # bump when the graph written here changes, to invalidate cached exports
CARRY_REPORT = "gguf-weights.json"
_MODEL = "model.onnx"
_BUILDER_FILES = ("model.onnx", "model.onnx.data", DIGESTS_NAME, "builder.log", ".complete")


def export_gguf(
    gguf_path: Path, source_key: str, reference: ExportResult, options: ExportOptions, max_positions: int
) -> ExportResult:
    """The `gguf` export of the model whose fp32 export is `reference` and whose source file is `gguf_path`, for
    sequences of at most `max_positions` tokens (the builder's rotary tables cover the model's whole context:
    Gemma 3's four are 67 MB for 32768 positions)."""
    key = digest_of("export-gguf", GGUF_EXPORT_VERSION, source_key, reference.key, asdict(options), max_positions)

    def produce(out: Path) -> None:
        model = onnx.load(str(reference.directory / _MODEL))
        weights, report = carry_gguf_weights(model, gguf_path, options.accuracy_level, max_positions)
        weights.save(model, out / _MODEL)
        del model, weights
        for path in sorted(reference.directory.iterdir()):
            if path.is_file() and path.name not in _BUILDER_FILES:
                shutil.copyfile(path, out / path.name)
        (out / CARRY_REPORT).write_text(json.dumps(report.to_json(), indent=1, sort_keys=True) + "\n")
        digests = {p.name: file_digest(p).__dict__ for p in sorted(out.iterdir())}
        write_json(out / DIGESTS_NAME, digests)

    directory, reused = cached_dir("export", key, produce)
    return ExportResult(directory, options, key, reused, read_json(directory / DIGESTS_NAME))
