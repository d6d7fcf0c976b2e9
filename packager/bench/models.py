"""Which model a run benches, and every artifact each system loads for it, all from the function's one source.

The GGUF file llama.cpp runs and the fp32 HF folder transformers runs come from the packager's own
source resolution (the content-addressed cache `pkg build` fills), so two cached models never mix. The
onnxruntime-genai peers run the builder's int8 and int4 exports of that same source, with the function's
block size and accuracy level: the exports `pkg build` itself measures quality on, cached the same way.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packager.export.builder import ExportResult, export_decoder
from packager.paths import bundle_dir
from packager.progress import StepProgress
from packager.quantize import export_options
from packager.sources import resolve_source
from packager.spec import FunctionSpec, load_spec

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
    hf_dir: Path
    exports: dict[str, ExportResult]  # precision (fp32, int8, int4) -> the builder's export of the source

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
    exports = {
        precision: export_decoder(source.hf_dir, source.content_key, export_options(spec.export, precision))
        for precision in (REFERENCE_PRECISION, *GENAI_EXPORTS.values())
    }
    return BenchModel(model, spec, bundle, source.gguf_file, source.hf_dir, exports)


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
