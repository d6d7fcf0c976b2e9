"""Prometheus metrics on `/metrics`: latency histograms timed by the server, engine state read at scrape time.

Each app owns its registry (no global state), so several servers can live in one process (tests, the bench).
Engine gauges and counters come from `engine.stats()` when Prometheus scrapes, so the hot path never
updates them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runtime.engine.request import SequenceOutput

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)


class EngineCollector(Collector):
    """Reads `engine.stats()` (or nothing before the engine is loaded) on every scrape."""

    def __init__(self, read_stats: Callable[[], object | None]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        yield GaugeMetricFamily("onnxfn_ready", "1 once the engine is loaded and serving", value=int(stats is not None))
        if stats is None:
            return
        gauges = (
            ("onnxfn_queue_depth", "Requests waiting for a slot", "queued"),
            ("onnxfn_running_requests", "Requests holding a slot", "running"),
            ("onnxfn_batch_size", "Sequences in the last decode step", "last_batch_size"),
            ("onnxfn_kv_cache_used_bytes", "KV cache bytes in use", "kv_used_bytes"),
            ("onnxfn_kv_cache_capacity_bytes", "KV cache bytes allocated", "kv_capacity_bytes"),
            ("onnxfn_prefix_cache_bytes", "Bytes held by the prefix cache", "prefix_cache_bytes"),
        )
        for name, doc, attr in gauges:
            yield GaugeMetricFamily(name, doc, value=getattr(stats, attr))
        counters = (
            ("onnxfn_prompt_tokens", "Prompt tokens prefilled", "tokens_in"),
            ("onnxfn_generation_tokens", "Tokens generated", "tokens_out"),
            ("onnxfn_prefix_cache_hits", "Prompts that reused cached prefix blocks", "prefix_hits"),
            ("onnxfn_engine_steps", "Engine steps run", "steps"),
        )
        for name, doc, attr in counters:
            yield CounterMetricFamily(name, doc, value=getattr(stats, attr))


class ServerMetrics:
    def __init__(self, read_stats: Callable[[], object | None]) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "onnxfn_time_to_first_token_seconds",
            "From request arrival to its first generated token",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "onnxfn_time_per_output_token_seconds",
            "Mean gap between a sequence's generated tokens after the first",
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "onnxfn_http_requests", "HTTP requests by route and status", ("route", "status"), registry=self.registry
        )
        self.registry.register(EngineCollector(read_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Times one request's sequences: TTFT once per request, time per output token per sequence."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._arrival = time.perf_counter()
        self._first_token_at: dict[tuple[int, int], float] = {}

    def observe(self, prompt_index: int, output: SequenceOutput) -> None:
        key = (prompt_index, output.index)
        now = time.perf_counter()
        if key not in self._first_token_at and output.token_ids:
            if not self._first_token_at:
                self._metrics.time_to_first_token.observe(now - self._arrival)
            self._first_token_at[key] = now
        if output.finish_reason is not None and key in self._first_token_at and output.completion_tokens > 1:
            gap = (now - self._first_token_at[key]) / (output.completion_tokens - 1)
            self._metrics.time_per_output_token.observe(gap)
