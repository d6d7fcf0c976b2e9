"""`pkg destroy functions/NAME --target local`: stop the endpoint and remove its deployment state."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from packager.commands.deploy import TARGETS
from packager.deploy import local
from packager.spec import load_spec

console = Console()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("destroy", help="stop a deployed function and clean up")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument("--target", choices=sorted(TARGETS), default="local")
    parser.add_argument("--timeout", type=float, default=local.STOP_TIMEOUT, help="seconds between SIGTERM and SIGKILL")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    stopped = local.destroy(spec, timeout=args.timeout)
    if stopped is None:
        console.print(f"{spec.name} is not deployed on {args.target}; nothing to do")
        return 0
    console.print(
        f"stopped {spec.name} on {args.target} (pid {stopped.pid}, {stopped.url}); log kept at {stopped.log_file}",
        highlight=False,
    )
    return 0
