"""Which precisions to try, in which order, and how `auto` picks one under the quality budget.

`auto` tries the most compressed scheme first and keeps the first that stays within the budget. A GGUF
source is tried first as it is (`gguf`: its own blocks, no re-quantization, about the file's size), then
int4, int8 and fp32 re-quantized from it; a model that tolerates int4 gets int4, one that does not falls
back to int8, with the failing figures recorded in quality.json. fp32 is the reference every candidate
is measured against, so it always passes. When `auto` keeps `gguf`, int8 is measured beside it
(`YARDSTICK`): quality.json then shows what the user's own quantization costs against the best
re-quantization onnxfn would ship instead.

Measured and left out (demo model, 2 threads, this repo's quality method): int8 weights per channel
with int8 activations quantized at run time (`MatMulInteger`, which ONNX Runtime fuses into
`MatMulIntegerToFloat`). Its matmuls scale with the batch where the int8 `MatMulNBits` does not on
CPUs without int8 dot products: decode step 15-18 ms at batch 1, 57-68 ms at batch 8 against
16.3 / 97.5 ms, an 18-token prompt 66-83 ms against 180 ms. But quantizing the activations per tensor
(onnxruntime's `quantize_dynamic`) makes each row depend on the others in a batch (not batch
invariant), and per token (batch invariant, built from ONNX ops) misses the budget: top-1 0.87, mean
KL 0.10; with SmoothQuant scales folded into the norms at alpha 0.4-0.8, top-1 0.89-0.94, KL
0.019-0.038. Per-channel weights alone keep KL at 0.0044, so the loss is the activations' (one scale
per token, where `MatMulNBits` uses one per 32 channels).
"""

from __future__ import annotations

from packager.export.builder import ExportOptions
from packager.spec import ExportSection
from packager.verify import QualityBudget

AUTO_ORDER = ("int4", "int8", "fp32")
GGUF = "gguf"
YARDSTICK = "int8"
# Quantization options do not apply to fp32: one canonical fp32 export serves as reference and candidate.
REFERENCE = ExportOptions("fp32")


def candidate_options(export: ExportSection, gguf_source: bool) -> list[ExportOptions]:
    """The candidates in the order `pkg build` tries them; `gguf_source`: the model comes from a GGUF file."""
    first = (GGUF,) if gguf_source else ()
    precisions = first + AUTO_ORDER if export.precision == "auto" else (export.precision,)
    return [export_options(export, p) for p in precisions]


def yardstick_options(export: ExportSection, chosen: str, tried: list[str]) -> ExportOptions | None:
    """The candidate measured beside a `gguf` that `auto` kept, unless it was already tried."""
    if export.precision != "auto" or chosen != GGUF or YARDSTICK in tried:
        return None
    return export_options(export, YARDSTICK)


def export_options(export: ExportSection, precision: str) -> ExportOptions:
    if precision == "fp32":
        return REFERENCE
    return ExportOptions(precision, block_size=export.block_size, accuracy_level=export.accuracy_level)


def budget_of(export: ExportSection) -> QualityBudget:
    quality = export.quality
    return QualityBudget(
        min_top1_agreement=quality.min_top1_agreement,
        max_mean_kl=quality.max_mean_kl,
        max_perplexity_increase_pct=quality.max_perplexity_increase_pct,
    )
