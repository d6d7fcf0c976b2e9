"""`pkg status functions/NAME`: where the function is deployed and whether each endpoint is serving."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from packager.deploy.base import TARGETS, TargetStatus, target
from packager.errors import UserError
from packager.spec import FunctionSpec, load_spec

console = Console()
_STATE_STYLES = {
    "ready": "green", "starting": "yellow", "updating": "yellow",
    "failed": "red", "unresponsive": "red", "exited": "red", "missing": "red", "unreachable": "red",
}  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show where a function is deployed and whether it serves")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    statuses = [s for s in (_status(name, spec) for name in TARGETS) if s is not None]
    if not statuses:
        console.print(f"{spec.name} is not deployed; deploy it with: pkg deploy {args.function} --target local")
        return 0
    table = Table(title=spec.name)
    for column in ("target", "URL", "pid", "bundle digest", "state", "uptime"):
        table.add_column(column, overflow="fold")
    for status in statuses:
        style = _STATE_STYLES.get(status.state, "")
        table.add_row(
            status.target,
            status.url,
            "-" if status.pid is None else str(status.pid),
            status.bundle_digest[:19],
            f"[{style}]{status.state}[/]",
            format_uptime(status.uptime_seconds),
        )
    console.print(table)
    for status in statuses:
        if status.state != "ready":
            console.print(f"{status.target}: {status.detail}", highlight=False)
    return 0


def _status(name: str, spec: FunctionSpec) -> TargetStatus | None:
    """One target's row; a target that cannot be asked (credentials, network) says why instead of hiding the rest."""
    try:
        return target(name).status(spec)
    except UserError as exc:
        return TargetStatus(target=name, url="-", bundle_digest="", state="unreachable", detail=str(exc))


def format_uptime(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    return f"{minutes}m {secs:02d}s"
