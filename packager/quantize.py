"""Which precisions to try, in which order, and how `auto` picks one under the quality budget.

`auto` tries the most compressed scheme first and keeps the first that stays within the budget,
so a model that tolerates int4 gets int4 and one that does not (the demo: int4 re-quantized from
Q4_1 loses too much) falls back to int8, with the failing figures recorded in quality.json.
fp32 is the reference every candidate is measured against, so it always passes.
"""

from __future__ import annotations

from packager.export.builder import ExportOptions
from packager.spec import ExportSection
from packager.verify import QualityBudget

AUTO_ORDER = ("int4", "int8", "fp32")
# Quantization options do not apply to fp32: one canonical fp32 export serves as reference and candidate.
REFERENCE = ExportOptions("fp32")


def candidate_options(export: ExportSection) -> list[ExportOptions]:
    precisions = AUTO_ORDER if export.precision == "auto" else (export.precision,)
    return [
        REFERENCE
        if p == "fp32"
        else ExportOptions(p, block_size=export.block_size, accuracy_level=export.accuracy_level)
        for p in precisions
    ]


def budget_of(export: ExportSection) -> QualityBudget:
    quality = export.quality
    return QualityBudget(
        min_top1_agreement=quality.min_top1_agreement,
        max_mean_kl=quality.max_mean_kl,
        max_perplexity_increase_pct=quality.max_perplexity_increase_pct,
    )
