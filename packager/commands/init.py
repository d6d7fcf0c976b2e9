"""`pkg init NAME --template chat`: a new function folder that `pkg build` accepts without edits."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from packager.scaffold import TEMPLATE_NAMES, render_function

console = Console()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "init",
        help="create a function folder from a template",
        description="Create functions/NAME (function.toml with every key commented, README.md, prompts.txt).",
    )
    parser.add_argument("name", help="function name, or a folder path whose last part is the name")
    parser.add_argument("--template", choices=TEMPLATE_NAMES, default="chat")
    parser.add_argument("--model", metavar="SOURCE", help="model.source (default: the template's demo model)")
    parser.add_argument("--dir", type=Path, default=Path("functions"), help="parent folder (default: functions)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing folder")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    destination = Path(args.name) if "/" in args.name else args.dir / args.name
    written = render_function(destination, args.template, source=args.model, force=args.force)
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    console.print(f"next: pkg validate {destination} && pkg build {destination}", highlight=False)
    return 0
