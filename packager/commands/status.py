"""`pkg status functions/NAME`: where the function is deployed and whether each endpoint is serving.

Exits 1 when an endpoint is down for good (`exited`, `failed`), saying why, so scripts can tell. With
`--base-url` or `--api-key` it prints only that value, what an OpenAI client needs
(`OPENAI_BASE_URL=$(pkg status functions/NAME --base-url)`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TypedDict

from rich.console import Console
from rich.table import Table

from packager.errors import UserError
from packager.spec import FunctionSpec, load_spec
from packager.targets.base import TARGETS, TargetStatus, target

console = Console()
DOWN_STATES = ("exited", "failed", "crashloop")  # the server is gone or cannot start: status exits 1
_STATE_STYLES = {
    "ready": "green", "starting": "yellow", "updating": "yellow", "idle": "cyan",
    "failed": "red", "unresponsive": "red", "exited": "red", "missing": "red", "unreachable": "red",
    "crashloop": "red",
}  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show where a function is deployed and whether it serves",
        description="One row per target the function is deployed to.",
    )
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for scripts)")
    parser.add_argument(
        "--target", choices=TARGETS, help="only this target (default: all; local for --base-url/--api-key)"
    )
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--base-url", action="store_true", help="print only the endpoint's OpenAI base URL (…/v1), for a client"
    )
    only.add_argument(
        "--api-key", action="store_true", help="print only the API key clients send (empty when there is no auth)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    if args.base_url or args.api_key:
        return _print_endpoint(spec, args)
    statuses = [s for s in (_status(name, spec) for name in ([args.target] if args.target else TARGETS)) if s]
    down = 1 if any(status.state in DOWN_STATES for status in statuses) else 0
    if args.json:
        json.dump([_row(status, spec) for status in statuses], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return down
    if not statuses:
        console.print(f"{spec.name} is not deployed; deploy it with: pkg deploy {args.function} --target local")
        return 0
    table = Table(title=spec.name)
    for column in ("target", "endpoint", "bundle digest", "state", "scaling min/max", "last deploy", "uptime"):
        table.add_column(column, overflow="fold")
    for status in statuses:
        style = _STATE_STYLES.get(status.state, "")
        row = _row(status, spec)
        deployed = row["last_deploy"]
        table.add_row(
            status.target,
            status.url,
            status.bundle_digest[:19],
            f"[{style}]{status.state}[/]",
            "{}/{}".format(*row["scaling"]),
            time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(deployed)) if deployed else "-",
            format_uptime(status.uptime_seconds),
        )
    console.print(table)
    for status in statuses:
        if status.state != "ready":
            console.print(f"{status.target}: {status.detail}", highlight=False, markup=False)
    return down


def _print_endpoint(spec: FunctionSpec, args: argparse.Namespace) -> int:
    """One value on stdout, nothing else: `$(pkg status … --api-key)` must be the key."""
    endpoint = target(args.target or "local").http_endpoint(spec)
    if endpoint is None:
        raise UserError(f"--target {args.target} has no HTTP endpoint to print; `pkg status {spec.directory}` shows it")
    if args.base_url:
        print(f"{endpoint.url}/v1")
    else:
        print(endpoint.headers.get("Authorization", "").removeprefix("Bearer "))
    return 0


def _status(name: str, spec: FunctionSpec) -> TargetStatus | None:
    """One target's row; a target that cannot be asked (credentials, network) says why instead of hiding the rest."""
    try:
        return target(name).status(spec)
    except UserError as exc:
        return TargetStatus(target=name, url="-", bundle_digest="", state="unreachable", detail=str(exc))


class _Row(TypedDict):
    """One target's row, as the table shows it and as `--json` prints it."""

    target: str
    endpoint: str
    bundle_digest: str
    state: str
    scaling: tuple[int | str, int | str]
    last_deploy: float | None
    uptime_seconds: float | None
    pid: int | None
    detail: str


def _row(status: TargetStatus, spec: FunctionSpec) -> _Row:
    return {
        "target": status.target,
        "endpoint": status.url,
        "bundle_digest": status.bundle_digest,
        "state": status.state,
        "scaling": target(status.target).scaling(spec),  # from the spec the deploy applied: (min, max)
        "last_deploy": _deployed_at(status),
        "uptime_seconds": status.uptime_seconds,
        "pid": status.pid,
        "detail": status.detail,
    }


def _deployed_at(status: TargetStatus) -> float | None:
    deployment = status.deployment
    stamp = getattr(deployment, "updated_at", None) or getattr(deployment, "started_at", None)
    return float(stamp) if stamp else None


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
