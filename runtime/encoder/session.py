"""The encoder's ONNX Runtime session: one padded forward over a group of token-id rows, one vector per row.

An embedding graph outputs token embeddings, pooled (and normalised) here; a classifier's graph pools
itself and outputs logits, turned into label probabilities here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from runtime.bundle import EncoderFacts
from runtime.encoder.pooling import normalize, pool
from runtime.engine.providers import plan_providers


@dataclass(frozen=True)
class EncoderSessionOptions:
    threads: int = 2
    providers: tuple[str, ...] = ("cpu",)
    # Flushing denormals to zero changes no embedding here and made a padded 32x256 batch ~1.3x faster.
    denormal_as_zero: bool = True


class EncoderSession:
    def __init__(self, model_path: Path, facts: EncoderFacts, options: EncoderSessionOptions) -> None:
        plan = plan_providers(options.providers, ort.get_available_providers(), model_path.parent)
        so = ort.SessionOptions()
        so.intra_op_num_threads = options.threads
        so.inter_op_num_threads = 1
        # Spinning threads steal the only other core from tokenization and HTTP on a 2-core machine.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.set_denormal_as_zero", "1" if options.denormal_as_zero else "0")
        providers = list(zip(plan.names, plan.options, strict=True))
        self._session = ort.InferenceSession(str(model_path), sess_options=so, providers=providers)
        self._facts = facts
        missing = set(facts.input_names) - {i.name for i in self._session.get_inputs()}
        if missing:
            raise ValueError(f"{model_path} lacks the inputs its manifest names: {', '.join(sorted(missing))}")

    def embed(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """`[len(rows), dimensions]` float32 embeddings; rows are right-padded to the longest one only."""
        hidden, mask = self._forward(rows)
        vectors = pool(hidden, mask, self._facts.pooling)
        return normalize(vectors) if self._facts.normalize else vectors

    def classify(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """`[len(rows), labels]` float32 probabilities (softmax of the classifier's logits)."""
        logits, _ = self._forward(rows)
        return softmax(logits)

    def _forward(self, rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """The graph's output and the padding mask, rows right-padded to the longest one only."""
        width = max(map(len, rows))
        ids = np.full((len(rows), width), self._facts.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        (output,) = self._session.run([self._facts.output_name], {n: feeds[n] for n in self._facts.input_names})
        return output, mask


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    return (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
