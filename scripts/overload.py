"""Overload: offer 3x the server's capacity and check it degrades by refusing, not by slowing everyone down.

    .venv/bin/python scripts/overload.py [--seconds 60] [--factor 3] [--json OUT]

1. Capacity: the streaming requests per second the server completes with `max_batch` clients in a
   closed loop, and their TTFT (the unloaded reference: a full batch, nothing queued).
2. Overload: an open loop (Poisson arrivals, no client waits for another) at `factor` x capacity.
   Checked: the queue never exceeds `--max-queue` (sampled from `/metrics`), refusals are 429 with a
   `Retry-After` header, p99 TTFT of admitted requests against 2x the unloaded p99, and the server's
   RSS stays under the bound its configuration implies (weights + KV budget + queue x body limit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.live import DEMO_BUNDLE, LiveServer, live_server
from tests.reliability.streams import Outcome, random_body, stream_once

MAX_BATCH = 4
MAX_TOKENS = 32


@dataclass
class Phase:
    name: str
    seconds: float
    outcomes: Counter[str] = field(default_factory=Counter)
    ttfts: list[float] = field(default_factory=list)
    retry_after: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    max_queue_seen: float = 0
    max_rss_mb: float = 0

    def record(self, outcome: Outcome) -> None:
        self.outcomes[outcome.kind] += 1
        if outcome.kind == "completed" and outcome.ttft is not None:
            self.ttfts.append(outcome.ttft)
        if outcome.kind == "rejected":
            self.retry_after[str(outcome.retry_after)] += 1
        if outcome.kind == "error":
            self.errors.append(outcome.detail)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    @property
    def throughput(self) -> float:
        return self.outcomes["completed"] / self.seconds


def server_flags(max_queue: int, max_waiting: int | None) -> list[str]:
    flags = ["--max-batch", str(MAX_BATCH), "--max-queue", str(max_queue), "--max-context", "256",
             "--max-tokens-limit", str(MAX_TOKENS), "--kv-memory-mb", "64", "--prefix-cache-mb", "16"]  # fmt: skip
    return flags if max_waiting is None else [*flags, "--max-waiting", str(max_waiting)]


async def _one(client: httpx.AsyncClient, server: LiveServer, rng: random.Random, phase: Phase) -> None:
    path, body = random_body(rng, server.model, max_tokens=MAX_TOKENS)
    body["ignore_eos"] = True  # every request costs the same, so capacity is one number
    try:
        phase.record(await stream_once(client, path, body, msgpack_wire=False, disconnect_after=None))
    except (httpx.HTTPError, ValueError) as exc:
        phase.record(Outcome("error", f"{type(exc).__name__}: {exc}"))


async def _watch(server: LiveServer, deadline: float, phase: Phase) -> None:
    async with httpx.AsyncClient(headers=server.auth, timeout=10) as client:
        while time.monotonic() < deadline:
            text = (await client.get(server.url + "/metrics")).text
            depth = next(float(line.split()[1]) for line in text.splitlines() if line.startswith("onnxfn_queue_depth"))
            phase.max_queue_seen = max(phase.max_queue_seen, depth)
            phase.max_rss_mb = max(phase.max_rss_mb, server.rss_bytes() / 2**20)
            await asyncio.sleep(0.1)


async def closed_loop(server: LiveServer, seconds: float, seed: int) -> Phase:
    """`MAX_BATCH` clients back to back: the batch is full and nothing waits."""
    phase = Phase("capacity", seconds)
    deadline = time.monotonic() + seconds

    async def client(rng: random.Random) -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=server.auth, timeout=300) as http:
            while time.monotonic() < deadline:
                await _one(http, server, rng, phase)

    await asyncio.gather(_watch(server, deadline, phase), *(client(random.Random(seed + i)) for i in range(MAX_BATCH)))
    return phase


async def open_loop(server: LiveServer, seconds: float, rate: float, seed: int) -> Phase:
    """Poisson arrivals at `rate` per second, each its own connection, whatever the server does."""
    phase = Phase("overload", seconds)
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, headers=server.auth, timeout=300, limits=limits) as http:
        watcher = asyncio.ensure_future(_watch(server, deadline, phase))
        tasks = []
        while time.monotonic() < deadline:
            tasks.append(asyncio.ensure_future(_one(http, server, random.Random(rng.random()), phase)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(watcher, *tasks)
    return phase


def memory_bound_mb(bundle: Path, max_queue: int, body_limit: int) -> float:
    """What the configuration allows: the weights mapped once, the KV and prefix budgets, queued bodies,
    plus a fixed allowance for the interpreter, ORT's arenas and activations."""
    weights = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    return (weights + (64 << 20) + (16 << 20) + max_queue * body_limit) / 2**20 + 400


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60, help="length of each phase")
    parser.add_argument("--factor", type=float, default=3.0, help="offered load as a multiple of capacity")
    parser.add_argument("--max-queue", type=int, default=8)
    parser.add_argument("--max-waiting", type=int, help="the server's admission gate (default: the queue alone)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bundle", type=Path, default=DEMO_BUNDLE)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="onnxfn-overload-") as scratch:
        log = Path(scratch) / "server.log"
        with live_server(args.bundle, log, server_flags(args.max_queue, args.max_waiting)) as server:
            asyncio.run(closed_loop(server, 5, args.seed))  # warm-up
            unloaded = asyncio.run(closed_loop(server, args.seconds, args.seed))
            rate = args.factor * unloaded.throughput
            loaded = asyncio.run(open_loop(server, args.seconds, rate, args.seed))
    bound = memory_bound_mb(args.bundle, args.max_queue, 1 << 20)
    p99_ratio = loaded.percentile(0.99) / unloaded.percentile(0.99)
    checks = {
        "queue bounded": loaded.max_queue_seen <= args.max_queue,
        "refusals are 429 with Retry-After": loaded.outcomes["rejected"] > 0 and "None" not in loaded.retry_after,
        "no errors": not (unloaded.errors or loaded.errors),
        "p99 TTFT within 2x unloaded": p99_ratio <= 2.0,
        "RSS under the configured bound": loaded.max_rss_mb <= bound,
    }
    print(f"capacity: {unloaded.throughput:.2f} req/s ({MAX_BATCH} slots, {MAX_TOKENS} tokens each)")
    print(f"offered: {rate:.2f} req/s ({args.factor}x) for {args.seconds:.0f} s: {dict(loaded.outcomes)}")
    print(f"Retry-After values: {dict(loaded.retry_after)}; deepest queue seen: {loaded.max_queue_seen:.0f}")
    for phase in (unloaded, loaded):
        p50, p99 = phase.percentile(0.5), phase.percentile(0.99)
        print(f"TTFT {phase.name}: p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms over {len(phase.ttfts)} requests")
    print(f"p99 ratio loaded/unloaded: {p99_ratio:.2f}; peak RSS {loaded.max_rss_mb:.0f} MiB (bound {bound:.0f} MiB)")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    for error in (unloaded.errors + loaded.errors)[:5]:
        print(f"  error: {error}")
    if args.json:
        summary = {
            "capacity_rps": unloaded.throughput,
            "offered_rps": rate,
            "outcomes": dict(loaded.outcomes),
            "retry_after": dict(loaded.retry_after),
            "max_queue_seen": loaded.max_queue_seen,
            "ttft_unloaded_p50_p99": [unloaded.percentile(0.5), unloaded.percentile(0.99)],
            "ttft_loaded_p50_p99": [loaded.percentile(0.5), loaded.percentile(0.99)],
            "p99_ratio": p99_ratio,
            "max_rss_mb": loaded.max_rss_mb,
            "rss_bound_mb": bound,
            "checks": checks,
        }
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
