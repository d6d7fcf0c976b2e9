"""`pkg build functions/NAME`: export, quantize, verify and bundle; then print what was built."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from packager.build import BuildResult

from packager.decoder_facts import decoder_facts
from packager.progress import StepProgress, print_build_outcome
from packager.spec import FunctionSpec, load_spec

console = Console()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("build", help="export, quantize, verify and bundle a function")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: the build pulls in onnx and the exporter, which other commands never need.
    from packager.build import BuildResult, build_function

    spec = load_spec(args.function)
    progress = StepProgress()
    start = time.perf_counter()
    result = build_function(spec, progress)
    elapsed = time.perf_counter() - start
    if isinstance(result, BuildResult):
        _print_summary(result, progress, elapsed)
    else:  # an encoder task's build
        from packager.encoder.report import print_encoder_summary

        print_encoder_summary(result, progress, elapsed)
    if spec.image is not None:
        _build_image(spec, result.bundle, progress)
    return 0


def _build_image(spec: FunctionSpec, bundle: Path, progress: StepProgress) -> None:
    """The spec has an [image] section: also write the OCI image, and push it when a registry is set."""
    from packager.commands.image import print_image
    from packager.image import RegistryAuth, RegistryTarget, build_image

    assert spec.image is not None
    target = None
    if spec.image.registry:
        target = RegistryTarget.parse(spec.image.registry, auth=RegistryAuth.from_env())
    image = build_image(
        bundle, spec, platforms=tuple(spec.image.platforms), progress=progress, tag=spec.image.tag, push_to=target
    )
    print_image(spec.name, image)


def _print_summary(result: BuildResult, progress: StepProgress, elapsed: float) -> None:
    manifest = result.manifest
    facts = decoder_facts(manifest)
    size = sum(f.size for f in manifest.files.values())
    summary = Table(title=f"bundle {result.spec.name}", show_header=False)
    summary.add_row("path", str(result.bundle))
    summary.add_row("digest", manifest.digest)
    summary.add_row("precision", f"{result.chosen.precision} ({_why(result)})")
    summary.add_row("size", f"{size / 1e6:.1f} MB in {len(manifest.files)} files")
    summary.add_row(
        "model",
        f"{facts.architecture}, {facts.num_layers} layers, {facts.num_heads} heads / "
        f"{facts.num_kv_heads} KV heads, context {facts.context_length}, vocab {facts.vocab_size}",
    )
    fused = ("GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization")
    summary.add_row(
        "ops",
        ", ".join(f"{op} {result.ops[op]}" for op in fused if result.ops[op]) + f"; {sum(result.ops.values())} nodes",
    )
    from packager.export.gguf import CARRY_REPORT  # loaded by the build already

    if CARRY_REPORT in manifest.files:
        summary.add_row("gguf", _carried(json.loads((result.bundle / CARRY_REPORT).read_text())))
    parity = result.parity
    summary.add_row("parity", f"fp32 ONNX greedy = PyTorch on {parity.identical_greedy}/{parity.prompts} prompts")
    console.print(summary)

    quality = Table(title="quality against fp32 (budget: function.toml \\[export.quality])")
    for column in ("precision", "top-1 agree", "mean KL", "max KL", "ppl +%", "greedy match", "verdict"):
        quality.add_column(column, justify="left" if column == "verdict" else "right")
    for c in [*result.candidates, *result.compared]:
        verdict = "pass" if c.passes else "[red]fail[/]"
        if c in result.compared:
            verdict = "compared"
        quality.add_row(
            c.precision,
            f"{c.top1_agreement:.3f}",
            f"{c.mean_kl:.4f}",
            f"{c.max_kl:.3f}",
            f"{c.perplexity_increase_pct:+.2f}",
            f"{c.greedy_match_prompts}/{c.greedy_prompts}",
            "[green]chosen[/]" if c is result.chosen else verdict,
        )
    console.print(quality)
    print_build_outcome(console, result, progress, elapsed)


def _carried(report: dict[str, Any]) -> str:
    """How many GGUF tensors kept their own blocks (by type), and which graph weights stayed float32 and why."""
    types = ", ".join(f"{name} {count}" for name, count in report["gguf_types"].items())
    line = f"{sum(report['gguf_types'].values())} GGUF tensors kept exactly ({types})"
    kept = report["kept_float32"]
    if kept:
        reasons = sorted(set(kept.values()))
        line += f"; {len(kept)} kept float32: {'; '.join(reasons)}"
    return line


def _why(result: BuildResult) -> str:
    if result.spec.export.precision != "auto":
        return "set in function.toml"
    rejected = [c.precision for c in result.candidates if not c.passes]
    return (
        f"auto: {', '.join(rejected)} broke the quality budget" if rejected else "auto: most compressed within budget"
    )
