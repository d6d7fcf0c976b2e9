"""What the engine reports: load times, stats snapshots, and per-step / per-request timing for metrics."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.engine.scheduler import RequestState


@dataclass(frozen=True)
class LoadTimes:
    """Seconds each part of `Engine.__init__` took; the session and the tokenizer load concurrently.

    `session` counts from when its build started, which may be before the engine was created.
    """

    session: float
    tokenizer: float
    total: float


@dataclass(frozen=True)
class EngineStats:
    """A snapshot; counters (tokens, steps, hits) grow from engine creation."""

    queued: int  # requests waiting for slots
    running: int  # requests holding slots (prefilling or decoding)
    kv_used_bytes: int  # KV of the tokens computed so far by running sequences
    kv_capacity_bytes: int
    prefix_cache_bytes: int
    prefix_hits: int
    tokens_in: int
    tokens_out: int
    steps: int
    last_batch_size: int
    draft_tokens: int = 0  # drafted by prompt lookup and verified
    accepted_draft_tokens: int = 0


@dataclass(frozen=True)
class RequestTiming:
    request_id: str
    time_to_first_token: float  # seconds from submit to the first token
    time_per_output_token: float  # seconds per token after the first (0 with one token)
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class StepReport:
    duration: float  # seconds
    batch_size: int  # sequences decoded this step
    prefill_tokens: int
    decode_tokens: int
    first_tokens: tuple[float, ...]  # TTFT of each request whose first token came this step
    finished: tuple[RequestTiming, ...]
    queued: int
    kv_used_bytes: int


def request_timing(group: RequestState, now: float) -> RequestTiming:
    first = group.first_token_at or now
    completion = max(s.output.completion_tokens for s in group.sequences)
    return RequestTiming(
        request_id=group.request.request_id,
        time_to_first_token=first - group.submitted_at,
        time_per_output_token=(now - first) / (completion - 1) if completion > 1 else 0.0,
        prompt_tokens=group.prompt_len,
        completion_tokens=sum(s.output.completion_tokens for s in group.sequences),
    )
