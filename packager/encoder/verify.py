"""Embedding quality: how far a candidate's vectors drift from the fp32 export's, and whether it may ship.

The fp32 export first proves itself against PyTorch (`torch_parity`: cosine per sentence, each sentence
run alone through PyTorch so padding cannot hide a masking bug; ONNX runs them batched and padded).
Candidates are then compared with fp32 on the fixed sentence set: cosine similarity per sentence (mean
and minimum) and nearest-neighbour agreement (the fraction of sentences whose most similar other sentence
stays the same). Both sides run through the runtime's own tokenizer, session and pooling.

The server batches rows of concurrent requests into one forward, so a candidate must also give each row
the same vector alone as in a padded batch of others (`batch_cosine`). Dynamic int8 fails this: it
quantizes activations with one scale per tensor, computed over the whole batch, so a row's vector moved
with its batch-mates (cosine 0.94-0.97 on all-MiniLM-L6-v2); fp32 and MatMulNBits (per-row blocks) did not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from packager.encoder.sentences import SENTENCES
from runtime.bundle import EncoderFacts
from runtime.encoder.pooling import normalize, pool
from runtime.encoder.session import EncoderSession, EncoderSessionOptions
from runtime.encoder.tokenizer import EncoderTokenizer

EVAL_ROWS = 8  # rows per forward while measuring: padded batches, as served
MIN_PARITY_COSINE = 0.9999  # fp32 ONNX vs PyTorch: anything lower is a wrong export, not rounding
METHOD = {
    "cosine": "cosine similarity of each sentence's embedding to fp32's",
    "neighbour_agreement": "fraction of sentences whose most similar other sentence is fp32's",
    "batch_cosine": "lowest cosine between a sentence embedded alone and in a padded batch of 8",
}


@dataclass(frozen=True)
class EmbeddingBudget:
    min_mean_cosine: float = 0.99
    min_cosine: float = 0.97
    min_neighbour_agreement: float = 0.9
    min_batch_cosine: float = 0.9999


@dataclass(frozen=True)
class EmbeddingQuality:
    precision: str
    mean_cosine: float
    min_cosine: float
    neighbour_agreement: float
    batch_cosine: float  # lowest cosine between a row embedded alone and in a padded batch
    model_bytes: int
    failures: tuple[str, ...]  # why it breaks the budget, with the numbers; empty when it passes

    @property
    def passes(self) -> bool:
        return not self.failures

    def figures(self) -> dict[str, str]:
        """The measured figures, as `pkg build` shows them (column name → value)."""
        return {
            "mean cosine": f"{self.mean_cosine:.4f}",
            "min cosine": f"{self.min_cosine:.4f}",
            "neighbours": f"{self.neighbour_agreement:.3f}",
            "batch cos": f"{self.batch_cosine:.4f}",
        }


@dataclass(frozen=True)
class EncoderParity:
    """Cosine similarity of the fp32 ONNX embeddings to PyTorch's on the fixed sentence set."""

    sentences: int
    mean_cosine: float
    min_cosine: float

    def describe(self) -> str:
        return f"fp32 ONNX vs PyTorch: min cosine {self.min_cosine:.6f} on {self.sentences} sentences"

    def problem(self) -> str | None:
        """Why the export is wrong (not merely lossy), or None."""
        if self.min_cosine >= MIN_PARITY_COSINE:
            return None
        return (
            f"the fp32 ONNX export's embeddings differ from PyTorch's (lowest cosine {self.min_cosine:.6f} over "
            f"{self.sentences} sentences, {MIN_PARITY_COSINE} required); the export is wrong, not lossy"
        )


def sentence_rows(tokenizer: EncoderTokenizer, max_tokens: int) -> list[list[int]]:
    return [tokenizer.truncate(ids, max_tokens) for ids in tokenizer.encode(SENTENCES)]


def embed_rows(session: EncoderSession, rows: list[list[int]], per_forward: int = EVAL_ROWS) -> np.ndarray:
    return run_rows(session.embed, rows, per_forward)


