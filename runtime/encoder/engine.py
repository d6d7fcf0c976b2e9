"""The encoder engine: an encoder bundle's session, tokenizer and batcher behind one small interface.

It is what the HTTP server holds in place of the decoder `Engine` when the bundle's task is `embedding`
or `classification` (`stats()` and `shutdown()` have the same meaning). The batcher runs the bundle's
head: pooled embeddings, or label probabilities for a classifier.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.bundle import CLASSIFICATION_TASK, Bundle, BundleError, EncoderFacts
from runtime.encoder.batcher import LengthBatcher
from runtime.encoder.session import EncoderSession, EncoderSessionOptions
from runtime.encoder.tokenizer import EncoderTokenizer


@dataclass(frozen=True)
class EncoderConfig:
    threads: int = 2
    providers: tuple[str, ...] = ("cpu",)
    max_rows: int = 8  # rows per forward
    max_queue: int = 64  # requests waiting before 429
    denormal_as_zero: bool = True

    @property
    def max_batch(self) -> int:
        """What the queue worker reads as the engine's capacity (the decoder's slots): rows per forward."""
        return self.max_rows


@dataclass(frozen=True)
class EncoderStats:
    """The `EngineStats` attributes the Prometheus collector reads; an encoder keeps no KV cache."""

    queued: int
    running: int
    tokens_in: int
    steps: int
    last_batch_size: int
    padded_tokens: int
    tokens_out: int = 0
    kv_used_bytes: int = 0
    kv_capacity_bytes: int = 0
    prefix_cache_bytes: int = 0
    prefix_hits: int = 0


class EncoderEngine:
    def __init__(self, bundle: Bundle, config: EncoderConfig) -> None:
        facts = bundle.manifest.encoder
        if facts is None:
            raise BundleError(f"{bundle.path} is a {bundle.manifest.task} bundle, not an encoder one")
        self.facts: EncoderFacts = facts
        self.task = bundle.manifest.task
        self.config = config
        self.tokenizer = EncoderTokenizer(bundle.tokenizer_path)
        options = EncoderSessionOptions(config.threads, config.providers, config.denormal_as_zero)
        self.session = EncoderSession(bundle.model_path, facts, options)
        head = self.session.classify if self.task == CLASSIFICATION_TASK else self.session.embed
        self._batcher = LengthBatcher(head, max_rows=config.max_rows, max_queue=config.max_queue)

    def embed(self, rows: list[list[int]]) -> Future[np.ndarray]:
        """Token-id rows (special tokens included, each within `facts.max_tokens`) → `[len(rows), dims]`:
        embeddings, or a classifier's label probabilities."""
        return self._batcher.submit(rows)

    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Blocking convenience for tools and tests; long texts are cut to the model's limit."""
        rows = [self.tokenizer.truncate(ids, self.facts.max_tokens) for ids in self.tokenizer.encode(texts)]
        return self.embed(rows).result()

    def stats(self) -> EncoderStats:
        s = self._batcher.stats()
        return EncoderStats(
            queued=s.queued_rows,
            running=s.queued_requests,
            tokens_in=s.tokens,
            steps=s.forwards,
            last_batch_size=s.last_batch_size,
            padded_tokens=s.padded_tokens,
        )

    def shutdown(self) -> None:
        self._batcher.close()


def start_encoder(bundle_dir: Path, config: EncoderConfig, *, verify: bool = True) -> EncoderEngine:
    """Open (and unless told otherwise verify) an embedding or classification bundle and start its engine."""
    from runtime.bundle import open_bundle
    from runtime.verified import open_verified

    bundle = open_verified(bundle_dir)[0] if verify else open_bundle(bundle_dir, verify=False)
    return EncoderEngine(bundle, config)
