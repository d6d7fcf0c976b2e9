"""`pkg deploy functions/NAME --target TARGET`: create or update the function's endpoint on a target.

`--plan` prints what would change, as a table, and changes nothing. `--emit-terraform DIR` writes a
Terraform root module with the same resources and settings instead of deploying (AWS targets).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from packager.deploy import local
from packager.deploy.base import TARGETS, target
from packager.errors import UserError
from packager.progress import StepProgress
from packager.spec import FunctionSpec, load_spec

console = Console()
err_console = Console(stderr=True)
_ACTION_STYLES = {"create": "green", "update": "yellow", "delete": "red", "none": "dim"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("deploy", help="deploy a built function to a target")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument("--target", choices=TARGETS, default="local")
    parser.add_argument("--plan", action="store_true", help="print what would change, change nothing")
    parser.add_argument(
        "--emit-terraform", type=Path, metavar="DIR", help="write a Terraform root module for the target instead"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=local.READY_TIMEOUT, help="seconds to wait for the endpoint (local)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    if args.emit_terraform is not None:
        return _emit_terraform(spec, args)
    if args.target == "local":
        return _deploy_local(spec, args)
    return _deploy_aws(spec, args)


def _deploy_aws(spec: FunctionSpec, args: argparse.Namespace) -> int:
    module = target(args.target)
    progress = StepProgress(console=err_console)
    plan = module.plan(spec, progress=progress)
    if plan.no_changes:
        console.print(f"no changes: {spec.name} on {args.target} is up to date ({len(plan.changes)} resources)")
        return 0
    print_plan(plan.rows(), f"{spec.name} on {args.target} ({plan.context.region})")
    if args.plan:
        return 0
    with err_console.status(f"deploying {spec.name} to {args.target}"):
        deployment = module.apply(plan)
    table = Table(title=f"{spec.name} deployed to {args.target}", show_header=False)
    table.add_row("url", deployment.url or "-")
    table.add_row("region", f"{deployment.region} (account {deployment.account})")
    table.add_row("bundle", deployment.bundle_digest)
    table.add_row("changed", f"{deployment.changed} of {len(plan.changes)} resources")
    console.print(table)
    return 0


def print_plan(rows: list[tuple[str, str, str, str]], title: str) -> None:
    table = Table(title=f"plan: {title}")
    for column in ("action", "resource", "name", "settings"):
        table.add_column(column, overflow="fold")
    for action, kind, name, detail in rows:
        style = _ACTION_STYLES.get(action, "")
        table.add_row(f"[{style}]{action}[/]", kind, name, detail)
    counts = {a: sum(1 for row in rows if row[0] == a) for a in ("create", "update", "delete")}
    console.print(table)
    console.print(", ".join(f"{n} to {a}" for a, n in counts.items()), highlight=False)


def _emit_terraform(spec: FunctionSpec, args: argparse.Namespace) -> int:
    from packager.deploy.terraform import emit_root_module

    if args.target == "local":
        raise UserError(
            "--emit-terraform needs an AWS target: --target aws-lambda or --target aws-sagemaker", exit_code=2
        )
    written = emit_root_module(spec, args.target, args.emit_terraform, progress=StepProgress(console=err_console))
    console.print(f"wrote {len(written)} files to {args.emit_terraform}: {', '.join(p.name for p in written)}")
    console.print("push the image first (pkg image push), then: terraform init && terraform apply", highlight=False)
    return 0


def _deploy_local(spec: FunctionSpec, args: argparse.Namespace) -> int:
    previous = local.status(spec)
    plan = local.plan(spec)
    if args.plan:
        action = "replace" if previous is not None else "create"
        print_plan([(action, "local server", spec.name, f"bundle {plan.bundle_digest[:19]}…")], f"{spec.name} on local")
        return 0
    with err_console.status(f"packing {spec.name}'s weights for this CPU (once per bundle)"):
        packed = local.prepack(plan)
    if packed is not None:
        err_console.print(f"[green]✓[/] {packed}", highlight=False)
    with err_console.status(f"starting {spec.name} on {args.target} (bundle {plan.bundle_digest[:19]}…)"):
        deployment = local.apply(plan, ready_timeout=args.ready_timeout)
    table = Table(title=f"{spec.name} deployed to {args.target}", show_header=False)
    table.add_row("url", f"[bold]{deployment.url}/v1[/] (OpenAI-compatible)")
    table.add_row("pid", str(deployment.pid))
    table.add_row("bundle", deployment.bundle)
    table.add_row("digest", deployment.bundle_digest)
    table.add_row("api key", deployment.api_key.describe())
    table.add_row("log", deployment.log_file)
    if deployment.start_note:
        table.add_row("start", deployment.start_note)
    if previous is not None:
        table.add_row("replaced", f"pid {previous.pid} ({previous.state}, bundle {previous.bundle_digest[:19]}…)")
    console.print(table)
    console.print(f'try it: pkg invoke {args.function} "Hello!"', highlight=False)
    return 0
