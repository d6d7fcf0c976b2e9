"""`pkg completion bash|zsh|tcsh`: a shell completion script, generated from `pkg`'s own parser by shtab."""

from __future__ import annotations

import argparse
import sys

import shtab

SHELLS = ("bash", "zsh", "tcsh")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print a completion script for your shell.",
    )
    parser.add_argument("shell", choices=SHELLS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from packager.cli import build_parser  # the whole tree, including this command

    sys.stdout.write(shtab.complete(build_parser(), shell=args.shell))
    return 0
