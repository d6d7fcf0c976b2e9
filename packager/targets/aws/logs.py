"""An AWS deployment's log: the CloudWatch log group its deploy created, read with `FilterLogEvents` across
every stream, in time order (and followed by polling)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from packager.errors import UserError
from packager.logs import POLL_SECONDS
from packager.spec import FunctionSpec
from packager.targets.aws import common as aws
from packager.targets.base import LogLine


def deployment_log(
    spec: FunctionSpec, target: str, state_dir: Path, *, follow: bool, since_seconds: float | None, tail: int | None
) -> Iterator[LogLine]:
    deployment = aws.load_state(state_dir)
    if deployment is None:
        raise UserError(
            f"{spec.name} is not deployed to {target}; deploy it: pkg deploy {spec.directory} --target {target}"
        )
    group = next((name for kind, name in deployment.resources if kind == "log-group"), None)
    if group is None:
        raise UserError(f"the {target} deployment of {spec.name} records no log group; deploy again")
    context = aws.connect(target, deployment.region, deployment.endpoint_url)
    start = time.time() - since_seconds if since_seconds is not None else 0.0
    return cloudwatch_lines(context, group, start=start, follow=follow, tail=tail)


def cloudwatch_lines(
    context: aws.AwsContext, group: str, *, start: float, follow: bool, tail: int | None, poll: float = POLL_SECONDS
) -> Iterator[LogLine]:
    logs = context.client("logs")
    start_ms = int(start * 1000)
    # FilterLogEvents returns events at or after startTime, so the newest millisecond comes back on the next
    # poll: remember those events' ids (only those, so a long --follow holds no growing set).
    seen_at_start: set[str] = set()
    first = True
    while True:
        with aws.aws_errors(context, f"read log group {group}"):
            try:
                pages = logs.get_paginator("filter_log_events").paginate(logGroupName=group, startTime=start_ms)
                events = [e for page in pages for e in page.get("events", []) if e["eventId"] not in seen_at_start]
            except logs.exceptions.ResourceNotFoundException:
                raise UserError(
                    f"log group {group} does not exist in AWS; the function may have been destroyed"
                ) from None
        events.sort(key=lambda e: (e["timestamp"], e["eventId"]))
        if events:
            newest = events[-1]["timestamp"]
            same = {e["eventId"] for e in events if e["timestamp"] == newest}
            seen_at_start = same | (seen_at_start if newest == start_ms else set())
            start_ms = newest
        for event in events[-tail:] if first and tail else events:
            yield LogLine(event["message"].rstrip("\n"), event["timestamp"] / 1000, event.get("logStreamName", ""))
        first = False
        if not follow:
            return
        time.sleep(poll)
