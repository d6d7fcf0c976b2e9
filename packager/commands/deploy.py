"""`pkg deploy functions/NAME --target TARGET`: create or update the function's endpoint on a target.

`--plan` prints what would change, as a table, and changes nothing. `--emit-terraform DIR` writes a
Terraform root module with the same resources and settings instead of deploying (AWS targets).
`--emit-kubernetes DIR` writes Kubernetes manifests instead (`--target ray`: a KubeRay RayService).
`--json` prints one object on stdout instead of the tables (progress stays on stderr): the plan, whether it
was applied, and where the function answers: URL, model name, state, bundle digest.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from packager.progress import StepProgress
from packager.spec import FunctionSpec, load_spec
from packager.targets.base import READY_TIMEOUT, TARGETS, Deployment, Plan, PlanRow, Target, target

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
        "--emit-kubernetes", type=Path, metavar="DIR", help="write Kubernetes manifests for the target instead (ray)"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=READY_TIMEOUT, help="seconds to wait for the endpoint (local)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the result as one JSON object on stdout (progress on stderr)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    chosen = target(args.target, ready_timeout=args.ready_timeout)
    progress = StepProgress(console=err_console)
    if args.emit_terraform is not None:
        written = chosen.emit_terraform(spec, args.emit_terraform, progress)
        if args.json:
            _print_json({"function": spec.name, "target": args.target, "terraform": [str(p) for p in written]})
            return 0
        console.print(f"wrote {len(written)} files to {args.emit_terraform}: {', '.join(p.name for p in written)}")
        console.print("push the image first (pkg image push), then: terraform init && terraform apply", highlight=False)
        return 0
    if args.emit_kubernetes is not None:
        written = chosen.emit_kubernetes(spec, args.emit_kubernetes, progress)
        if args.json:
            _print_json({"function": spec.name, "target": args.target, "kubernetes": [str(p) for p in written]})
            return 0
        console.print(f"wrote {len(written)} files to {args.emit_kubernetes}: {', '.join(p.name for p in written)}")
        console.print(f"then: kubectl apply -f {args.emit_kubernetes} (docs/targets/{args.target}.md)", highlight=False)
        return 0
    plan = chosen.plan(spec, progress)
    if args.json:
        deployment = None if plan.no_changes or args.plan else chosen.apply(plan, progress)
        _print_json(deploy_report(spec, args.function, chosen, plan, deployment))
        return 0
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


def deploy_report(
    spec: FunctionSpec, function_dir: Path, chosen: Target, plan: Plan, deployment: Deployment | None
) -> dict[str, Any]:
    """What `pkg deploy --json` prints: the plan, whether it was applied, and where the function answers now
    (the target's status, alike for every target; null when it is not deployed there, as after a first `--plan`)."""
    status = chosen.status(spec)
    return {
        "function": spec.name,
        "target": chosen.name,
        "model": spec.name,  # the `model` requests name (the server's --model-name)
        "where": plan.where,
        "changes": not plan.no_changes,
        "applied": deployment is not None,
        "plan": [
            {"action": action, "resource": kind, "name": name, "settings": detail}
            for action, kind, name, detail in plan.rows()
        ],
        "url": status.url if status else None,
        "state": status.state if status else None,
        "bundle_digest": status.bundle_digest if status else None,
        "detail": status.detail if status else None,
        # The rows carry rich markup for the table (`[bold]URL[/]`): the JSON has their plain text.
        "summary": {k: Text.from_markup(v).plain for k, v in deployment.summary()} if deployment else None,
        "next_step": deployment.next_step(function_dir) if deployment is not None else None,
    }


def _print_json(report: dict[str, Any]) -> None:
    print(json.dumps(report, indent=2, default=str))


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
