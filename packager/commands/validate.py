"""`pkg validate functions/NAME`: check a spec without building; every problem is listed at once.

`--json` prints one object on stdout instead of the table: the spec's resolved keys (defaults filled in), where
the model source resolves to, the longest sequence it serves, and the problems (empty when valid).
"""

from __future__ import annotations

import argparse
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from packager.errors import UserError
from packager.sources import locate_source
from packager.sources.gguf_files import GgufFiles
from packager.sources.task_fit import check_source_fits_task
from packager.spec import ENCODER_TASKS, SPEC_FILE, FunctionSpec, SpecError, load_spec, spec_table

console = Console()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check a function.toml without building",
        description="Check every key of function.toml against the schema (docs/function-toml.md), that the "
        "model source exists and is the kind of model model.task serves, without building.",
    )
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument(
        "--json", action="store_true", help="print the resolved spec and its problems as one JSON object on stdout"
    )
    parser.set_defaults(run=run)


@dataclass
class _Checked:
    spec_path: Path
    spec: FunctionSpec | None
    problems: list[str]
    located: Path | GgufFiles | None = None
    input_limit: int | None = None  # an encoder's longest input, from its own config


def run(args: argparse.Namespace) -> int:
    checked = _check(args.function)
    if args.json:
        print(json.dumps(_report(checked), indent=2))
    if checked.problems:
        raise SpecError(checked.spec_path, checked.problems)
    assert checked.spec is not None
    if not args.json:
        console.print(_summary(checked))
        console.print(f"{checked.spec_path}: valid; build it with: pkg build {args.function}", highlight=False)
    return 0


def _check(function: Path) -> _Checked:
    spec_path = function / SPEC_FILE if function.is_dir() else function
    checked = _Checked(spec_path, None, [])
    try:
        checked.spec = load_spec(function)
    except SpecError as exc:
        checked.problems += exc.problems
    spec = checked.spec
    source = spec.model.source if spec else _raw_model_key(spec_path, "source")
    task = spec.model.task if spec else _raw_model_key(spec_path, "task", "chat")
    if isinstance(source, str):
        try:
            checked.located = locate_source(source, spec_path.parent)
            if isinstance(task, str):
                checked.input_limit = check_source_fits_task(source, checked.located, task)
        except UserError as exc:
            checked.problems.append(str(exc))
    return checked


def _raw_model_key(spec_path: Path, key: str, default: object = None) -> object:
    """`model.KEY` as written, so a spec with other problems still gets its source checked."""
    try:
        return tomllib.loads(spec_path.read_text()).get("model", {}).get(key, default)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError, AttributeError):
        return None


def _context(checked: _Checked) -> tuple[int, str]:
    """The longest sequence the function serves, and where that number comes from: `model` (an encoder's own
    config: sentence_bert_config.json, config.json) or `export.max_context` (what a decoder is built for)."""
    assert checked.spec is not None
    if checked.spec.model.task in ENCODER_TASKS and checked.input_limit is not None:
        return checked.input_limit, "model"
    return checked.spec.export.max_context, "export.max_context"


def _report(checked: _Checked) -> dict[str, Any]:
    spec = checked.spec
    located = checked.located
    resolved: str | list[str] | None = None
    if isinstance(located, Path):
        resolved = str(located)
    elif isinstance(located, GgufFiles):
        resolved = [str(path) for path in located.paths]
    report: dict[str, Any] = {
        "spec": str(checked.spec_path),
        "valid": not checked.problems,
        "problems": checked.problems,
        "function": spec.name if spec else None,
        "source": resolved,
        "context_tokens": None,
        "context_from": None,
        "settings": spec_table(spec) if spec else None,
    }
    if spec is not None:
        report["context_tokens"], report["context_from"] = _context(checked)
    return report


def _summary(checked: _Checked) -> Table:
    spec = checked.spec
    assert spec is not None
    table = Table(title=f"{spec.name} ({checked.spec_path})", show_header=False)
    table.add_column("setting", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("model", f"{spec.model.source} ({spec.model.task})")
    table.add_row("precision", spec.export.precision)
    tokens, origin = _context(checked)
    if origin == "model":
        table.add_row("longest input", f"{tokens} tokens (the model's own; export.max_context does not apply)")
    else:
        table.add_row("context", f"{tokens} tokens ({origin})")
    table.add_row("batch / queue", f"{spec.runtime.max_batch} / {spec.runtime.max_queue}")
    table.add_row("image", "yes" if spec.image else "no")
    return table
