"""Soak: many concurrent streaming clients against a real server for a bounded time, with chaos.

    .venv/bin/python scripts/soak.py [--seconds 600] [--clients 64] [--json OUT]

Starts `python -m runtime serve` on the demo bundle (or uses `--url` and `--key`), then every client loops:
a streaming chat or completion request (JSON or msgpack), completed and checked (SSE framing, a final
chunk with finish_reason, `[DONE]`), or dropped mid-stream, or cancelled at a random moment. At the end:
errors other than 429, malformed streams, the server's RSS over time (flat within ±5 % after warm-up)
and `/metrics` (0 running, 0 queued once the clients stop). Exit 0 when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.live import DEMO_BUNDLE, LiveServer, live_server
from tests.reliability.streams import Outcome, random_body, stream_once

# A prefix cache the warm-up fills to its budget: a cache still filling (prompt and generated blocks, bounded
# by LRU) must not look like a leak in the RSS after warm-up.
SERVER_FLAGS = [
    "--max-batch", "8", "--max-queue", "64", "--max-context", "512", "--max-tokens-limit", "64",
    "--prefix-cache-mb", "16",
]  # fmt: skip
RSS_TOLERANCE = 0.05
IDLE_TIMEOUT = 15.0


@dataclass
class SoakReport:
    seconds: float
    clients: int
    outcomes: Counter[str] = field(default_factory=Counter)
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)  # one sample a second
    warmup_samples: int = 0
    final_running: float = -1
    final_queued: float = -1

    @property
    def rss_after_warmup(self) -> list[float]:
        return self.rss_mb[self.warmup_samples :]

    @property
    def rss_spread(self) -> float:
        """Largest deviation of a post-warm-up sample from their median, as a fraction of it."""
        samples = self.rss_after_warmup
        median = statistics.median(samples)
        return max(abs(s - median) for s in samples) / median

    def problems(self) -> list[str]:
        out = [f"{len(self.errors)} errors, first: {self.errors[0]}"] if self.errors else []
        if self.outcomes["completed"] == 0:
            out.append("no stream completed")
        if self.rss_spread > RSS_TOLERANCE:
            out.append(f"RSS moved {self.rss_spread:.1%} after warm-up (limit {RSS_TOLERANCE:.0%})")
        if (self.final_running, self.final_queued) != (0, 0):
            out.append(f"slots leaked: {self.final_running} running, {self.final_queued} queued at the end")
        return out


async def _client(server: LiveServer, rng: random.Random, deadline: float, report: SoakReport) -> None:
    limits = httpx.Limits(max_connections=1)
    while time.monotonic() < deadline:
        # A fresh connection pool after each cancellation: httpcore 1.0.9 can leave a request cancelled while
        # its connection opens holding the pool's only slot for good (encode/httpcore#1093), and the client's
        # next request would end in a PoolTimeout that says nothing about the server.
        async with httpx.AsyncClient(base_url=server.url, headers=server.auth, timeout=120, limits=limits) as client:
            await _requests_until_cancelled(client, server, rng, deadline, report)


async def _requests_until_cancelled(
    client: httpx.AsyncClient, server: LiveServer, rng: random.Random, deadline: float, report: SoakReport
) -> None:
    while time.monotonic() < deadline:
        path, body = random_body(rng, server.model, max_tokens=rng.randint(8, 48))
        roll = rng.random()
        disconnect_after = rng.randint(1, 6) if roll < 0.15 else None
        request = stream_once(client, path, body, msgpack_wire=rng.random() < 0.3, disconnect_after=disconnect_after)
        try:
            if roll > 0.85:  # cancel at a random moment: before the headers, mid-prefill or mid-stream
                outcome = await asyncio.wait_for(request, timeout=rng.uniform(0.01, 2.0))
            else:
                outcome = await request
        except TimeoutError:
            report.cancelled += 1
            return
        except (httpx.HTTPError, ValueError) as exc:
            outcome = Outcome("error", f"{type(exc).__name__}: {exc}")
        report.outcomes[outcome.kind] += 1
        if outcome.kind == "error":
            report.errors.append(f"{path}: {outcome.detail}")
        elif outcome.kind == "rejected":
            await asyncio.sleep(float(outcome.retry_after or 1) * rng.uniform(0.5, 1.0))


async def _sample_rss(server: LiveServer, deadline: float, report: SoakReport) -> None:
    while time.monotonic() < deadline:
        report.rss_mb.append(server.rss_bytes() / 2**20)
        await asyncio.sleep(1.0)


async def run_soak(server: LiveServer, seconds: float, clients: int, seed: int = 0) -> SoakReport:
    report = SoakReport(seconds=seconds, clients=clients)
    report.warmup_samples = max(1, int(seconds * 0.25))
    deadline = time.monotonic() + seconds
    tasks = [_client(server, random.Random(seed * 1000 + i), deadline, report) for i in range(clients)]
    await asyncio.gather(_sample_rss(server, deadline, report), *tasks)
    idle_by = time.monotonic() + IDLE_TIMEOUT
    while time.monotonic() < idle_by:
        report.final_running, report.final_queued = server.running_and_queued()
        if (report.final_running, report.final_queued) == (0, 0):
            break
        await asyncio.sleep(0.2)
    return report


def _print(report: SoakReport) -> None:
    after = report.rss_after_warmup
    print(f"soak: {report.clients} clients for {report.seconds:.0f} s")
    print(f"  outcomes: {dict(report.outcomes)}, cancelled by the client: {report.cancelled}")
    print(f"  RSS after warm-up: {min(after):.1f}-{max(after):.1f} MiB (max deviation {report.rss_spread:.2%})")
    print(f"  at the end: {report.final_running:.0f} running, {report.final_queued:.0f} queued")
    for problem in report.problems() or ["all checks passed"]:
        print(f"  {problem}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bundle", type=Path, default=DEMO_BUNDLE)
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="onnxfn-soak-") as scratch,
        live_server(args.bundle, Path(scratch) / "server.log", SERVER_FLAGS) as server,
    ):
        report = asyncio.run(run_soak(server, args.seconds, args.clients, args.seed))
    _print(report)
    if args.json:
        data = {**asdict(report), "outcomes": dict(report.outcomes)}  # asdict would rebuild the Counter wrongly
        data |= {"rss_spread": report.rss_spread, "problems": report.problems()}
        args.json.write_text(json.dumps(data, indent=2))
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
