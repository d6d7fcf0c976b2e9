"""Check a request before it is queued, so a client mistake becomes a precise 400, never a crash later."""

from __future__ import annotations

import math

from runtime.engine.request import GenerationRequest, InvalidRequestError

MAX_TOP_LOGPROBS = 20


def validate_request(
    request: GenerationRequest, vocab_size: int, max_context: int, max_sequences: int, prompt_param: str
) -> None:
    prompt = request.prompt_token_ids
    if not prompt:
        raise InvalidRequestError("the prompt is empty: give at least one token", param=prompt_param)
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param=prompt_param
        )
    p = request.sampling
    _check(p.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {p.max_tokens}")
    _check(
        _finite(p.temperature) and p.temperature >= 0, "temperature", f"temperature must be >= 0, got {p.temperature}"
    )
    _check(_finite(p.top_p) and 0 < p.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {p.top_p}")
    _check(p.top_k >= 0, "top_k", f"top_k must be >= 0 (0 turns it off), got {p.top_k}")
    _check(_finite(p.min_p) and 0 <= p.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {p.min_p}")
    _check(
        _finite(p.repetition_penalty) and p.repetition_penalty > 0,
        "repetition_penalty",
        f"repetition_penalty must be > 0 (1 turns it off), got {p.repetition_penalty}",
    )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        _check(_finite(value) and -2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value}")
    for token, bias in p.logit_bias.items():
        _check(0 <= token < vocab_size, "logit_bias", f"logit_bias token id {token} is outside the vocabulary")
        _check(
            _finite(bias) and -100 <= bias <= 100, "logit_bias", f"logit_bias values must be in [-100, 100], got {bias}"
        )
    _check(1 <= p.n <= max_sequences, "n", f"n must be between 1 and {max_sequences}, got {p.n}")
    _check(
        0 <= p.top_logprobs <= MAX_TOP_LOGPROBS,
        "top_logprobs",
        f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {p.top_logprobs}",
    )
    _check(p.logprobs or p.top_logprobs == 0, "top_logprobs", "top_logprobs needs logprobs to be enabled")
    _check(all(isinstance(s, str) and s for s in p.stop), "stop", "stop strings must be non-empty strings")
    for token in p.stop_token_ids:
        _check(0 <= token < vocab_size, "stop_token_ids", f"stop token id {token} is outside the vocabulary")
    if len(prompt) + p.max_tokens > max_context:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{len(prompt) + p.max_tokens} tokens ({len(prompt)} in the {prompt_param}, {p.max_tokens} in the "
            "completion). Please reduce the length of the prompt or of max_tokens.",
            param=prompt_param,
            code="context_length_exceeded",
        )


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


def _finite(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
