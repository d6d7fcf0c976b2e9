"""`pkg rollback functions/NAME --device URL[,URL…]`: make each device serve its previous bundle again."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from packager.commands.push import add_device_arguments, tls_flags
from packager.edge.devices import edge_options
from packager.edge.fleet import rollback
from packager.edge.progress import DeviceProgress, print_results
from packager.spec import load_spec

console = Console()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("rollback", help="switch edge devices back to their previous bundle")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    add_device_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    options = edge_options(spec.targets.edge, args.device, args.token_file, tls_flags(args))
    with DeviceProgress(console, options.devices) as progress:
        results = rollback(options.devices, options.auth, progress.update)
    return print_results(console, f"rollback {spec.name}", results)
