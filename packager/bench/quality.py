"""Quality of what each system runs, against the fp32 reference, by the packager's own method and budget.

onnxfn's bundle precision (`gguf` for a GGUF source) and the builder's int8 and int4 exports the
genai-int* systems run: top-1 agreement, mean and max KL, perplexity change (packager.verify). The
bundle's figures are the ones its build wrote to quality.json; an export's come from the packager's cache
(packager.build.cached_quality, as `pkg build` files them), so a figure any build already
measured is reused, and one measured here is there for the next run and the next build.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from packager.bench.models import GENAI_EXPORTS, REFERENCE_PRECISION, BenchModel
from packager.build import cached_quality
from packager.decoder_facts import decoder_facts
from packager.export.builder import ExportResult, StructureResult
from packager.quantize import budget_of
from packager.verify import ExportSystem, QualityBudget, Verifier, candidate_json
from runtime.bundle import read_manifest

FROM_BUNDLE = "the bundle's quality.json"
FROM_CACHE = "the packager's cache"
MEASURED = "measured by this run"


def measure(model: BenchModel) -> dict[str, Any]:
    """quality.json's layout (so one renderer reads both), a row per system with its figures' origin."""
    budget = budget_of(model.spec.export)
    evaluator = lazy_evaluator(model)
    built_path = model.bundle / "quality.json"
    built = json.loads(built_path.read_text()) if built_path.is_file() else {}
    precision = decoder_facts(read_manifest(model.bundle)).precision
    rows = [bundle_row(model, precision, built, budget, evaluator)]
    for system, export_precision in GENAI_EXPORTS.items():
        figures, origin = export_figures(model.exports[export_precision], model.structure, budget, evaluator)
        rows.append({**figures, "system": system, "origin": origin})
    return {
        "reference": REFERENCE_PRECISION,
        "chosen": precision,
        "budget": asdict(budget),
        "method": built.get("method", {}),
        "torch_parity": built.get("torch_parity"),
        "candidates": rows,
    }


def lazy_evaluator(model: BenchModel) -> Callable[[], Verifier]:
    """The verifier, made on first use only (its fp32 reference runs over every sequence when first compared)."""
    made: list[Verifier] = []

    def get() -> Verifier:
        if not made:
            made.append(Verifier(model.structure, model.source, model.spec.export.max_context))
        return made[0]

    return get


def bundle_row(
    model: BenchModel,
    precision: str,
    built: dict[str, Any],
    budget: QualityBudget,
    evaluator: Callable[[], Verifier],
) -> dict[str, Any]:
    """The bundle's own precision: its build's figures, or measured on the bundle's folder when it has none."""
    for row in [*built.get("candidates", []), *built.get("compared", [])]:
        if row.get("precision") == precision:
            return {**row, "system": "onnxfn", "origin": FROM_BUNDLE}
    figures = candidate_json(evaluator().evaluate(ExportSystem(model.bundle, precision), precision, budget))
    return {**figures, "system": "onnxfn", "origin": MEASURED}


def export_figures(
    export: ExportResult, structure: StructureResult, budget: QualityBudget, evaluator: Callable[[], Verifier]
) -> tuple[dict[str, Any], str]:
    precision = export.options.precision
    quality, reused = cached_quality(
        export.key, structure, budget,
        lambda: evaluator().evaluate(ExportSystem(export.directory, precision), precision, budget),
    )  # fmt: skip
    return candidate_json(quality), FROM_CACHE if reused else MEASURED
