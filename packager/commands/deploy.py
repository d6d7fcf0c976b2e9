"""`pkg deploy functions/NAME --target local`: start (or replace) the function's endpoint and wait for it."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

from rich.console import Console
from rich.table import Table

from packager.deploy import local
from packager.spec import load_spec

# Each target module offers plan(spec), apply(plan), status(spec) and destroy(spec).
TARGETS: dict[str, ModuleType] = {"local": local}

console = Console()
err_console = Console(stderr=True)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("deploy", help="deploy a built function to a target")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument("--target", choices=sorted(TARGETS), default="local")
    parser.add_argument(
        "--ready-timeout", type=float, default=local.READY_TIMEOUT, help="seconds to wait for the endpoint"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    previous = local.status(spec)
    plan = local.plan(spec)
    with err_console.status(f"starting {spec.name} on {args.target} (bundle {plan.bundle_digest[:19]}…)"):
        deployment = local.apply(plan, ready_timeout=args.ready_timeout)
    table = Table(title=f"{spec.name} deployed to {args.target}", show_header=False)
    table.add_row("url", f"[bold]{deployment.url}/v1[/] (OpenAI-compatible)")
    table.add_row("pid", str(deployment.pid))
    table.add_row("bundle", deployment.bundle)
    table.add_row("digest", deployment.bundle_digest)
    table.add_row("api key", deployment.api_key.describe())
    table.add_row("log", deployment.log_file)
    if previous is not None:
        table.add_row("replaced", f"pid {previous.pid} ({previous.state}, bundle {previous.bundle_digest[:19]}…)")
    console.print(table)
    console.print(f'try it: pkg invoke {args.function} "Hello!"', highlight=False)
    return 0
