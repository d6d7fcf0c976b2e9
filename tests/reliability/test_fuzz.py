"""Schemathesis on the server's own OpenAPI document: 300 generated cases here, 2,000 in scripts/fuzz_api.py."""

from __future__ import annotations

import os

import httpx
import msgpack
import pytest

from tests.reliability.conftest import assert_serves
from tests.reliability.fuzzing import MSGPACK, run_fuzz, stream_problem
from tests.reliability.live import LiveServer

pytestmark = pytest.mark.real_model
CASES = int(os.environ.get("ONNXFN_FUZZ_CASES", "300"))


def test_generated_requests_get_declared_answers_and_never_a_5xx(live: LiveServer) -> None:
    report = run_fuzz(live, CASES, seed=11)
    assert report.cases >= CASES * 0.8, report
    assert report.server_errors == 0, report.failures[:5]
    assert report.failures == [], "\n".join(report.failures[:10])
    # Both wire formats and the generating routes were really exercised, streams included.
    assert report.media["application/json"] > 0 and report.media["application/msgpack"] > 0
    # Which generated cases stream depends on what the generator draws; the framing of both stream formats
    # is checked on fixed requests as well, so this test never depends on that draw.
    assert report.statuses[200] > 0 and report.statuses[400] > 0
    assert_serves(live)
    body = {"model": live.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    sse = httpx.post(live.url + "/v1/chat/completions", json=body, headers=live.auth, timeout=60)
    assert sse.status_code == 200 and stream_problem(sse.content, sse.headers["content-type"]) is None
    headers = {**live.auth, "Content-Type": MSGPACK, "Accept": MSGPACK}
    packed = httpx.post(live.url + "/v1/chat/completions", content=msgpack.packb(body), headers=headers, timeout=60)
    assert packed.status_code == 200 and stream_problem(packed.content, packed.headers["content-type"]) is None
