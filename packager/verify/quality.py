"""Quality figures: how far a candidate's predictions drift from the fp32 reference's, and whether it may ship.

Both are teacher-forced on the same sequences (texts.py). On each prompt's answer: top-1 agreement, KL per
position, and whether every position's top-1 agrees (`greedy_match`: a greedy decode along that answer would
not leave it where fp32 would not); on the held-out text: perplexity. The fp32 reference itself proves its
export right against PyTorch (`parity`): the same top-1 at every answer position where PyTorch's top two are
further apart than fp32 rounding, and every probability within fp32 tolerance.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from packager.verify.texts import Sequences, load_prompts

QUALITY_FORMAT_VERSION = 2
# Two logits closer than this are a tie to fp32 arithmetic: PyTorch and ONNX Runtime may order them either way.
TIE_MARGIN = 1e-4


@dataclass(frozen=True)
class QualityBudget:
    min_top1_agreement: float = 0.95
    max_mean_kl: float = 0.02
    max_perplexity_increase_pct: float = 10.0


@dataclass(frozen=True)
class CandidateQuality:
    precision: str
    top1_agreement: float
    mean_kl: float
    max_kl: float
    perplexity: float
    perplexity_increase_pct: float
    greedy_match_prompts: int
    greedy_prompts: int
    failures: tuple[str, ...]  # why it breaks the budget, with the numbers; empty when it passes

    @property
    def passes(self) -> bool:
        return not self.failures


@dataclass(frozen=True)
class ReferenceParity:
    """The fp32 export against the PyTorch model, teacher-forced on the fixed prompts' answers."""

    prompts: int
    identical_greedy: int  # prompts whose every decided answer position has the same top-1
    first_divergence: list[int | None]  # per prompt: the first answer position whose top-1 differs, None if none
    max_probability_delta: float = 0.0  # largest |p_onnx - p_torch| over the answers' positions and vocabulary
    near_ties: int = 0  # positions where PyTorch's top two are within TIE_MARGIN (not held to the same top-1)


class Scores:
    """One system's predictions on the sequences: log-probabilities over each answer, the held-out targets'."""

    def __init__(self, sequences: Sequences) -> None:
        self.sequences = sequences
        self.answers: list[np.ndarray] = [np.empty(0)] * len(sequences.prompts)  # [positions, vocab] float32
        self.heldout: np.ndarray = np.empty(0)  # log p(next token), float64

    def keep(self, index: int, logits: np.ndarray) -> np.ndarray:
        """For `segments.run_sequences`: reduce one sequence's logits `[S, vocab]` to what the figures need."""
        window = self.sequences.scored(index)
        log_probs = log_softmax(logits[window])
        if index == len(self.sequences.prompts):
            targets = np.asarray(self.sequences.targets(index))
            self.heldout = log_probs[np.arange(len(targets)), targets]
        else:
            self.answers[index] = log_probs.astype(np.float32)
        return np.empty(0)

    @property
    def perplexity(self) -> float:
        return float(np.exp(-self.heldout.mean()))


def compare(candidate: Scores, reference: Scores, precision: str, budget: QualityBudget) -> CandidateQuality:
    agreeing = positions = greedy_matches = 0
    kl_per_position: list[np.ndarray] = []
    for ours, theirs in zip(candidate.answers, reference.answers, strict=True):
        if ours.shape[-1] != theirs.shape[-1]:
            raise ValueError(
                f"the candidate predicts over {ours.shape[-1]} tokens, the reference over {theirs.shape[-1]}"
            )
        reference_probs = np.exp(theirs.astype(np.float64))
        kl_per_position.append(np.sum(reference_probs * (theirs.astype(np.float64) - ours), axis=-1))
        same = ours.argmax(axis=-1) == theirs.argmax(axis=-1)
        agreeing += int(same.sum())
        positions += len(same)
        greedy_matches += int(same.all())
    kl = np.concatenate(kl_per_position)
    top1, mean_kl, max_kl = agreeing / positions, float(kl.mean()), float(kl.max())
    perplexity, reference_perplexity = candidate.perplexity, reference.perplexity
    increase_pct = (perplexity / reference_perplexity - 1.0) * 100.0
    return CandidateQuality(
        precision=precision,
        top1_agreement=top1,
        mean_kl=mean_kl,
        max_kl=max_kl,
        perplexity=perplexity,
        perplexity_increase_pct=increase_pct,
        greedy_match_prompts=greedy_matches,
        greedy_prompts=len(candidate.answers),
        failures=_budget_failures(top1, mean_kl, perplexity, increase_pct, reference_perplexity, budget),
    )


