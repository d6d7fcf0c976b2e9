"""Pieces of OpenAI response objects shared by the chat and completions endpoints."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from runtime.api.errors import APIError
from runtime.engine.request import TokenLogprob

# OpenAI reports "practically impossible" as -9999.0; JSON has no -Infinity.
_FLOOR_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR_LOGPROB


@dataclass(frozen=True)
class ResponseMeta:
    """The fields every response object and stream chunk of one request repeats."""

    id: str
    model: str
    fingerprint: str | None
    created: int

    @classmethod
    def new(cls, prefix: str, model: str, fingerprint: str | None) -> ResponseMeta:
        return cls(id=f"{prefix}-{uuid.uuid4().hex}", model=model, fingerprint=fingerprint, created=int(time.time()))

    def envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.fingerprint is not None:
            body["system_fingerprint"] = self.fingerprint
        return body


def chat_logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {
        "token": entry.text,
        "logprob": finite_logprob(entry.logprob),
        "bytes": list(entry.text.encode()),
        "top_logprobs": [
            {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode())}
            for _, text, logprob in entry.top
        ],
    }


def prompt_limit(max_prompt_tokens: int | None, context: int) -> int:
    """The longest prompt served: `max_prompt_tokens`, never past the context less the one token a completion needs.
    The one place both limits meet (the server warns at start when the first exceeds the second)."""
    return min(context - 1, max_prompt_tokens if max_prompt_tokens is not None else context)


def check_prompt_length(length: int, max_prompt_tokens: int | None, context: int, param: str) -> None:
    limit = prompt_limit(max_prompt_tokens, context)
    if length > limit:
        why = (
            f"max_prompt_tokens is {limit}"
            if limit == max_prompt_tokens
            else f"the model's context here is {context} tokens, and a completion needs at least one"
        )
        raise APIError(
            400,
            f"the prompt is {length} tokens; this endpoint accepts at most {limit} ({why})",
            param=param,
            code="context_length_exceeded",
        )
