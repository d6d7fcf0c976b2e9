"""Session fixtures: a tiny random Llama, its structure, its fp32 and int8 exports, a damaged export, a verifier."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from packager.export.builder import ExportOptions, ExportResult, StructureResult, export_decoder, export_structure
from packager.progress import StepProgress
from packager.sources import SourceModel, resolve_source
from packager.verify import Verifier
from tests.fixtures.tiny_llama import make_tiny_llama

# Noise of this size on every weight matrix (initialised with std 0.15) breaks every quality check.
DAMAGE_NOISE = 0.1
MAX_POSITIONS = 256


@dataclass(frozen=True)
class TinyExports:
    hf: Path
    source: SourceModel
    structure: StructureResult
    fp32: ExportResult
    int8: ExportResult
    damaged: Path  # the fp32 export with noise added to its weight matrices

    @property
    def chat_template(self) -> str:
        return (self.hf / "chat_template.jinja").read_text()


def damage_weights(export: Path, out: Path, noise: float) -> Path:
    """Copy an export, adding Gaussian noise to every 2-D weight initializer of its graph."""
    shutil.copytree(export, out)
    model = onnx.load(out / "model.onnx")
    rng = np.random.default_rng(0)
    for initializer in model.graph.initializer:
        weight = numpy_helper.to_array(initializer)
        if "weight" in initializer.name and weight.ndim == 2 and weight.dtype == np.float32:
            damaged = weight + rng.normal(0.0, noise, weight.shape).astype(np.float32)
            initializer.CopyFrom(numpy_helper.from_array(damaged, initializer.name))
    (out / "model.onnx.data").unlink()
    onnx.save(model, out / "model.onnx", save_as_external_data=True, location="model.onnx.data")
    return out


@pytest.fixture(scope="session")
def tiny_exports(tmp_path_factory: pytest.TempPathFactory) -> TinyExports:
    root = tmp_path_factory.mktemp("tiny_llama")
    hf = make_tiny_llama(root / "hf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONNXFN_CACHE_DIR", str(root / "cache"))
        source = resolve_source(f"hf:{hf}", root, StepProgress())
        structure = export_structure(source)
        fp32 = export_decoder(source, structure, ExportOptions("fp32"), MAX_POSITIONS)
        int8 = export_decoder(source, structure, ExportOptions("int8"), MAX_POSITIONS)
    damaged = damage_weights(fp32.directory, root / "damaged", DAMAGE_NOISE)
    return TinyExports(hf, source, structure, fp32, int8, damaged)


@pytest.fixture(scope="session")
def tiny_verifier(tiny_exports: TinyExports) -> Verifier:
    return Verifier(tiny_exports.structure, tiny_exports.source, MAX_POSITIONS)
