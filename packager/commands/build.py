"""`pkg build functions/NAME`: export, quantize, verify and bundle; then print what was built.

`--json` prints one object on stdout instead of the tables (progress stays on stderr): the bundle's path,
digest, size and precision, every candidate's quality figures, the steps, and the image when one is built.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from packager.build import BuildResult
    from packager.encoder.build import EncoderBuildResult
    from packager.image.build import ImageResult

from packager.decoder_facts import decoder_facts
from packager.progress import StepProgress, print_build_outcome
from packager.sources import locate_source
from packager.sources.task_fit import check_source_fits_task
from packager.spec import FunctionSpec, load_spec, spec_table
from packager.spec_reference import spec_keys
from runtime.engine.heap import bound_heap

console = Console()
# Model facts the JSON result leaves out: the runtime's wiring, not figures about the model.
_INTERNAL_FACTS = ("chat_template", "io", "input_names", "output_name")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("build", help="export, quantize, verify and bundle a function")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument(
        "--json", action="store_true", help="print the result as one JSON object on stdout (progress on stderr)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    bound_heap()  # first: before the export's and the reference pass's threads exist
    # Imported here: the build pulls in onnx and the exporter, which other commands never need.
    from packager.build import BuildResult, build_function

    spec = load_spec(args.function)
    # A source the task cannot serve is refused here, naming both keys, before anything is dequantized.
    check_source_fits_task(spec.model.source, locate_source(spec.model.source, spec.directory), spec.model.task)
    progress = StepProgress()
    start = time.perf_counter()
    result = build_function(spec, progress)
    elapsed = time.perf_counter() - start
    if args.json:
        report = build_report(result, progress, elapsed)
        if spec.image is not None:
            report["image"] = _image_report(_build_image(spec, result.bundle, progress))
        print(json.dumps(report, indent=2, default=str))
        return 0
    if isinstance(result, BuildResult):
        _print_summary(result, progress, elapsed)
    else:  # an encoder task's build
        from packager.encoder.report import print_encoder_summary

        print_encoder_summary(result, progress, elapsed)
    if spec.image is not None:
        from packager.commands.image import print_image

        print_image(spec.name, _build_image(spec, result.bundle, progress))
    return 0


def _build_image(spec: FunctionSpec, bundle: Path, progress: StepProgress) -> ImageResult:
    """The spec has an [image] section: also write the OCI image, and push it when a registry is set."""
    from packager.image import RegistryAuth, RegistryTarget, build_image

    assert spec.image is not None
    target = None
    if spec.image.registry:
        target = RegistryTarget.parse(spec.image.registry, auth=RegistryAuth.from_env())
    return build_image(
        bundle, spec, platforms=tuple(spec.image.platforms), progress=progress, tag=spec.image.tag, push_to=target
    )


def build_report(result: BuildResult | EncoderBuildResult, progress: StepProgress, elapsed: float) -> dict[str, Any]:
    """What `pkg build --json` prints: the same facts as the tables, as values."""
    from packager.build import BuildResult

    spec, manifest = result.spec, result.manifest
    facts = manifest.model or manifest.encoder
    compared = result.compared if isinstance(result, BuildResult) else []
    budget_keys = {key.key.rsplit(".", 1)[-1] for key in spec_keys() if key.key.startswith("export.quality.")
                   and key.applies_to(spec.model.task)}  # fmt: skip
    budget = {key: value for key, value in spec_table(spec.export.quality).items() if key in budget_keys}
    return {
        "function": spec.name,
        "task": manifest.task,
        "bundle": str(Path(result.bundle).resolve()),
        "bundle_reused": result.bundle_reused,
        "digest": manifest.digest,
        "size_bytes": sum(f.size for f in manifest.files.values()),
        "files": len(manifest.files),
        "precision": result.chosen.precision,
        "precision_from": "function.toml" if spec.export.precision != "auto" else "auto",
        "model": {k: v for k, v in asdict(facts).items() if k not in _INTERNAL_FACTS} if facts else None,
        "parity": asdict(result.parity),
        "quality": {
            "budget": budget,
            "candidates": [
                {**asdict(c), "passes": c.passes, "chosen": c is result.chosen, "compared_only": False}
                for c in result.candidates
            ]
            + [{**asdict(c), "passes": c.passes, "chosen": False, "compared_only": True} for c in compared],
        },
        "adapters": [asdict(a) for a in result.adapters] if isinstance(result, BuildResult) else [],
        # peak_rss_bytes: the largest resident memory of the build's whole process tree sampled during the step
        "steps": [
            {"name": r.name, "seconds": round(r.seconds, 3), "cached": r.cached, "peak_rss_bytes": r.peak_rss}
            for r in progress.records
        ],
        "seconds": round(elapsed, 3),
        "image": None,
    }


def _image_report(image: ImageResult) -> dict[str, Any]:
    push = image.push
    return {
        "layout": str(image.layout),
        "tag": image.tag,
        "index_digest": image.index_digest,
        "manifests": image.manifests,
        "pushed_to": push.reference if push is not None else None,
    }


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
    from packager.export.builder import CARRY_REPORT  # loaded by the build already

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
    if result.adapters:
        console.print(_adapter_table(result))
    print_build_outcome(console, result, progress, elapsed)


def _adapter_table(result: BuildResult) -> Table:
    table = Table(title='LoRA adapters (served as model "FUNCTION:NAME"; docs/adapters.md)')
    for column in ("name", "rank", "modules", "MB", "parity (fp32 + adapter = PyTorch + PEFT)", "top-1", "mean KL"):
        table.add_column(column, justify="left" if column in ("name", "modules") else "right")
    for a in result.adapters:
        table.add_row(
            f"{result.spec.name}:{a.name}",
            str(a.rank),
            ", ".join(a.modules),
            f"{a.bytes / 1e6:.2f}",
            f"{a.parity.identical_greedy}/{a.parity.prompts} prompts",
            f"{a.quality.top1_agreement:.3f}",
            f"{a.quality.mean_kl:.4f}",
        )
    return table


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
