"""Session fixtures: a tiny random Llama exported by the genai builder at fp32 and int8, plus a damaged export."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from packager.verify import QualityEvaluator
from tests.fixtures.tiny_llama import export_with_genai_builder, make_tiny_llama

# Noise of this size on every weight matrix (initialised with std 0.15) breaks every quality check.
DAMAGE_NOISE = 0.1


@dataclass(frozen=True)
class TinyExports:
    hf: Path
    fp32: Path
    int8: Path
    damaged: Path  # the fp32 export with noise added to its weight matrices

    @property
    def tokenizer(self) -> Path:
        return self.hf / "tokenizer.json"

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
    with ThreadPoolExecutor(max_workers=2) as pool:
        builds = {p: pool.submit(export_with_genai_builder, hf, root / p, p, root / "cache") for p in ("fp32", "int8")}
        fp32, int8 = builds["fp32"].result(), builds["int8"].result()
    return TinyExports(hf=hf, fp32=fp32, int8=int8, damaged=damage_weights(fp32, root / "damaged", DAMAGE_NOISE))


@pytest.fixture(scope="session")
def tiny_evaluator(tiny_exports: TinyExports) -> QualityEvaluator:
    return QualityEvaluator(tiny_exports.fp32, tiny_exports.tokenizer, tiny_exports.chat_template)