def run_rows(
    head: Callable[[Sequence[Sequence[int]]], np.ndarray], rows: list[list[int]], per_forward: int = EVAL_ROWS
) -> np.ndarray:
    """`head` (a session's embed or classify) over `rows`, `per_forward` rows per padded forward."""
    return np.concatenate([head(rows[i : i + per_forward]) for i in range(0, len(rows), per_forward)])


class EmbeddingEvaluator:
    def __init__(self, reference_model: Path, tokenizer_path: Path, facts: EncoderFacts, *, threads: int = 2) -> None:
        self._facts = facts
        self._options = EncoderSessionOptions(threads=threads)
        self.rows = sentence_rows(EncoderTokenizer(tokenizer_path), facts.max_tokens)
        self.reference = embed_rows(EncoderSession(reference_model, facts, self._options), self.rows, 1)
        self._reference_neighbours = nearest_neighbours(self.reference)

    def evaluate(self, model_path: Path, precision: str, budget: EmbeddingBudget) -> EmbeddingQuality:
        session = EncoderSession(model_path, self._facts, self._options)
        vectors = embed_rows(session, self.rows, 1)
        batch_cosine = float(cosine_rows(vectors, embed_rows(session, self.rows)).min())
        cosines = cosine_rows(vectors, self.reference)
        agreement = float(np.mean(nearest_neighbours(vectors) == self._reference_neighbours))
        mean, low = float(cosines.mean()), float(cosines.min())
        return EmbeddingQuality(
            precision=precision,
            mean_cosine=mean,
            min_cosine=low,
            neighbour_agreement=agreement,
            batch_cosine=batch_cosine,
            model_bytes=model_path.stat().st_size,
            failures=budget_failures(mean, low, agreement, batch_cosine, budget),
        )

    def torch_parity(self, hf_dir: Path) -> EncoderParity:
        return torch_parity(hf_dir, self, self._facts)


def torch_parity(hf_dir: Path, evaluator: EmbeddingEvaluator, facts: EncoderFacts) -> EncoderParity:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
    vectors = []
    with torch.inference_mode():
        for row in evaluator.rows:
            ids = torch.tensor([row])
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state.numpy()
            vectors.append(pool(hidden, np.ones((1, len(row)), dtype=np.int64), facts.pooling)[0])
    expected = np.stack(vectors)
    expected = normalize(expected) if facts.normalize else expected
    cosines = cosine_rows(evaluator.reference, expected)
    return EncoderParity(sentences=len(cosines), mean_cosine=float(cosines.mean()), min_cosine=float(cosines.min()))


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return np.sum(a64 * b64, axis=1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))


def nearest_neighbours(vectors: np.ndarray) -> np.ndarray:
    """Per row, the index of the most cosine-similar other row."""
    unit = normalize(vectors.astype(np.float64))
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    return similarity.argmax(axis=1)


def budget_failures(
    mean: float, low: float, agreement: float, batch_cosine: float, budget: EmbeddingBudget
) -> tuple[str, ...]:
    # Written as `not (value within limit)` so that NaN, from a broken graph, fails every check.
    failures = []
    if not mean >= budget.min_mean_cosine:
        failures.append(f"mean cosine to fp32 {mean:.4f} is below the minimum {budget.min_mean_cosine:.4f}")
    if not low >= budget.min_cosine:
        failures.append(f"lowest cosine to fp32 {low:.4f} is below the minimum {budget.min_cosine:.4f}")
    if not agreement >= budget.min_neighbour_agreement:
        failures.append(
            f"nearest-neighbour agreement with fp32 {agreement:.3f} is below the minimum "
            f"{budget.min_neighbour_agreement:.3f}"
        )
    if not batch_cosine >= budget.min_batch_cosine:
        failures.append(
            f"a row's vector changes with its batch-mates (lowest cosine alone vs batched {batch_cosine:.4f}, "
            f"minimum {budget.min_batch_cosine:.4f}): batched serving would make embeddings depend on other requests"
        )
    return tuple(failures)
