"""`pkg gateway start|stop|status`: the local gateway, one OpenAI endpoint for every function deployed here.

`pkg deploy --target local` starts it when it is not running; these run it by hand. `start` is a no-op when
it runs already (on another `--port` it says how to move it); `stop` leaves the functions running on their
own ports (idle ones stay stopped until it runs again); `status` exits 1 when it does not run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.console import Console

from packager.gateway import control

console = Console()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "gateway",
        help="start, stop or show the local gateway (one endpoint for every local function)",
        description="The gateway routes OpenAI requests by `model` to the functions deployed with --target local "
        f"and stops idle ones. Port: --port, else ${control.PORT_ENV}, else {control.DEFAULT_PORT}.",
    )
    parser.add_argument("action", choices=("start", "stop", "status"))
    default = f"${control.PORT_ENV}, else {control.DEFAULT_PORT}"
    parser.add_argument("--port", type=int, help=f"start: the port to listen on (default {default})")
    parser.add_argument("--host", default="127.0.0.1", help="start: the address to listen on (default 127.0.0.1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "start":
        gateway: control.Gateway | None = control.ensure(args.port, args.host)
        said = "the gateway runs"
    elif args.action == "stop":
        gateway = control.stop()
        said = "stopped the gateway" if gateway else "no gateway runs"
    else:
        gateway = control.running()
        said = "the gateway runs" if gateway else "no gateway runs (start it: pkg gateway start)"
    if args.json:
        report = {"running": args.action != "stop" and gateway is not None, "url": None, "pid": None, "port": None}
        if gateway is not None:
            report |= {"url": f"{gateway.url}/v1", "pid": gateway.pid, "port": gateway.port, "log": gateway.log_file}
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif gateway is None:
        console.print(said, highlight=False)
    else:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(gateway.started_at))
        console.print(f"{said}: {gateway.url}/v1 (pid {gateway.pid}, since {since}, log {gateway.log_file})",
                      highlight=False)  # fmt: skip
        if args.action == "stop":
            console.print("the functions keep running on their own ports; idle ones wake again once it runs")
    return 1 if args.action == "status" and gateway is None else 0
