"""Sequence classifiers (`task = "classification"`): their labels, and how far a candidate's probabilities drift.

The model is a Hugging Face `*ForSequenceClassification` encoder; its labels are its config's `id2label`,
in logit order. Candidates are measured the way embeddings are (`verify.py`), on the same fixed sentence
set through the runtime's own tokenizer and session: each sentence alone and inside a padded batch of 8
(as served), against the fp32 export's probabilities alone. The budget is top-1 label agreement and the
largest probability difference; counting the batched run in both catches a scheme whose answer depends on
a row's batch-mates (dynamic int8's per-tensor activation scales).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from packager.encoder.verify import run_rows, sentence_rows
from packager.errors import UserError
from packager.export.encoder import INPUT_NAMES, LOGITS_NAME
from runtime.bundle import EncoderFacts
from runtime.encoder.session import EncoderSession, EncoderSessionOptions, softmax
from runtime.encoder.tokenizer import EncoderTokenizer

CLASSIFIER_SUFFIX = "ForSequenceClassification"
MAX_PARITY_DELTA = 1e-4  # fp32 ONNX vs PyTorch probabilities: anything larger is a wrong export
METHOD = {
    "top1_agreement": "fraction of sentence runs (alone and in a padded batch of 8) whose top label is fp32's",
    "max_probability_delta": "largest |p - p_fp32| over every label of every sentence run",
    "batch_probability_delta": "largest change of a probability between a sentence alone and batched",
}


@dataclass(frozen=True)
class ClassifierConfig:
    labels: tuple[str, ...]
    max_tokens: int


def read_classifier_config(model_dir: Path) -> ClassifierConfig:
    """The labels and input limit of the `*ForSequenceClassification` model in `model_dir`."""
    config = _read_json(model_dir / "config.json")
    architectures = config.get("architectures") or []
    if not any(str(a).endswith(CLASSIFIER_SUFFIX) for a in architectures):
        raise UserError(
            f'{model_dir}/config.json names architectures {architectures}: model.task = "classification" needs a '
            f"Hugging Face *{CLASSIFIER_SUFFIX} model (saved with its classification head)",
            exit_code=2,
        )
    problem = config.get("problem_type")
    if problem not in (None, "single_label_classification"):
        raise UserError(
            f"{model_dir}/config.json has problem_type {problem!r}: onnxfn serves single-label classifiers "
            "(softmax over the labels) only",
            exit_code=2,
        )
    id2label: dict[str, Any] = config.get("id2label") or {}
    try:
        ordered = sorted((int(k), str(v)) for k, v in id2label.items())
    except ValueError as exc:
        raise UserError(f"{model_dir}/config.json: id2label keys must be label indices: {exc}") from exc
    if len(ordered) < 2 or [i for i, _ in ordered] != list(range(len(ordered))):
        raise UserError(
            f"{model_dir}/config.json: id2label must name labels 0..N-1 (N >= 2), got {id2label!r}", exit_code=2
        )
    limit = int(config["max_position_embeddings"])
    tokenizer_config = model_dir / "tokenizer_config.json"
    if tokenizer_config.is_file():
        # Tokenizers without a limit store a huge sentinel here (1e30): only a real one lowers the model's.
        limit = min(limit, int(_read_json(tokenizer_config).get("model_max_length") or limit))
    return ClassifierConfig(labels=tuple(label for _, label in ordered), max_tokens=limit)


def classifier_facts(hf_dir: Path, config: ClassifierConfig, precision: str) -> EncoderFacts:
    hf_config = _read_json(hf_dir / "config.json")
    return EncoderFacts(
        architecture=hf_config.get("model_type", "bert"),
        precision=precision,
        dimensions=len(config.labels),
        vocab_size=int(hf_config["vocab_size"]),
        max_tokens=config.max_tokens,
        pooling="none",
        normalize=False,
        input_names=INPUT_NAMES,
        output_name=LOGITS_NAME,
        pad_token_id=int(hf_config.get("pad_token_id") or 0),
        labels=config.labels,
    )


@dataclass(frozen=True)
class ClassificationBudget:
    min_top1_agreement: float = 0.95
    max_probability_delta: float = 0.05


@dataclass(frozen=True)
class ClassificationQuality:
    precision: str
    top1_agreement: float
    max_probability_delta: float
    mean_probability_delta: float  # mean over runs of each run's largest label difference
    batch_probability_delta: float
    model_bytes: int
    failures: tuple[str, ...]  # why it breaks the budget, with the numbers; empty when it passes

    @property
    def passes(self) -> bool:
        return not self.failures

    def figures(self) -> dict[str, str]:
        return {
            "top-1 agree": f"{self.top1_agreement:.3f}",
            "max Δp": f"{self.max_probability_delta:.4f}",
            "mean Δp": f"{self.mean_probability_delta:.4f}",
            "batch Δp": f"{self.batch_probability_delta:.4f}",
        }


@dataclass(frozen=True)
class ClassifierParity:
    """The fp32 ONNX classifier's probabilities against PyTorch's on the fixed sentence set."""

    sentences: int
    max_probability_delta: float
    top1_agreement: float

    def describe(self) -> str:
        return (
            f"fp32 ONNX vs PyTorch: max probability difference {self.max_probability_delta:.2e}, "
            f"top-1 agreement {self.top1_agreement:.3f} on {self.sentences} sentences"
        )

    def problem(self) -> str | None:
        if self.max_probability_delta <= MAX_PARITY_DELTA and self.top1_agreement == 1.0:
            return None
        return (
            f"the fp32 ONNX classifier's probabilities differ from PyTorch's (max difference "
            f"{self.max_probability_delta:.2e}, {MAX_PARITY_DELTA:.0e} allowed; top-1 agreement "
            f"{self.top1_agreement:.3f}); the export is wrong, not lossy"
        )


class ClassificationEvaluator:
    def __init__(self, reference_model: Path, tokenizer_path: Path, facts: EncoderFacts, *, threads: int = 2) -> None:
        self._options = EncoderSessionOptions(threads=threads)
        self._facts = facts
        self.rows = sentence_rows(EncoderTokenizer(tokenizer_path), facts.max_tokens)
        self.reference = run_rows(EncoderSession(reference_model, facts, self._options).classify, self.rows, 1)

    def evaluate(self, model_path: Path, precision: str, budget: ClassificationBudget) -> ClassificationQuality:
        session = EncoderSession(model_path, self._facts, self._options)
        alone = run_rows(session.classify, self.rows, 1)
        batched = run_rows(session.classify, self.rows)
        runs = np.concatenate([alone, batched])
        reference = np.concatenate([self.reference, self.reference])
        deltas = np.abs(runs.astype(np.float64) - reference).max(axis=1)
        agreement = float(np.mean(runs.argmax(axis=1) == reference.argmax(axis=1)))
        largest = float(deltas.max())
        return ClassificationQuality(
            precision=precision,
            top1_agreement=agreement,
            max_probability_delta=largest,
            mean_probability_delta=float(deltas.mean()),
            batch_probability_delta=float(np.abs(alone - batched).max()),
            model_bytes=model_path.stat().st_size,
            failures=_budget_failures(agreement, largest, budget),
        )

    def torch_parity(self, hf_dir: Path) -> ClassifierParity:
        """PyTorch's probabilities, each sentence alone (padding cannot hide a masking bug), vs fp32 ONNX's."""
        import torch
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(
            hf_dir, attn_implementation="eager", dtype=torch.float32
        ).eval()
        logits = []
        with torch.inference_mode():
            for row in self.rows:
                ids = torch.tensor([row])
                logits.append(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.numpy()[0])
        expected = softmax(np.stack(logits))
        deltas = np.abs(self.reference.astype(np.float64) - expected)
        agreement = float(np.mean(self.reference.argmax(axis=1) == expected.argmax(axis=1)))
        return ClassifierParity(len(self.rows), float(deltas.max()), agreement)


def _budget_failures(agreement: float, largest: float, budget: ClassificationBudget) -> tuple[str, ...]:
    # Written as `not (value within limit)` so that NaN, from a broken graph, fails every check.
    failures = []
    if not agreement >= budget.min_top1_agreement:
        failures.append(f"top-1 label agreement with fp32 {agreement:.3f} is below the minimum "
                        f"{budget.min_top1_agreement:.3f}")  # fmt: skip
    if not largest <= budget.max_probability_delta:
        failures.append(
            f"a label's probability moved {largest:.4f} from fp32's (alone or batched); the maximum is "
            f"{budget.max_probability_delta:.4f}"
        )
    return tuple(failures)


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise UserError(f"{path.parent} lacks {path.name}: a Hugging Face model folder is expected", exit_code=2)
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from exc
