"""`POST /v1/classify`: a sequence classifier's labels, in the shape of vLLM's classification API.

Request fields: `model`, `input` (a string or a list of strings; token-id lists as for /v1/embeddings),
`truncate_prompt_tokens` (as for /v1/embeddings), `user` (ignored). Inputs share forwards with concurrent
requests through the same length-grouping batcher as embeddings.

Response:

    {"object": "list", "model": ..., "labels": ["NEG", "NEU", "POS"],   # the order of every `probs`
     "data": [{"index": 0, "label": "POS", "score": 0.93, "probs": [0.02, 0.05, 0.93]}, ...],
     "usage": {"prompt_tokens": ..., "total_tokens": ...}}

`label` is the most probable label, `score` its probability, `probs` the softmax over all labels in the
model's `id2label` order (also given once as `labels`, so a client needs no other call to read them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.api.embeddings import check_model, encoder_engine, input_rows, run_rows
from runtime.api.fields import BodyReader
from runtime.api.service import ModelService

_FIELDS = frozenset(("model", "input", "user", "truncate_prompt_tokens"))


async def classification_body(state: ModelService, body: Any) -> dict[str, Any]:
    """The response object for a decoded request body (HTTP and the queue alike); client mistakes raise APIError."""
    engine = encoder_engine(state)
    reader = BodyReader(body, _FIELDS)
    check_model(reader, state)
    rows = input_rows(engine, reader, state)
    probabilities = await run_rows(engine, rows)
    labels = engine.facts.labels
    best = np.argmax(probabilities, axis=1)
    data = [
        {"index": i, "label": labels[int(top)], "score": float(probs[top]), "probs": probs.tolist()}
        for i, (top, probs) in enumerate(zip(best, probabilities, strict=True))
    ]
    tokens = sum(map(len, rows))
    return {"object": "list", "model": state.policy.model_name, "labels": list(labels), "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip
