"""The engine's public request and output types, shared by every frontend (HTTP, queue, agent).

Frontends translate their wire format into a `GenerationRequest` and read `SequenceOutput`s back;
they never see the scheduler, the KV cache or ONNX Runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"  # an EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the context is full
    ABORT = "abort"  # cancelled by the client (disconnect) or by shutdown


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, in OpenAI's vocabulary. `temperature == 0` means greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style multiplicative, 1.0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str | None = None  # an llguidance grammar every sampled token must follow (engine/constraints.py)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None  # a LoRA adapter's name (the API's `model: "FUNCTION:ADAPTER"`); None: the base


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token id, text, logprob), best first


@dataclass(frozen=True)
class SequenceOutput:
    """What one step produced for one of a request's `n` sequences.

    `text` is the newly decoded text (never a partial UTF-8 character, never part of a stop string);
    `finish_reason` is set on the sequence's last output.
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @staticmethod
    def joined(outputs: Sequence[SequenceOutput]) -> SequenceOutput:
        """One sequence's outputs, in order, as the single output of a request run to completion."""
        last = outputs[-1]
        return SequenceOutput(
            request_id=last.request_id,
            index=last.index,
            token_ids=tuple(t for o in outputs for t in o.token_ids),
            text="".join(o.text for o in outputs),
            logprobs=tuple(lp for o in outputs for lp in o.logprobs),
            finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
        )


class EngineError(Exception):
    """Base of the errors a frontend turns into a client-facing response."""


class InvalidRequestError(EngineError):
    """The request cannot be served as given (HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class UnknownAdapterError(EngineError):
    """The request names an adapter this server does not have (HTTP 404); `available` lists those it has."""

    def __init__(self, message: str, *, available: tuple[str, ...]) -> None:
        super().__init__(message)
        self.available = available


class EngineOverloadedError(EngineError):
    """The bounded queue is full (HTTP 429); `retry_after` is a hint in seconds."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after
