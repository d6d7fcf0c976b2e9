"""`pkg logs functions/NAME --target T [--follow]`: the deployed function's log."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from packager.errors import UserError
from packager.spec import load_spec
from packager.targets.base import TARGETS, target

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "logs",
        help="print (or follow) a deployed function's log",
        description="The server log of a local deployment, the agent log of a Jetson one, or the CloudWatch "
        "log group of an AWS one.",
    )
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument("--target", choices=TARGETS, default="local")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until Ctrl-C")
    parser.add_argument("--tail", type=int, metavar="N", help="only the last N lines")
    parser.add_argument("--since", metavar="AGE", help="AWS targets: only events newer than AGE, e.g. 30s, 10m, 2h")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    if args.tail is not None and args.tail < 1:
        raise UserError(f"--tail {args.tail}: give a positive number of lines", exit_code=2)
    since = parse_age(args.since) if args.since else None
    lines = target(args.target).logs(spec, follow=args.follow, since_seconds=since, tail=args.tail)
    for line in lines:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S ", time.gmtime(line.timestamp)) if line.timestamp else ""
        sys.stdout.write(f"{stamp}{line.message}\n")
        sys.stdout.flush()
    return 0


def parse_age(text: str) -> float:
    number, unit = text[:-1], text[-1:]
    if unit not in _UNITS or not number.replace(".", "", 1).isdigit():
        raise UserError(f"--since {text!r}: expected a number and a unit (s, m, h, d), e.g. 10m", exit_code=2)
    return float(number) * _UNITS[unit]