def parity(onnx_scores: Scores, torch_scores: Scores) -> ReferenceParity:
    divergences: list[int | None] = []
    delta = 0.0
    ties = 0
    for ours, theirs in zip(onnx_scores.answers, torch_scores.answers, strict=True):
        delta = max(delta, float(np.abs(np.exp(ours.astype(np.float64)) - np.exp(theirs.astype(np.float64))).max()))
        top2 = np.sort(theirs, axis=-1)[:, -2:]
        decided = (top2[:, 1] - top2[:, 0]) > TIE_MARGIN
        ties += int((~decided).sum())
        differs = (ours.argmax(axis=-1) != theirs.argmax(axis=-1)) & decided
        divergences.append(int(np.argmax(differs)) if differs.any() else None)
    identical = sum(d is None for d in divergences)
    return ReferenceParity(len(divergences), identical, divergences, delta, ties)


def write_quality_json(
    path: Path,
    parity: ReferenceParity | None,
    candidates: list[CandidateQuality],
    chosen: str,
    budget: QualityBudget,
    compared: list[CandidateQuality] | None = None,
    adapters: dict[str, Any] | None = None,
) -> None:
    """`compared`: figures measured beside the candidates for reference (quantize.YARDSTICK), never chosen.
    `adapters`: each LoRA adapter's own parity and quality (packager/adapters/build.py), by name."""
    report: dict[str, Any] = {
        "format_version": QUALITY_FORMAT_VERSION,
        "chosen": chosen,
        "budget": asdict(budget),
        "reference": "fp32",
        "torch_parity": asdict(parity) if parity is not None else None,
        "candidates": [candidate_json(candidate) for candidate in candidates],
        "compared": [candidate_json(candidate) for candidate in compared or []],
        **({"adapters": adapters} if adapters else {}),
        "method": {
            "prompts": len(load_prompts()),
            "kl": "KL(p_fp32 || p_candidate) per position of each prompt's fixed answer, both teacher-forced",
            "greedy_match": "prompts whose every answer position has fp32's top-1",
            "perplexity": "held-out plain text, every token after the first",
            "torch_parity": f"top-1 equal at every answer position where PyTorch's top two differ by > {TIE_MARGIN}",
        },
    }
    path.write_text(json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n")


def candidate_json(candidate: CandidateQuality) -> dict[str, Any]:
    """A candidate as quality.json holds it."""
    # JSON has no NaN or infinity; a broken candidate's non-numbers are written as null.
    fields = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in asdict(candidate).items()}
    return {**fields, "failures": list(candidate.failures), "passes": candidate.passes}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))  # type: ignore[no-any-return]


def _budget_failures(
    top1: float, mean_kl: float, perplexity: float, increase_pct: float, reference: float, budget: QualityBudget
) -> tuple[str, ...]:
    # Written as `not (value within limit)` so that NaN, from a broken graph, fails every check.
    failures = []
    if not top1 >= budget.min_top1_agreement:
        failures.append(f"top-1 agreement with fp32 {top1:.3f} is below the minimum {budget.min_top1_agreement:.3f}")
    if not mean_kl <= budget.max_mean_kl:
        failures.append(f"mean KL divergence from fp32 {mean_kl:.4f} is above the maximum {budget.max_mean_kl:.4f}")
    if not increase_pct <= budget.max_perplexity_increase_pct:
        failures.append(
            f"held-out perplexity {perplexity:.2f} is {increase_pct:+.1f}% vs fp32's {reference:.2f}, "
            f"above the maximum +{budget.max_perplexity_increase_pct:.1f}%"
        )
    return tuple(failures)
