"""`pkg build`: source → structure → candidates under the quality budget → verified bundle.

The builder runs once, on a weightless model, for the graph's structure (export/structure.py); every precision
is then written from it and the source one tensor at a time, and verified against an fp32 reference computed a
few layers at a time (verify/), so a build's memory is bounded by its largest layer, not by the model. Every
expensive result (the structure, each export, each quality evaluation) is cached by the digest of its inputs,
so an unchanged rebuild only re-checks the bundle.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path

import numpy as np

from packager.adapters.build import (
    AdapterQuality,
    DeclaredAdapter,
    check_declared,
    graph_plan,
    layout_for,
    read_declared,
    verify_adapters,
)
from packager.adapters.build import quality_json as adapter_quality_json
from packager.bundle import BundledAdapters, BundleInputs, decoder_facts_of, reusable_bundle, write_bundle
from packager.cache import cached_json, digest_of
from packager.encoder.build import EncoderBuildResult, build_encoder_function
from packager.errors import UserError
from packager.export.builder import (
    CARRY_REPORT,
    ExportOptions,
    ExportResult,
    StructureResult,
    check_architecture,
    export_decoder,
    export_key,
    export_structure,
)
from packager.export.gguf.experts import requantized_experts
from packager.export.graph import check_decoder_graph
from packager.export.lora import LORA_GRAPH_VERSION
from packager.export.materialize import Rewrite
from packager.export.prefill import PREFILL_GRAPH_VERSION
from packager.paths import bundle_dir
from packager.progress import StepProgress
from packager.quantize import GGUF, budget_of, candidate_options, export_options, yardstick_options
from packager.snapshot import SNAPSHOT_VERSION
from packager.sources import SourceModel, resolve_source
from packager.spec import ENCODER_TASKS, FunctionSpec
from packager.verify import (
    CandidateQuality,
    ExportSystem,
    QualityBudget,
    ReferenceParity,
    System,
    Verifier,
    write_quality_json,
)
from runtime.adapters.layout import AdapterLayout
from runtime.bundle import FORMAT_VERSION, Manifest, file_digest, open_bundle

VERIFY_VERSION = 6  # bump when the quality method changes, to invalidate cached figures


@dataclass(frozen=True)
class BuildResult:
    spec: FunctionSpec
    bundle: Path
    manifest: Manifest
    chosen: CandidateQuality
    candidates: list[CandidateQuality]
    compared: list[CandidateQuality]  # measured beside the chosen one, not candidates (quantize.YARDSTICK)
    parity: ReferenceParity
    ops: Counter[str]
    bundle_reused: bool
    adapters: list[AdapterQuality] = field(default_factory=list)  # each [[adapters]] entry's figures


def build_function(spec: FunctionSpec, progress: StepProgress) -> BuildResult | EncoderBuildResult:
    if spec.model.task in ENCODER_TASKS:
        return build_encoder_function(spec, progress)
    source = resolve_source(spec.model.source, spec.directory, progress)
    if spec.export.precision == GGUF and source.gguf_file is None:
        raise UserError(
            f"export.precision = 'gguf' keeps a GGUF file's own quantization, but model.source = "
            f"{spec.model.source!r} is a model folder; use a gguf: source, or precision auto, int8, int4 or fp32",
            exit_code=2,
        )
    max_context = spec.export.max_context
    architecture = check_architecture(source.hf_dir, max_context)
    with progress.step("structure", "export the graph's structure (onnxruntime-genai builder, no weights)") as step:
        structure = export_structure(source)
        if structure.reused:
            step.cached()
    verifier = Verifier(structure, source, max_context, graph=_reference(source, structure, spec, progress))
    parity = _parity(structure, verifier, progress)
    budget = budget_of(spec.export)

    candidates: list[CandidateQuality] = []
    chosen: tuple[ExportResult, CandidateQuality, Counter[str]] | None = None
    for options in candidate_options(spec.export, gguf_source=source.gguf_file is not None):
        export = _export(source, structure, options, max_context, progress)
        ops = check_decoder_graph(export.directory / "model.onnx", options.precision)
        quality = _verify(
            export.key, verifier, budget, partial(verifier.export_system, export), progress, options.precision
        )
        candidates.append(quality)
        if quality.passes:
            chosen = (export, quality, ops)
            break
    if chosen is None:
        raise UserError(_budget_failure(spec, candidates))

    export, quality, ops = chosen
    compared = []
    yardstick = yardstick_options(spec.export, quality.precision, [c.precision for c in candidates])
    if yardstick is not None:
        # Measured beside, never shipped: made in memory a few layers at a time, not written.
        key = export_key(structure, yardstick, max_context)
        compared.append(
            _verify(key, verifier, budget, lambda: verifier.system(yardstick), progress, yardstick.precision)
        )
    adapters = _adapters(spec, source, architecture, structure, export, budget, progress)
    with tempfile.TemporaryDirectory() as tmp:
        quality_path = Path(tmp) / "quality.json"
        figures = adapter_quality_json(adapters[2]) if adapters is not None else None
        write_quality_json(quality_path, parity, candidates, quality.precision, budget, compared, figures)
        quality_json = quality_path.read_bytes()
    build_key = digest_of(
        "bundle", FORMAT_VERSION, metadata.version("onnxfn"), spec.digest, export.key, quality_json,
        SNAPSHOT_VERSION, metadata.version("onnxruntime"),  # the snapshot's KV is valid for one ORT version
        PREFILL_GRAPH_VERSION,
        (LORA_GRAPH_VERSION, adapters[0].to_json()) if adapters is not None else None,
        [a.digest for a in adapters[1]] if adapters is not None else None,
    )  # fmt: skip
    target = bundle_dir(spec)
    with progress.step("bundle", f"write and verify bundle {target}") as step:
        manifest = reusable_bundle(target, build_key)
        if manifest is not None:
            step.cached("inputs unchanged")
        else:
            inputs = BundleInputs(
                spec,
                export.directory,
                export.digests,
                source.hf_dir,
                architecture,
                quality.precision,
                quality_json,
                build_key,
                BundledAdapters(adapters[0], adapters[1]) if adapters is not None else None,
            )
            write_bundle(inputs, target)
            manifest = open_bundle(target).manifest
    return BuildResult(
        spec, target, manifest, quality, candidates, compared, parity, ops, bundle_reused=step.record.cached,
        adapters=adapters[2] if adapters is not None else [],
    )  # fmt: skip


def _adapters(
    spec: FunctionSpec,
    source: SourceModel,
    architecture: str,
    structure: StructureResult,
    export: ExportResult,
    budget: QualityBudget,
    progress: StepProgress,
) -> tuple[AdapterLayout, list[DeclaredAdapter], list[AdapterQuality]] | None:
    """The function's LoRA adapters: the graph's layout, each adapter read and checked, and each one's figures."""
    if not spec.adapters and not spec.export.adapter_modules:
        return None
    facts = decoder_facts_of(spec, export.directory, source.hf_dir, architecture, export.options.precision)
    declared = read_declared(spec, facts, progress)
    plan = graph_plan(spec, declared)
    assert plan is not None  # modules come from the adapters or from export.adapter_modules
    layout = layout_for(export.directory / "model.onnx", facts, *plan)
    check_declared(declared, layout)
    results = verify_adapters(declared, source, structure, export, layout, budget, spec.export.max_context, progress)
    return layout, declared, results


