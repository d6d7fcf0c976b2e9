"""`pkg validate functions/NAME`: check a spec without building; every problem is listed at once."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

from rich.console import Console
from rich.table import Table

from packager.errors import UserError
from packager.sources import locate_source
from packager.spec import SPEC_FILE, FunctionSpec, SpecError, load_spec

console = Console()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check a function.toml without building",
        description="Check every key of function.toml against the schema (docs/function-toml.md) and that the "
        "model source exists, without building.",
    )
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec_path = args.function / SPEC_FILE if args.function.is_dir() else args.function
    problems: list[str] = []
    spec: FunctionSpec | None = None
    try:
        spec = load_spec(args.function)
    except SpecError as exc:
        problems += exc.problems
    source = spec.model.source if spec else _raw_source(spec_path)
    if isinstance(source, str):
        try:
            locate_source(source, spec_path.parent)
        except UserError as exc:
            problems.append(str(exc))
    if problems:
        raise SpecError(spec_path, problems)
    assert spec is not None
    console.print(_summary(spec, spec_path))
    console.print(f"{spec_path}: valid; build it with: pkg build {args.function}", highlight=False)
    return 0


def _raw_source(spec_path: Path) -> object:
    """`model.source` as written, so a spec with other problems still gets its source checked."""
    try:
        return tomllib.loads(spec_path.read_text()).get("model", {}).get("source")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, AttributeError):
        return None


def _summary(spec: FunctionSpec, spec_path: Path) -> Table:
    table = Table(title=f"{spec.name} ({spec_path})", show_header=False)
    table.add_column("setting", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("model", f"{spec.model.source} ({spec.model.task})")
    table.add_row("precision", spec.export.precision)
    table.add_row("context", str(spec.export.max_context))
    table.add_row("batch / queue", f"{spec.runtime.max_batch} / {spec.runtime.max_queue}")
    table.add_row("image", "yes" if spec.image else "no")
    return table
