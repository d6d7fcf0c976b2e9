"""What the bench runs for a model: the function's bundle, GGUF, HF folder and builder exports from its one
source, each export's own footprint, and quality figures shared with `pkg build`'s cache (no timing here)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import onnx
import pytest
from onnx import TensorProto, helper

from packager.bench import footprint, models, quality
from packager.bench.models import BenchModel, ModelUnavailable
from packager.bench.systems.base import SystemConfig
from packager.build import _verify
from packager.export.builder import ExportOptions, ExportResult, StructureResult
from packager.progress import StepProgress
from packager.quantize import budget_of
from packager.sources import SourceModel, locate_source
from packager.spec import load_spec
from packager.verify import CandidateQuality, QualityBudget
from runtime.bundle import FileEntry

REPO = Path(__file__).resolve().parents[2]


def fake_export(directory: Path, precision: str, key: str = "") -> ExportResult:
    return ExportResult(directory, ExportOptions(precision), key or f"key-{precision}", reused=True, digests={})


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_every_model_is_a_function_built_from_a_gguf(name: str) -> None:
    spec = load_spec(models.function_dir(REPO, name))
    assert spec.model.source.endswith(".gguf")  # llama.cpp runs that same file


def test_the_model_comes_from_its_own_source_with_the_functions_export_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every artifact follows from the function's source: no guess among cached folders of other models."""
    gguf, hf_dir, bundle = tmp_path / "model.gguf", tmp_path / "hf", tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")
    sources: list[str] = []

    def resolve_source(source: str, function_dir: Path, progress: StepProgress) -> SourceModel:
        sources.append(source)
        return SourceModel(hf_dir=hf_dir, origin=source, content_key="content", reused=True, gguf_file=gguf)

    structure = StructureResult(tmp_path / "structure", "structure-key", True)

    def export_decoder(
        source: SourceModel, of: StructureResult, options: ExportOptions, max_positions: int
    ) -> ExportResult:
        assert (source.hf_dir, source.content_key, of) == (hf_dir, "content", structure)
        return ExportResult(tmp_path / options.precision, options, f"key-{options.precision}", True, {})

    def dequantized_folder(file: Path, key: str, source: str, progress: StepProgress, tokenizer_from: Path) -> tuple:
        assert file == gguf
        return hf_dir / "fp32", key, True

    monkeypatch.setattr(models, "resolve_source", resolve_source)
    monkeypatch.setattr(models, "export_structure", lambda source: structure)
    monkeypatch.setattr(models, "export_decoder", export_decoder)
    monkeypatch.setattr(models, "dequantized_folder", dequantized_folder)
    monkeypatch.setattr(models, "file_digest", lambda path: FileEntry("0" * 64, 0))
    model = models.resolve(REPO, "gemma3", bundle)

    spec = load_spec(REPO / "functions" / "gemma3-completion")
    assert sources == [spec.model.source]
    assert (model.gguf, model.hf_dir, model.bundle, model.structure) == (gguf, hf_dir / "fp32", bundle, structure)
    assert {p: e.options for p, e in model.exports.items()} == {
        "int8": ExportOptions("int8", spec.export.block_size, spec.export.accuracy_level),
        "int4": ExportOptions("int4", spec.export.block_size, spec.export.accuracy_level),
    }
    assert model.system_bundle("genai-int8") == tmp_path / "int8"
    assert model.system_bundle("genai-int4") == tmp_path / "int4"
    assert model.system_bundle("genai") == model.system_bundle("onnxfn") == bundle


