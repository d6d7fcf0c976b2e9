"""`pkg deploy functions/NAME --target TARGET`: create or update the function's endpoint on a target.

`--plan` prints what would change, as a table, and changes nothing. `--emit-terraform DIR` writes a
Terraform root module with the same resources and settings instead of deploying (AWS targets).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from packager.progress import StepProgress
from packager.spec import load_spec
from packager.targets.base import READY_TIMEOUT, TARGETS, PlanRow, target

console = Console()
err_console = Console(stderr=True)
_ACTION_STYLES = {"create": "green", "update": "yellow", "replace": "yellow", "delete": "red", "none": "dim"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("deploy", help="deploy a built function to a target")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument("--target", choices=TARGETS, default="local")
    parser.add_argument("--plan", action="store_true", help="print what would change, change nothing")
    parser.add_argument(
        "--emit-terraform", type=Path, metavar="DIR", help="write a Terraform root module for the target instead"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=READY_TIMEOUT, help="seconds to wait for the endpoint (local)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    chosen = target(args.target, ready_timeout=args.ready_timeout)
    progress = StepProgress(console=err_console)
    if args.emit_terraform is not None:
        written = chosen.emit_terraform(spec, args.emit_terraform, progress)
        console.print(f"wrote {len(written)} files to {args.emit_terraform}: {', '.join(p.name for p in written)}")
        console.print("push the image first (pkg image push), then: terraform init && terraform apply", highlight=False)
        return 0
    plan = chosen.plan(spec, progress)
    if plan.no_changes:
        console.print(f"no changes: {spec.name} on {args.target} is up to date ({len(plan.rows())} resources)")
        return 0
    print_plan(plan.rows(), f"{spec.name} on {args.target} ({plan.where})")
    if args.plan:
        return 0
    deployment = chosen.apply(plan, progress)
    table = Table(title=f"{spec.name} deployed to {args.target}", show_header=False)
    for label, value in deployment.summary():
        table.add_row(label, value)
    console.print(table)
    console.print(deployment.next_step(args.function), highlight=False)
    return 0


def print_plan(rows: list[PlanRow], title: str) -> None:
    table = Table(title=f"plan: {title}")
    for column in ("action", "resource", "name", "settings"):
        table.add_column(column, overflow="fold")
    for action, kind, name, detail in rows:
        style = _ACTION_STYLES.get(action, "")
        table.add_row(f"[{style}]{action}[/]", kind, name, detail)
    counts = {a: sum(1 for row in rows if row[0] == a) for a in ("create", "update", "replace", "delete")}
    console.print(table)
    console.print(", ".join(f"{n} to {a}" for a, n in counts.items() if n or a != "replace"), highlight=False)
