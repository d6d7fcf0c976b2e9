"""Where a deployed function's log is, and reading it (once, or following it as it grows).

local: the server's log file (`build/NAME/local/server.log`); AWS targets: the CloudWatch log group the
deploy created (read with `FilterLogEvents` across every stream, in time order).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from packager.deploy import aws_common as aws
from packager.deploy import local
from packager.deploy.base import target as target_module
from packager.errors import UserError
from packager.spec import FunctionSpec

POLL_SECONDS = 1.0


@dataclass(frozen=True)
class LogLine:
    message: str
    timestamp: float | None = None  # epoch seconds, where the source records one
    stream: str = ""


def read_log(
    spec: FunctionSpec, target: str, *, follow: bool, since_seconds: float | None, tail: int | None
) -> Iterator[LogLine]:
    if target == "local":
        deployment = local.load(local.state_dir(spec))
        # A destroyed deployment leaves its log behind, in the place a deploy writes it.
        log_file = Path(deployment.log_file) if deployment else local.state_dir(spec) / local.LOG_FILE
        if not log_file.is_file():
            raise UserError(
                f"{spec.name} was never deployed locally; deploy it: pkg deploy {spec.directory} --target local"
            )
        return file_lines(log_file, follow=follow, tail=tail)
    if target in ("aws-lambda", "aws-sagemaker"):
        return _cloudwatch(spec, target, follow=follow, since_seconds=since_seconds, tail=tail)
    raise UserError(f"pkg logs does not know where --target {target} keeps its log")


def file_lines(path: Path, *, follow: bool, tail: int | None, poll: float = POLL_SECONDS) -> Iterator[LogLine]:
    try:
        handle = path.open("r", errors="replace")
    except FileNotFoundError:
        raise UserError(f"no log at {path}: the deployment's log was removed; redeploy to start a new one") from None
    with handle:
        lines = handle.readlines()
        for line in lines[-tail:] if tail else lines:
            yield LogLine(line.rstrip("\n"))
        while follow:
            line = handle.readline()
            if line:
                yield LogLine(line.rstrip("\n"))
            else:
                time.sleep(poll)


def _cloudwatch(
    spec: FunctionSpec, target: str, *, follow: bool, since_seconds: float | None, tail: int | None
) -> Iterator[LogLine]:
    deployment = aws.load_state(target_module(target).state_dir(spec))
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