def _verify(
    key: str,
    verifier: Verifier,
    budget: QualityBudget,
    system: Callable[[], System],
    progress: StepProgress,
    precision: str,
) -> CandidateQuality:
    """The quality of the export whose key is `key` (run as `system()` when not cached)."""
    with progress.step(f"verify {precision}", f"verify {precision} against fp32, a few layers at a time") as step:
        quality, reused = cached_quality(
            key, verifier.structure, budget, lambda: verifier.evaluate(system(), precision, budget, step.update)
        )
        if reused:
            step.cached()
    return quality


def cached_quality(
    key: str, structure: StructureResult, budget: QualityBudget, measure: Callable[[], CandidateQuality]
) -> tuple[CandidateQuality, bool]:
    """The quality of the export whose key is `key` against `structure`'s fp32 reference under `budget`:
    `(figures, reused)`, `measure`d only when no build or bench filed them yet (packager/bench/quality.py reads the
    same entries)."""
    entry = digest_of("quality", VERIFY_VERSION, key, structure.key, asdict(budget))
    data, reused = cached_json("quality", entry, lambda: asdict(measure()))
    return CandidateQuality(**{**data, "failures": tuple(data["failures"])}), reused


def _export(
    source: SourceModel, structure: StructureResult, options: ExportOptions, max_context: int, progress: StepProgress
) -> ExportResult:
    what = {
        "gguf": f"carry {source.gguf_file.name if source.gguf_file else 'the GGUF'}'s own blocks into the graph",
        "fp32": "write the fp32 graph's weights",
    }.get(options.precision, f"quantize the graph's weights to {options.precision}")
    with progress.step(f"export {options.precision}", f"{what}, one tensor at a time") as step:
        result = export_decoder(source, structure, options, max_context)
        if result.reused and not _intact(result):
            # A bundle shares the export's weights file (a hard link): one edited in place edits both.
            shutil.rmtree(result.directory)
            result = export_decoder(source, structure, options, max_context)
        if result.reused:
            step.cached()
    return result


