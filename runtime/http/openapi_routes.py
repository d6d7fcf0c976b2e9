"""Which OpenAPI route pieces a bundle of each task serves: the routes `runtime/http/app.py` mounts for it.

Apart from `openapi` (the document's building blocks) and `openapi_generation` (the chat and completion
routes, built from those blocks), so that neither imports the other back.
"""

from __future__ import annotations

from runtime.api.protocol import RequestPolicy
from runtime.bundle import CLASSIFICATION_TASK, EMBEDDING_TASK
from runtime.http.openapi import RoutePiece, classify_piece, embeddings_piece, models_piece, probes_piece
from runtime.http.openapi_adapters import adapters_piece
from runtime.http.openapi_generation import chat_piece, completions_piece


def core_pieces(policy: RequestPolicy, task: str = "chat") -> list[RoutePiece]:
    """The pieces of the routes `runtime/http/app.py` serves for a bundle of `task`."""
    if task == EMBEDDING_TASK:
        served = [embeddings_piece(policy)]
    elif task == CLASSIFICATION_TASK:
        served = [classify_piece(policy)]
    else:
        served = [chat_piece(policy), completions_piece(policy), adapters_piece()]
    return [*served, models_piece(policy), probes_piece(policy)]
