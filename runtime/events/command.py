"""`python -m runtime worker BUNDLE_DIR --queue-url URL`: serve an SQS queue with a long-poll worker.

Like `serve`, every setting is a flag (the packager translates the function spec into them), and heavy
imports wait until `run`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.events.loading import add_aws_arguments
from runtime.startup import add_model_arguments

if TYPE_CHECKING:
    from runtime.events.worker import Worker, WorkerStats

log = logging.getLogger("runtime.events")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("worker", help="serve an SQS queue: long-poll, generate, store results")
    parser.add_argument("bundle", type=Path, metavar="BUNDLE_DIR", help="a bundle written by `pkg build`")
    parser.add_argument("--queue-url", required=True, help="the SQS queue requests arrive on")
    queue = parser.add_argument_group("queue")
    queue.add_argument("--max-in-flight", type=int, help="messages in the engine at once (default: --max-batch)")
    queue.add_argument("--visibility-timeout", type=int, default=60, help="seconds; extended while a message runs")
    queue.add_argument("--wait-time", type=int, default=20, choices=range(21), metavar="0-20", help="long-poll seconds")
    queue.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight work gets on SIGTERM")
    queue.add_argument("--retry-delay", type=int, default=5, help="seconds before a transient failure is retried")
    add_aws_arguments(parser)
    add_model_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from runtime.bundle import BundleError
    from runtime.events.loading import aws_client, begin_handler
    from runtime.events.results import Ledger

    if args.ledger:
        try:
            Ledger.from_uri(args.ledger)
        except ValueError as exc:
            print(f"error: --ledger: {exc}", file=sys.stderr)
            return 2
    started = time.perf_counter()
    try:
        pending = begin_handler(args.bundle, args)
        from runtime.events.worker import Worker, WorkerConfig  # imported while the model loads

        handler = pending.finish()
    except BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = handler.service.require_engine()
    config = WorkerConfig(
        queue_url=args.queue_url,
        max_in_flight=args.max_in_flight or engine.config.max_batch,
        visibility_timeout=args.visibility_timeout,
        wait_time=args.wait_time,
        drain_timeout=args.drain_timeout,
        retry_delay=args.retry_delay,
    )
    worker = Worker(aws_client("sqs", args), handler, config)
    ready_in = time.perf_counter() - started
    log.info("worker ready in %.2f s: %s, up to %d in flight", ready_in, config.queue_url, config.max_in_flight)
    import asyncio

    try:
        stats = asyncio.run(_serve(worker))
    finally:
        engine.shutdown()
    elapsed = time.perf_counter() - stats.started
    log.info("worker stopped after %.1f s: %d received, %s", elapsed, stats.received, dict(stats.outcomes))
    return 0


async def _serve(worker: Worker) -> WorkerStats:
    import asyncio
    import signal
    from concurrent.futures import ThreadPoolExecutor

    loop = asyncio.get_running_loop()
    # One thread per in-flight message's storage calls, plus the long poll, deletes and heartbeats.
    threads = worker.config.max_in_flight + 4
    loop.set_default_executor(ThreadPoolExecutor(max_workers=threads, thread_name_prefix="onnxfn-aws"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    return await worker.run()
