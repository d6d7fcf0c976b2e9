"""Schemathesis against a live server: generated requests from its own `/openapi.json`, every response checked.

Each operation gets schema-valid (positive) and schema-breaking (negative) cases, as JSON and as msgpack
(a msgpack body also asks for a msgpack response). Checks: no 5xx, every status and content type
declared, bodies and headers match the document, schema-breaking input refused with a 4xx, and no
route answering without the key. Streams are checked by `stream_framing` (SSE framing, a final chunk
with `finish_reason`, `[DONE]`). Failures are collected, not raised, so one run counts them all.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import msgpack
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.reliability.live import LiveServer

MSGPACK = "application/msgpack"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    ignored_auth,
]


@schemathesis.serializer(MSGPACK)
def _pack(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    return msgpack.packb(_fits_msgpack(value), use_bin_type=True)


def _fits_msgpack(value: Any) -> Any:
    """msgpack has no integers beyond 64 bits: a client would send such a number as a float."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return float(value)
    if isinstance(value, dict):
        return {_fits_msgpack(k): _fits_msgpack(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fits_msgpack(v) for v in value]
    return value


@schemathesis.deserializer(MSGPACK)
def _unpack(ctx: schemathesis.DeserializationContext, response: schemathesis.Response) -> Any:
    """One map, or the list of chunk maps of a msgpack stream."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(response.content)
    items = list(unpacker)
    return items[0] if len(items) == 1 else items


@dataclass
class FuzzReport:
    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    media: Counter[str] = field(default_factory=Counter)
    streams: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status >= 500)


def stream_problem(body: bytes, media_type: str) -> str | None:
    """What is wrong with a finished stream (None: well-formed)."""
    if media_type.startswith("text/event-stream"):
        text = body.decode()
        if not text.endswith("data: [DONE]\n\n"):
            return f"the SSE stream does not end with data: [DONE]: {text[-80:]!r}"
        events = text.split("\n\n")[:-1]
        if not all(e.startswith("data: ") for e in events):
            return "an SSE event is not a single data: line"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    else:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        unpacker.feed(body)
        chunks = list(unpacker)
    if any("error" in chunk for chunk in chunks):
        return f"the stream ended with an error frame: {chunks[-1]}"
    finishes = [c.get("finish_reason") for chunk in chunks for c in chunk.get("choices", [])]
    return None if any(finishes) else "no chunk carries a finish_reason"


def run_fuzz(server: LiveServer, total_cases: int, *, seed: int = 0) -> FuzzReport:
    """About `total_cases` generated requests spread over the document's operations and both modes."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=server.auth, timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    # Bodies make the search space: the POST operations get most cases; the GETs run out of new cases quickly.
    weights = {op.label: (8 if op.method.upper() == "POST" else 1) for op in operations}
    report = FuzzReport()
    start = time.perf_counter()
    for op in operations:
        per_mode = max(1, total_cases * weights[op.label] // (2 * sum(weights.values())))
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(server, op, mode, per_mode, seed, report)
    report.seconds = time.perf_counter() - start
    return report


def _fuzz_operation(
    server: LiveServer, op: Any, mode: GenerationMode, examples: int, seed: int, report: FuzzReport
) -> None:
    @hypothesis.seed(seed)
    @hypothesis.settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.given(case=op.as_strategy(generation_mode=mode))
    def one(case: schemathesis.Case) -> None:
        headers = dict(server.auth)
        if case.media_type == MSGPACK:
            headers["Accept"] = MSGPACK
        response = case.call(base_url=server.url, headers=headers, timeout=60)
        report.cases += 1
        report.statuses[response.status_code] += 1
        content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis keeps every value
        report.media[case.media_type or "none"] += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except FailureGroup as group:
            report.failures += [_describe(case, response.status_code, f) for f in group.exceptions]
        is_stream = response.status_code == 200 and isinstance(case.body, dict) and case.body.get("stream") is True
        if is_stream:
            report.streams += 1
            problem = stream_problem(response.content, content_type)
            if problem is not None:
                report.failures.append(f"{op.label} [{case.media_type}]: {problem}")

    # Unsatisfiable: nothing to negate (an operation without parameters or body has no schema-breaking cases).
    with contextlib.suppress(hypothesis.errors.Unsatisfiable):
        one()


def _describe(case: schemathesis.Case, status: int, failure: Failure) -> str:
    body = repr(case.body)
    return (
        f"{case.operation.label} [{case.media_type}] → {status}: {failure.title}: {failure.message[:300]} body={body}"
    )
