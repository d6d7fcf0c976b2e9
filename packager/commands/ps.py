"""`pkg ps`: every function deployed on this machine with the local target, from any folder.

One row per deployment recorded in the per-user state folder (`$XDG_STATE_HOME/onnxfn`): where it answers,
whether it is ready, its memory, uptime and requests served (its `/metrics`, read with its key). `--json`
prints the same as a list of objects (`LocalProcess` in packager/targets/local/inventory.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from packager.commands.status import format_uptime
from packager.gateway import control as gateway
from packager.paths import state_root
from packager.targets.local.inventory import LocalProcess, processes

console = Console()
err_console = Console(stderr=True)
_STATE_STYLES = {"ready": "green", "starting": "yellow", "idle": "cyan", "exited": "red", "failed": "red"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ps",
        help="list the functions deployed on this machine (local target)",
        description="Every function deployed with --target local by this user, whatever folder it lives in.",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list (for scripts)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    running = gateway.running()
    found, problems = processes(running.url if running is not None else None)
    for problem in problems:
        err_console.print(f"[bold red]error:[/] {escape(problem)}", highlight=False)
    if args.json:
        json.dump([process.to_json() for process in found], sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif not found:
        console.print(
            f"no function is deployed on this machine (state: {state_root()}); "
            "deploy one: pkg deploy functions/NAME --target local",
            highlight=False,
        )
    else:
        _print_table(found)
        if running is not None:
            said = f"the gateway at {running.url}/v1 routes requests by model and wakes idle functions"
        else:
            said = "no gateway runs (start it: pkg gateway start): idle functions wake only through it"
        console.print(said, highlight=False)
    return 1 if problems else 0


def _print_table(found: list[LocalProcess]) -> None:
    table = Table()
    columns = ("name", "state", "url", "model", "pid", "rss", "uptime", "requests", "bundle digest", "function")
    for column in columns:
        table.add_column(column, overflow="fold", justify="right" if column in ("rss", "requests", "pid") else "left")
    for process in found:
        style = _STATE_STYLES.get(process.state, "red")
        table.add_row(
            process.name,
            f"[{style}]{process.state}[/]" + (f" ({process.wake})" if process.wake else ""),
            f"{process.url}/v1",
            process.model,
            str(process.pid),
            _mebibytes(process.rss_bytes),
            format_uptime(process.uptime_seconds),
            "-" if process.requests is None else f"{process.requests:,}",
            process.bundle_digest[:19],
            process.function_dir or "-",
        )
    console.print(table)
    for process in found:
        if process.reason:
            console.print(f"{process.name}: {process.reason} (log: {process.log_file})", highlight=False, markup=False)
        if process.state == "crashloop":  # what it said last, as `pkg status` shows for one function
            for line in process.log_tail:
                console.print(f"  {line}", highlight=False, markup=False)
        elif process.crashes:
            said = f"{process.name}: started again by the gateway {process.crashes}x in the last minute; last end: "
            console.print(said + process.last_crash, highlight=False, markup=False)


def _mebibytes(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:,.0f} MiB"
