"""`pkg destroy functions/NAME --target TARGET`: remove the function's deployment from a target."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from packager.deploy import local
from packager.deploy.base import TARGETS, target
from packager.spec import load_spec

console = Console()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("destroy", help="stop a deployed function and clean up")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument("--target", choices=TARGETS, default="local")
    parser.add_argument(
        "--timeout", type=float, default=local.STOP_TIMEOUT, help="seconds between SIGTERM and SIGKILL (local)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    if args.target == "local":
        stopped = local.destroy(spec, timeout=args.timeout)
        if stopped is None:
            console.print(f"{spec.name} is not deployed on {args.target}; nothing to do")
            return 0
        console.print(
            f"stopped {spec.name} on {args.target} (pid {stopped.pid}, {stopped.url}); log kept at {stopped.log_file}",
            highlight=False,
        )
        return 0
    deleted = target(args.target).destroy(spec)
    if not deleted:
        console.print(f"{spec.name} is not deployed on {args.target}; nothing to do")
        return 0
    console.print(f"destroyed {spec.name} on {args.target}: deleted {len(deleted)} resources", highlight=False)
    for resource in deleted:
        console.print(f"  {resource}", highlight=False)
    return 0
