"""`pkg`: the command line. Thin: each subcommand lives in `packager/commands/` and registers itself."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import import_module

from rich.console import Console
from rich.markup import escape

from packager.errors import UserError

# Each module exposes `register(subparsers)`, which adds its parser and sets `run(args) -> int`.
COMMAND_MODULES = (
    "init",
    "validate",
    "build",
    "image",
    "deploy",
    "invoke",
    "status",
    "logs",
    "destroy",
    "bench",
    "push",
    "rollback",
)

err_console = Console(stderr=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pkg", description="Build, deploy and invoke onnxfn inference functions.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        import_module(f"packager.commands.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except UserError as exc:
        # Messages quote TOML tables like [runtime]: print them as text, not as rich markup.
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return exc.exit_code
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
