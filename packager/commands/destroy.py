"""`pkg destroy functions/NAME --target TARGET`: remove the function's deployment from a target."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from packager.spec import load_spec
from packager.targets.base import STOP_TIMEOUT, TARGETS, target

console = Console()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("destroy", help="stop a deployed function and clean up")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument("--target", choices=TARGETS, default="local")
    parser.add_argument(
        "--timeout", type=float, default=STOP_TIMEOUT, help="seconds between SIGTERM and SIGKILL (local)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    removed = target(args.target, stop_timeout=args.timeout).destroy(spec)
    if removed is None:
        console.print(f"{spec.name} is not deployed on {args.target}; nothing to do")
        return 0
    console.print(removed.summary, highlight=False)
    for thing in removed.removed:
        console.print(f"  {thing}", highlight=False)
    return 0
