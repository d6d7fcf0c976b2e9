"""`pkg`: the command line. Thin: each subcommand lives in `packager/commands/` and registers itself."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from importlib import import_module

from rich.console import Console
from rich.markup import escape

from packager.errors import UserError
from packager.extras import missing_extra

# Each module exposes `register(subparsers)`, which adds its parser and sets `run(args) -> int`.
COMMAND_MODULES = (
    "init",
    "validate",
    "build",
    "image",
    "deploy",
    "invoke",
    "chat",
    "serve",
    "status",
    "ps",
    "gateway",
    "logs",
    "destroy",
    "bench",
    "push",
    "rollback",
    "adapter",
    "completion",
)
# One example per command, shown under its --help (a test checks every command has one).
EXAMPLES = {
    "init": "pkg init my-chat --template chat",
    "validate": "pkg validate functions/smollm2-chat",
    "build": "pkg build functions/smollm2-chat",
    "image": "pkg image build functions/smollm2-chat",
    "deploy": "pkg deploy functions/smollm2-chat --target local",
    "invoke": 'pkg invoke functions/smollm2-chat "Why is the sky blue?"',
    "chat": "pkg chat functions/smollm2-chat --start",
    "serve": "pkg serve functions/smollm2-chat --port 8000",
    "status": "pkg status functions/smollm2-chat --json",
    "ps": "pkg ps --json",
    "gateway": "pkg gateway start --port 8420",
    "logs": "pkg logs functions/smollm2-chat --target local --follow",
    "destroy": "pkg destroy functions/smollm2-chat --target local",
    "bench": "pkg bench cold functions/smollm2-chat",
    "push": "pkg push functions/smollm2-chat --device http://10.0.0.2:8470",
    "rollback": "pkg rollback functions/smollm2-chat --device http://10.0.0.2:8470",
    "adapter": "pkg adapter add functions/smollm2-chat upper adapters/upper",
    "completion": "pkg completion bash > ~/.local/share/bash-completion/completions/pkg",
}
EXIT_CODES = "exit codes: 0 success, 1 failure (build, deploy, network), 2 usage or spec error"

err_console = Console(stderr=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pkg", description="Build, deploy and invoke onnxfn inference functions.", epilog=EXIT_CODES
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        import_module(f"packager.commands.{name}").register(subparsers)
        command = subparsers.choices[name]
        command.epilog = f"example:\n  {EXAMPLES[name]}\n\n{EXIT_CODES}"
        command.formatter_class = argparse.RawDescriptionHelpFormatter
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
    except ModuleNotFoundError as exc:  # a command's own dependency, from an extra `pip install onnxfn` leaves out
        missing = missing_extra(exc, args.command)
        if missing is None:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(missing))}", highlight=False)
        return missing.exit_code
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        return 130
    except BrokenPipeError:
        # The reader went away (`pkg ps --json | head`): no traceback, and none again when Python flushes stdout
        # at exit (the recipe of Python's signal docs); the status a program killed by SIGPIPE would have.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
