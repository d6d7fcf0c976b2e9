"""Which model a run benches, and every artifact each system loads for it, all from the function's one source.

The GGUF file llama.cpp runs and the fp32 HF folder transformers runs come from the packager's own
source resolution (the content-addressed cache `pkg build` fills), so two cached models never mix. The
onnxruntime-genai peers run the int8 and int4 exports of that same source (the builder's graph, quantized as
its own int8/int4 exports are), with the function's block size and accuracy level: the exports `pkg build`
itself measures quality on, cached the same way.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packager.export.builder import ExportResult, StructureResult, export_decoder, export_structure
from packager.paths import bundle_dir
from packager.progress import StepProgress
from packager.quantize import export_options
from packager.sources import SourceModel, resolve_source
from packager.sources.gguf import dequantized_folder
from packager.spec import FunctionSpec, load_spec
from runtime.bundle import file_digest

# --model -> the function folder under functions/
MODELS = {"smollm2": "smollm2-chat", "gemma3": "gemma3-completion"}
# genai systems that run a builder export instead of onnxfn's bundle -> the export's precision
GENAI_EXPORTS = {"genai-int8": "int8", "genai-int4": "int4"}
REFERENCE_PRECISION = "fp32"


class ModelUnavailable(RuntimeError):
    """The model cannot be benched as asked (no GGUF source, the build failed); the message says why."""


@dataclass(frozen=True)
class BenchModel:
    name: str
    spec: FunctionSpec
    bundle: Path
    gguf: Path
    hf_dir: Path  # the whole model as an fp32 Hugging Face folder (transformers' baseline runs it)
    exports: dict[str, ExportResult]  # precision (int8, int4) -> the export of the source the genai peers run
    source: SourceModel
    structure: StructureResult

    def system_bundle(self, system: str) -> Path:
        """The folder a system loads: its own export for a genai-int* system, onnxfn's bundle for the others."""
        precision = GENAI_EXPORTS.get(system)
        return self.exports[precision].directory if precision else self.bundle


def function_dir(repo: Path, model: str) -> Path:
    return repo / "functions" / MODELS[model]


def resolve(repo: Path, model: str, bundle: Path | None) -> BenchModel:
    """`model`'s function, its bundle (`bundle`, else built by `pkg build` if missing), GGUF, HF folder, exports."""
    spec = load_spec(function_dir(repo, model))
    if bundle is None:
        bundle = build_bundle(repo, spec)
    elif not (bundle / "manifest.json").is_file():
        raise ModelUnavailable(f"--bundle {bundle} is not a bundle: it has no manifest.json")
    progress = StepProgress()
    source = resolve_source(spec.model.source, spec.directory, progress)
    if source.gguf_file is None:
        raise ModelUnavailable(
            f"{spec.directory} has model.source = {spec.model.source!r}, a model folder: llama.cpp needs a GGUF source"
        )
    structure = export_structure(source)
    max_context = spec.export.max_context
    exports = {
        precision: export_decoder(source, structure, export_options(spec.export, precision), max_context)
        for precision in GENAI_EXPORTS.values()
    }
    sha256 = file_digest(source.gguf_file).sha256
    hf_dir, _, _ = dequantized_folder(source.gguf_file, sha256, spec.model.source, progress,
                                      tokenizer_from=source.gguf_file.parent)  # fmt: skip
    return BenchModel(model, spec, bundle, source.gguf_file, hf_dir, exports, source, structure)


def build_bundle(repo: Path, spec: FunctionSpec) -> Path:
    """The function's bundle under `repo`, built first by `pkg build` (its own progress and errors) if missing."""
    bundle = repo / bundle_dir(spec)
    if not (bundle / "manifest.json").is_file():
        command = [sys.executable, "-m", "packager.cli", "build", str(spec.directory)]
        built = subprocess.run(command, cwd=repo, check=False)
        if built.returncode != 0:
            raise ModelUnavailable(
                f"`pkg build {spec.directory}` failed (exit {built.returncode}); fix the build or pass --bundle"
            )
    return bundle