def _intact(export: ExportResult) -> bool:
    """Whether the cached export's weights still hash as they did when written."""
    recorded = export.digests.get("model.onnx.data")
    return recorded is None or file_digest(export.directory / "model.onnx.data").sha256 == recorded["sha256"]


def _reference(
    source: SourceModel, structure: StructureResult, spec: FunctionSpec, progress: StepProgress
) -> System | None:
    """The fp32 reference: for a GGUF, its `gguf` export computing in float32 (MatMulNBits at accuracy level 0 on the
    file's own blocks: the dequantized model, with no float copy of a weight and no dequantizing in Python); for a
    model folder (None) the structure's fp32 graph, each weight read from the folder. Experts the carry re-quantized
    (a block minimum QMoE has no place for) compute with the file's values, read from the source by name."""
    if source.gguf_file is None:
        return None
    export = _export(source, structure, export_options(spec.export, GGUF), spec.export.max_context, progress)
    requantized = requantized_experts(json.loads((export.directory / CARRY_REPORT).read_text()))
    rewrite = Rewrite(structure.structure, source.weights(), spec.export.max_context)

    def float_experts(packed: str) -> np.ndarray | None:
        weight = requantized.get(packed)
        return None if weight is None else rewrite.weight(weight)

    return ExportSystem(export.directory, "fp32", accuracy_level=0, float_experts=float_experts)


def _parity(structure: StructureResult, verifier: Verifier, progress: StepProgress) -> ReferenceParity:
    key = digest_of("parity", VERIFY_VERSION, structure.key, verifier.max_positions, verifier.reference_name)

    def measure() -> dict[str, object]:
        with progress.step(
            "reference", "run the fp32 reference over the quality texts, a few layers at a time"
        ) as step:
            verifier.reference(step.update)
        with progress.step("parity", "check the fp32 reference against PyTorch, one weight in memory at a time"):
            return asdict(verifier.parity())

    data, reused = cached_json("parity", key, measure)
    if reused:
        with progress.step("parity", "check the fp32 reference against PyTorch") as step:
            step.cached()
    parity = ReferenceParity(**data)
    if parity.identical_greedy != parity.prompts:
        raise UserError(
            f"the fp32 ONNX export disagrees with PyTorch on {parity.prompts - parity.identical_greedy} of "
            f"{parity.prompts} prompts (first divergences: {parity.first_divergence}); the export is wrong, not lossy"
        )
    return parity


def _budget_failure(spec: FunctionSpec, candidates: list[CandidateQuality]) -> str:
    lines = [f"no candidate precision of {spec.name} stays within the quality budget:"]
    for c in candidates:
        lines.append(
            f"  {c.precision}: top-1 {c.top1_agreement:.3f}, mean KL {c.mean_kl:.4f}, "
            f"perplexity +{c.perplexity_increase_pct:.1f}% -> {'; '.join(c.failures)}"
        )
    lines.append("loosen [export.quality] in function.toml or choose a less compressed export.precision")
    return "\n".join(lines)
