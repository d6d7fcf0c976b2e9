"""What `pkg build` prints for an encoder function: the bundle, the fused graph, and every candidate's quality."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from packager.encoder.build import EncoderBuildResult
from packager.progress import StepProgress, print_build_outcome

console = Console()
_FUSED = ("EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu", "FastGelu", "MatMulNBits")


def print_encoder_summary(result: EncoderBuildResult, progress: StepProgress, elapsed: float) -> None:
    manifest = result.manifest
    facts = manifest.encoder
    assert facts is not None
    size = sum(f.size for f in manifest.files.values())
    summary = Table(title=f"bundle {result.spec.name}", show_header=False)
    summary.add_row("path", str(result.bundle))
    summary.add_row("digest", manifest.digest)
    summary.add_row("precision", f"{result.chosen.precision} ({_why(result)})")
    summary.add_row("size", f"{size / 1e6:.1f} MB in {len(manifest.files)} files")
    if facts.labels:
        model = f"{facts.architecture} classifier, {len(facts.labels)} labels: {', '.join(facts.labels)}"
    else:
        model = (
            f"{facts.architecture} encoder, {facts.dimensions} dimensions, {facts.pooling} pooling"
            f"{' + L2 normalise' if facts.normalize else ''}"
        )
    summary.add_row("model", f"{model}, at most {facts.max_tokens} tokens")
    fused = [f"{name} {n}" for op in _FUSED for name, n in result.ops.items() if name in (op, "Q" + op)]
    summary.add_row("ops", f"{', '.join(fused)}; {sum(result.ops.values())} nodes (unfused: {result.unfused_nodes})")
    summary.add_row("parity", result.parity.describe())
    console.print(summary)

    quality = Table(title="quality against fp32 (budget: function.toml \\[export.quality])")
    for column in ("precision", *result.chosen.figures(), "MB", "verdict"):
        quality.add_column(column, justify="left" if column == "verdict" else "right")
    for c in result.candidates:
        verdict = "[green]chosen[/]" if c is result.chosen else ("pass" if c.passes else "[red]fail[/]")
        quality.add_row(c.precision, *c.figures().values(), f"{c.model_bytes / 1e6:.1f}", verdict)
    console.print(quality)
    print_build_outcome(console, result, progress, elapsed)


def _why(result: EncoderBuildResult) -> str:
    if result.spec.export.precision != "auto":
        return "set in function.toml"
    rejected = [c.precision for c in result.candidates[: result.candidates.index(result.chosen)]]
    return f"auto: {', '.join(rejected)} broke the quality budget" if rejected else "auto: fastest within budget"
