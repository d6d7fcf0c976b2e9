"""`pkg build` for encoders (`task = "embedding"` or `"classification"`): source → fused fp32 export →
candidates under the quality budget → bundle.

The same machinery as the decoder build: every export and every figure is cached by the digest of its
inputs (`packager.cache`), progress goes through `StepProgress`, the budget comes from
`[export.quality]`, quality.json records every candidate, and the bundle is written atomically.
`auto` measures every candidate (seconds each) and keeps the first within budget in `AUTO_ORDER`.
The two tasks differ only in what `_Task` holds: the facts, the evaluator (cosine for embeddings,
label agreement and probability drift for classifiers) and its figures.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packager.bundle import reusable_bundle
from packager.cache import cached_json, digest_of
from packager.encoder import classifier, verify
from packager.encoder.bundle import TOKENIZER_FILE, encoder_facts, write_encoder_bundle
from packager.encoder.classifier import (
    ClassificationBudget,
    ClassificationEvaluator,
    ClassificationQuality,
    ClassifierParity,
    classifier_facts,
    read_classifier_config,
)
from packager.encoder.verify import EmbeddingBudget, EmbeddingEvaluator, EmbeddingQuality, EncoderParity
from packager.errors import UserError
from packager.export.encoder import EncoderExport, check_fused, export_encoder
from packager.export.encoder_quantize import quantize_encoder
from packager.paths import bundle_dir
from packager.progress import StepProgress
from packager.sources import resolve_source
from packager.sources.sentence_transformers import read_sentence_encoder_config
from packager.spec import FunctionSpec
from runtime.bundle import CLASSIFICATION_TASK, FORMAT_VERSION, EncoderFacts, Manifest, open_bundle

# Fastest first, among candidates worth their size. Measured on all-MiniLM-L6-v2, 2 threads: int8 (23 MB)
# and int8-mixed (33 MB) run at 1.1-1.8x fp32's sentences/s but fail the batch-invariance check;
# int8-nbits (67 MB) runs at 0.5-0.85x fp32 (90 MB) and starts no faster (1.53 vs 1.55 s), so `auto`
# skips it: it stays an explicit choice where bundle size is the limit.
AUTO_ORDER = ("int8", "int8-mixed", "fp32")
ENCODER_VERIFY_VERSION = 2  # bump when the measurement changes, to invalidate cached figures
QUALITY_FORMAT_VERSION = 1

Quality = EmbeddingQuality | ClassificationQuality
Parity = EncoderParity | ClassifierParity
Evaluator = EmbeddingEvaluator | ClassificationEvaluator


@dataclass(frozen=True)
class EncoderBuildResult:
    spec: FunctionSpec
    bundle: Path
    manifest: Manifest
    chosen: Quality
    candidates: list[Quality]
    parity: Parity
    ops: Counter[str]
    unfused_nodes: int
    bundle_reused: bool


@dataclass(frozen=True)
class _Task:
    """What differs between an embedding and a classification build."""

    facts: Callable[[str], EncoderFacts]  # precision → the manifest's facts
    budget: EmbeddingBudget | ClassificationBudget
    evaluator: type[EmbeddingEvaluator] | type[ClassificationEvaluator]
    quality: type[EmbeddingQuality] | type[ClassificationQuality]
    parity: type[EncoderParity] | type[ClassifierParity]
    method: dict[str, str]  # what each quality.json figure means


def _task(spec: FunctionSpec, hf_dir: Path) -> _Task:
    q = spec.export.quality
    if spec.model.task == CLASSIFICATION_TASK:
        labels = read_classifier_config(hf_dir)
        budget: EmbeddingBudget | ClassificationBudget = ClassificationBudget(
            q.min_top1_agreement, q.max_probability_delta
        )
        return _Task(lambda precision: classifier_facts(hf_dir, labels, precision), budget, ClassificationEvaluator,
                     ClassificationQuality, ClassifierParity, classifier.METHOD)  # fmt: skip
    config = read_sentence_encoder_config(hf_dir)
    return _Task(lambda precision: encoder_facts(hf_dir, config, precision), budget_of(spec), EmbeddingEvaluator,
                 EmbeddingQuality, EncoderParity, verify.METHOD)  # fmt: skip


def build_encoder_function(spec: FunctionSpec, progress: StepProgress) -> EncoderBuildResult:
    source = resolve_source(spec.model.source, spec.directory, progress)
    task = _task(spec, source.hf_dir)
    with progress.step("export fp32", "export fp32 ONNX (torch.onnx.export + ORT BERT fusions)") as step:
        reference = export_encoder(source.hf_dir, source.content_key, spec.model.task)
        if reference.reused:
            step.cached()
    facts = task.facts("fp32")
    tokenizer = source.hf_dir / TOKENIZER_FILE
    evaluator = _LazyEvaluator(task.evaluator, reference, tokenizer, facts)
    parity = _parity(source.hf_dir, task, reference, evaluator, progress)

    order = AUTO_ORDER if spec.export.precision == "auto" else (spec.export.precision,)
    exports = _exports(reference, order, progress)
    measured = [(export, _verify(export, reference, task, evaluator, progress)) for export in exports]
    candidates = [quality for _, quality in measured]
    chosen = next(((export, quality) for export, quality in measured if quality.passes), None)
    if chosen is None:
        raise UserError(_budget_failure(spec, candidates))
    export, quality = chosen

    quality_json = _quality_json(spec.model.task, parity, candidates, quality.precision, task)
    build_key = digest_of("encoder-bundle", FORMAT_VERSION, metadata.version("onnxfn"), spec.digest, export.key,
                          quality_json.decode())  # fmt: skip
    target = bundle_dir(spec)
    with progress.step("bundle", f"write and verify bundle {target}") as step:
        manifest = reusable_bundle(target, build_key)
        if manifest is not None:
            step.cached("inputs unchanged")
        else:
            chosen_facts = task.facts(quality.precision)
            write_encoder_bundle(spec, export.model_path, tokenizer, chosen_facts, quality_json, build_key, target)
            manifest = open_bundle(target).manifest
    ops = check_fused(export.model_path)
    unfused = int(reference.record()["unfused_nodes"])  # type: ignore[call-overload]
    return EncoderBuildResult(spec, target, manifest, quality, candidates, parity, ops, unfused, step.record.cached)


def budget_of(spec: FunctionSpec) -> EmbeddingBudget:
    q = spec.export.quality
    return EmbeddingBudget(q.min_mean_cosine, q.min_cosine, q.min_neighbour_agreement, q.min_batch_cosine)


class _LazyEvaluator:
    """Runs the sentence set through the fp32 reference only when a figure is not cached."""

    def __init__(self, kind: type[Evaluator], reference: EncoderExport, tokenizer: Path, facts: EncoderFacts) -> None:
        self._kind = kind
        self._args = (reference.model_path, tokenizer, facts)
        self._evaluator: Evaluator | None = None

    def get(self) -> Evaluator:
        if self._evaluator is None:
            self._evaluator = self._kind(*self._args)
        return self._evaluator


def _exports(reference: EncoderExport, order: tuple[str, ...], progress: StepProgress) -> list[EncoderExport]:
    exports = []
    for precision in order:
        if precision == "fp32":
            exports.append(reference)
            continue
        with progress.step(f"quantize {precision}", f"quantize the encoder to {precision}") as step:
            exports.append(quantize_encoder(reference, precision))
            if exports[-1].reused:
                step.cached()
    return exports


def _verify(
    export: EncoderExport,
    reference: EncoderExport,
    task: _Task,
    evaluator: _LazyEvaluator,
    progress: StepProgress,
) -> Quality:
    precision, budget = export.precision, task.budget
    with progress.step(f"verify {precision}", f"verify {precision} against fp32") as step:
        key = digest_of("encoder-quality", ENCODER_VERIFY_VERSION, export.key, reference.key, asdict(budget))
        data, reused = cached_json(
            "quality",
            key,
            lambda: asdict(evaluator.get().evaluate(export.model_path, precision, budget)),  # type: ignore[arg-type]
        )
        if reused:
            step.cached()
    return task.quality(**{**data, "failures": tuple(data["failures"])})


def _parity(
    hf_dir: Path, task: _Task, reference: EncoderExport, evaluator: _LazyEvaluator, progress: StepProgress
) -> Parity:
    with progress.step("parity", "check the fp32 ONNX export against PyTorch") as step:
        data, reused = cached_json(
            "parity",
            digest_of("encoder-parity", ENCODER_VERIFY_VERSION, reference.key),
            lambda: asdict(evaluator.get().torch_parity(hf_dir)),
        )
        if reused:
            step.cached()
    parity = task.parity(**data)
    problem = parity.problem()
    if problem is not None:
        raise UserError(problem)
    return parity


def _quality_json(task_name: str, parity: Parity, candidates: list[Quality], chosen: str, task: _Task) -> bytes:
    report: dict[str, Any] = {
        "format_version": QUALITY_FORMAT_VERSION,
        "task": task_name,
        "chosen": chosen,
        "budget": asdict(task.budget),
        "reference": "fp32",
        "torch_parity": asdict(parity),
        "candidates": [{**asdict(c), "failures": list(c.failures), "passes": c.passes} for c in candidates],
        "method": {"sentences": parity.sentences, **task.method},
    }
    return (json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def _budget_failure(spec: FunctionSpec, candidates: list[Quality]) -> str:
    lines = [f"no candidate precision of {spec.name} stays within the quality budget:"]
    for c in candidates:
        figures = ", ".join(f"{name} {value}" for name, value in c.figures().items())
        lines.append(f"  {c.precision}: {figures} -> {'; '.join(c.failures)}")
    lines.append("loosen [export.quality] in function.toml or choose a less compressed export.precision")
    return "\n".join(lines)
