"""docs/function-toml.md is generated from the schema; `pkg validate` checks a spec without building."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from packager.spec_reference import REFERENCE_PATH, render_markdown, spec_keys, stale_docs, undocumented_keys

REPO = Path(__file__).resolve().parents[2]


def test_every_spec_key_has_prose_and_no_prose_outlives_its_key() -> None:
    assert undocumented_keys() == [], "describe these keys in packager/spec_reference.py KEY_DOCS"
    assert stale_docs() == [], "these KEY_DOCS entries name keys the schema no longer has"


def test_reference_doc_matches_the_schema() -> None:
    assert REFERENCE_PATH.read_text() == render_markdown(), (
        "docs/function-toml.md is stale: run .venv/bin/python -m packager.spec_reference"
    )


def test_reference_lists_types_defaults_and_allowed_values() -> None:
    keys = {k.key: k for k in spec_keys()}
    precision = keys["export.precision"]
    assert (precision.type, precision.default) == ("string", '`"auto"`')
    assert precision.allowed.startswith("`auto`, `gguf`, `fp32`, `int8`, `int4`")
    assert keys["runtime.max_batch"].allowed == "1 … 256"
    assert keys["targets.aws-lambda.memory_mb"].used_by == "`--target aws-lambda`"
    assert keys["model.source"].default == "required"
    assert keys["image"].section and keys["image"].default == "absent"


def _validate(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "packager.cli", "validate", str(folder)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )


def test_validate_accepts_the_demo_function() -> None:
    result = _validate(REPO / "functions" / "smollm2-chat")
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout and "pkg build" in result.stdout


def test_validate_lists_every_problem_including_the_source_and_exits_2(tmp_path: Path) -> None:
    (tmp_path / "function.toml").write_text(
        '[model]\nsource = "gguf:missing.gguf"\ntask = "chatty"\n[runtime]\nmax_batch = 0\nfoo = 1\n'
    )
    result = _validate(tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "4 problem(s)" in result.stderr
    for expected in ("model.task = 'chatty'", "runtime.foo: unknown key", "runtime.max_batch = 0", "missing.gguf"):
        assert expected in result.stderr