def test_a_model_folder_source_or_a_folder_that_is_no_bundle_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ModelUnavailable, match="is not a bundle: it has no manifest.json"):
        models.resolve(REPO, "smollm2", tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    folder = SourceModel(hf_dir=tmp_path, origin="folder", content_key="k", reused=False)
    monkeypatch.setattr(models, "resolve_source", lambda *_: folder)
    with pytest.raises(ModelUnavailable, match="a model folder: llama.cpp needs a GGUF source"):
        models.resolve(REPO, "smollm2", tmp_path)


def test_a_user_facing_failure_exits_with_one_bench_line() -> None:
    pytest.importorskip("aiohttp")  # without it the bench stops at once, with the same kind of line
    bench = [sys.executable, str(REPO / "scripts" / "bench.py"), "--bundle", "/nonexistent", "--sections", "decode"]
    completed = subprocess.run(bench, capture_output=True, text=True, check=False, timeout=120)
    assert completed.returncode == 1
    assert completed.stderr.strip() == "bench: --bundle /nonexistent is not a bundle: it has no manifest.json"


def test_a_builder_export_counts_its_own_files_and_its_kv_type(tmp_path: Path) -> None:
    past = helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT16, ["b", 2, "t", 8])
    out = helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT16, ["b", 2, "t", 8])
    graph = helper.make_graph([helper.make_node("Identity", [past.name], [out.name])], "g", [past], [out])
    onnx.save(helper.make_model(graph), str(tmp_path / "model.onnx"))
    decoder = {
        "filename": "model.onnx",
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "head_size": 8,
        "inputs": {"past_key_names": "past_key_values.%d.key"},
    }
    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"decoder": decoder}}))
    sizes = {"model.onnx": 300, "model.onnx.data": 5000, "tokenizer.json": 700, "genai_config.json": 100}
    export = replace(fake_export(tmp_path, "int4"), digests={n: {"sha256": "x", "size": s} for n, s in sizes.items()})
    artifact = footprint.export_artifact(export)
    assert (artifact.weights_bytes, artifact.total_bytes) == (5300, 6100)
    assert artifact.kv_bytes_per_token == 2 * 3 * 2 * 8 * 2  # key and value, per layer, float16
    assert artifact.label == "genai export (int4)"


def test_llamas_server_is_asked_never_to_end_a_stream() -> None:
    """It has no ignore_eos: every token it would stop at is banned instead, or a stream could end early."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("aiohttp")
    from packager.bench.systems.server import llamacpp_server  # it imports the aiohttp client of the server figures

    spec = load_spec(models.function_dir(REPO, "smollm2"))
    located = locate_source(spec.model.source, spec.directory)
    assert not isinstance(located, Path)  # one GGUF file, not a model folder
    config = SystemConfig("llamacpp-server", "bundle", str(located.paths[0]), "", 2, 8, sys.executable)
    # SmolLM2's <|endoftext|> and <|im_end|>, and one more llama.cpp takes for an end of turn
    assert llamacpp_server(config).extra_body == {"logit_bias": {"0": -100, "2": -100, "4": -100}}


class StubEvaluator:
    """Stands in for the Verifier: records what it measures, returns fixed figures."""

    measured: ClassVar[list[str]] = []
    structure = StructureResult(Path("structure"), "structure-key", True)

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def evaluate(self, system: Any, precision: str, budget: QualityBudget, *_: Any) -> CandidateQuality:
        StubEvaluator.measured.append(precision)
        return CandidateQuality(precision, 0.9, 0.01, 0.2, 30.0, 1.0, 2, 8, failures=("top-1 0.900 < 0.95",))


def test_quality_reuses_the_bundles_and_the_builds_figures_and_measures_only_the_rest(
    demo_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONNXFN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(quality, "Verifier", StubEvaluator)
    StubEvaluator.measured = []
    spec = load_spec(REPO / "functions" / "smollm2-chat")
    exports = {p: fake_export(tmp_path / p, p) for p in ("int8", "int4")}
    source = SourceModel(tmp_path / "hf", "source", "content", True, tmp_path / "model.gguf")
    model = BenchModel(
        "smollm2", spec, demo_bundle, tmp_path / "model.gguf", tmp_path / "hf", exports, source, StubEvaluator.structure
    )

    # As `pkg build` files a figure it measured (its own code, its own key): here int8's.
    verifier: Any = StubEvaluator()
    _verify(exports["int8"].key, verifier, budget_of(spec.export), lambda: None, StepProgress(), "int8")  # type: ignore[arg-type,return-value]
    assert StubEvaluator.measured == ["int8"]

    figures = quality.measure(model)
    built = json.loads((demo_bundle / "quality.json").read_text())
    rows = {row["system"]: row for row in figures["candidates"]}
    assert list(rows) == ["onnxfn", "genai-int8", "genai-int4"]
    assert rows["onnxfn"]["origin"] == quality.FROM_BUNDLE
    assert rows["onnxfn"]["mean_kl"] == built["candidates"][0]["mean_kl"]
    assert rows["genai-int8"]["origin"] == quality.FROM_CACHE
    assert rows["genai-int4"]["origin"] == quality.MEASURED
    assert rows["genai-int4"]["passes"] is False and rows["genai-int4"]["failures"] == ["top-1 0.900 < 0.95"]
    assert StubEvaluator.measured == ["int8", "int4"]  # int8 came from the build's cache entry
    assert figures["chosen"] == built["chosen"] and figures["method"] == built["method"]
    assert quality.measure(model)["candidates"][2]["origin"] == quality.FROM_CACHE  # filed for the next run
