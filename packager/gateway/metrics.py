"""What the gateway reads off a function server's `/metrics` (runtime/api/metrics.py writes it): requests
served, whether any is running or queued (the idle check), and the live figures the page shows."""

from __future__ import annotations

import math
from dataclasses import dataclass

REQUESTS = "onnxfn_http_requests_total"
BUSY = ("onnxfn_running_requests", "onnxfn_queue_depth")
TOKENS_OUT = "onnxfn_generation_tokens_total"
TTFT_BUCKET = "onnxfn_time_to_first_token_seconds_bucket"
TPOT_BUCKET = "onnxfn_time_per_output_token_seconds_bucket"


@dataclass(frozen=True)
class Figures:
    requests: float  # HTTP requests served on the API routes (not /metrics, /ready)
    busy: bool  # a request is running or queued
    tokens_out: float
    ttft_p50_s: float | None  # None before the first generated token
    tpot_p50_s: float | None


def parse(page: str) -> Figures:
    """The figures from a Prometheus text page; an absent metric (an encoder has no tokens) counts as 0."""
    requests, busy, tokens = 0.0, False, 0.0
    buckets: dict[str, list[tuple[float, float]]] = {TTFT_BUCKET: [], TPOT_BUCKET: []}
    for line in page.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        series, _, text = line.rpartition(" ")
        name, _, labels = series.partition("{")
        value = float(text)
        if name == REQUESTS:
            requests += value
        elif name in BUSY:
            busy = busy or value > 0
        elif name == TOKENS_OUT:
            tokens += value
        elif name in buckets:
            bound = labels.split('le="', 1)[1].split('"', 1)[0]
            buckets[name].append((math.inf if bound == "+Inf" else float(bound), value))
    return Figures(requests, busy, tokens, median_of(buckets[TTFT_BUCKET]), median_of(buckets[TPOT_BUCKET]))


def median_of(buckets: list[tuple[float, float]]) -> float | None:
    """The median of a cumulative histogram, interpolated inside its bucket as Prometheus'
    `histogram_quantile` does; the largest finite bound when it falls in the +Inf bucket."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, lower, below = total / 2, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below) if count > below else bound
        lower, below = bound, count
    return lower
