"""Every dense architecture that llama.cpp converts and onnxfn reads from GGUF, built from a GGUF with its blocks.

For each twin (cases_dense.GGUF_TWINS): the tiny model of the published config is written as llama.cpp's converter
writes it and quantized to a Q4_K_M-like mix (Q8_0, Q4_K, Q6_K; tests/fixtures/hf_to_gguf.py), then `pkg build` at
precision `gguf` must keep every weight in the file's own blocks (no float copy: `kept_float32` empty, each
carried weight read back from the bundle's operators equal to the file's dequantized rows) and its fp32 reference
(those blocks computed in float32) must agree with transformers reading the same GGUF (top-1 at every answer
position of the 8 prompts, probabilities within 1e-4).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from packager.export.architectures import ARCHITECTURES
from tests.architectures.cases import Case
from tests.architectures.cases_dense import DENSE_CASES, GGUF_SIZES, GGUF_TWINS
from tests.architectures.conftest import Builds, make_model

TWINS = [
    dataclasses.replace(case, name=f"{case.name}-gguf", shrink={**case.shrink, **GGUF_SIZES, **GGUF_TWINS[case.name]})
    for case in DENSE_CASES
    if case.name in GGUF_TWINS
]
# Random blocks are no language model: the budget only has to admit the int8 activations' rounding.
SPEC = """[export]
precision = "gguf"
max_context = 256
[export.quality]
min_top1_agreement = 0.5
max_mean_kl = 1.0
max_perplexity_increase_pct = 100.0
"""


def _build(case: Case, builds: Builds) -> tuple[Path, dict[str, str], Path]:
    from packager.build import build_function
    from packager.progress import StepProgress
    from packager.spec import load_spec
    from tests.fixtures.hf_to_gguf import hf_to_gguf
    from tests.packager.conftest import write_function

    folder = builds.root / case.name
    hf = make_model(case, folder / "hf")
    gguf_path = folder / "gguf" / f"{case.name}.gguf"
    gguf_path.parent.mkdir(parents=True)
    types = hf_to_gguf(hf, gguf_path)
    function = write_function(folder, case.name, f"gguf:{gguf_path}", SPEC)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONNXFN_CACHE_DIR", str(builds.cache))
        patch.chdir(folder)
        result = build_function(load_spec(function), StepProgress())
    return gguf_path, types, folder / result.bundle


def _close_to_fp32_rounding(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal up to a few float32 roundings of the row's largest weight (a block minimum's residual adds two)."""
    scale = np.abs(expected).max(axis=-1, keepdims=True) + np.float32(1e-30)
    assert np.all(np.abs(actual - expected) <= 4 * np.finfo(np.float32).eps * scale), np.abs(actual - expected).max()


@pytest.mark.parametrize("case", TWINS, ids=lambda c: c.name)
def test_a_gguf_of_the_architecture_builds_with_its_blocks_and_parity(case: Case, builds: Builds) -> None:
    from tests.fixtures.gguf_bundle import BundleWeights, GgufSource

    gguf_path, types, bundle_dir = _build(case, builds)
    assert {"Q8_0", "Q4_K", "Q6_K"} <= set(types.values()), types
    parity = json.loads((bundle_dir / "quality.json").read_text())["torch_parity"]
    assert parity["identical_greedy"] == parity["prompts"] == 8, parity
    assert parity["max_probability_delta"] < 1e-4, parity

    weights, source = BundleWeights(bundle_dir), GgufSource(gguf_path)
    assert weights.report["kept_float32"] == {}
    carried = {run["tensor"] for c in weights.report["carried"].values() for run in c["runs"]}
    assert carried == {name for name, qtype in types.items() if qtype not in ("F32", "F16")}
    for node, entry in weights.report["carried"].items():
        _close_to_fp32_rounding(weights.rows(node), source.rows(entry["runs"]))


def test_the_registry_marks_each_twins_architecture_exact() -> None:
    exact = {entry.hf_class for entry in ARCHITECTURES if entry.exact_gguf}
    assert {case.hf_class for case in TWINS} <= exact
