"""Token embeddings → one vector per input, the way sentence-transformers' Pooling and Normalize modules do it."""

from __future__ import annotations

import numpy as np

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len")


def pool(token_embeddings: np.ndarray, mask: np.ndarray, mode: str) -> np.ndarray:
    """`[batch, tokens, dims]` and a 0/1 `[batch, tokens]` mask → `[batch, dims]` float32; padding never counts."""
    if mode == "cls":
        return token_embeddings[:, 0].astype(np.float32, copy=True)
    weights = mask[..., None].astype(np.float32)
    if mode == "max":
        return np.where(weights > 0, token_embeddings, -np.inf).max(axis=1).astype(np.float32)
    summed = (token_embeddings * weights).sum(axis=1)
    counts = np.maximum(weights.sum(axis=1), 1e-9)
    if mode == "mean":
        return summed / counts
    if mode == "mean_sqrt_len":
        return summed / np.sqrt(counts)
    raise ValueError(f"unknown pooling mode {mode!r}; expected one of {', '.join(POOLING_MODES)}")


def normalize(vectors: np.ndarray) -> np.ndarray:
    """Unit L2 norm per row (a zero row stays zero), as `torch.nn.functional.normalize`."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)
