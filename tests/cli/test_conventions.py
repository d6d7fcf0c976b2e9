"""CLI conventions: every command has --help with an example, exit codes 0/1/2, no colour off a terminal, completion."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from packager.cli import COMMAND_MODULES, EXAMPLES

REPO = Path(__file__).resolve().parents[2]


def pkg(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "packager.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        timeout=120,
    )


def test_every_command_has_an_example_of_itself() -> None:
    assert set(EXAMPLES) == set(COMMAND_MODULES)
    for name, example in EXAMPLES.items():
        assert example.startswith(f"pkg {name} "), example


@pytest.mark.parametrize("command", COMMAND_MODULES)
def test_help_shows_the_example_and_exit_codes(command: str) -> None:
    result = pkg(command, "--help")
    assert result.returncode == 0, result.stderr
    assert f"example:\n  {EXAMPLES[command]}" in result.stdout
    assert "exit codes: 0 success, 1 failure" in result.stdout


def test_usage_mistakes_exit_2_without_traceback() -> None:
    for args in (("no-such-command",), ("status",), ("deploy", "functions/smollm2-chat", "--target", "mars")):
        result = pkg(*args)
        assert result.returncode == 2, args
        assert "Traceback" not in result.stderr and "usage: pkg" in result.stderr


def test_no_colour_codes_when_output_is_not_a_terminal() -> None:
    result = pkg("validate", "functions/smollm2-chat")
    assert result.returncode == 0
    assert "\x1b[" not in result.stdout + result.stderr
    forced = pkg("validate", "functions/smollm2-chat", env={"FORCE_COLOR": "1"})
    assert "\x1b[" in forced.stdout  # rich colours when asked, so the check above can fail


def test_bash_completion_script_is_valid_and_knows_every_command(tmp_path: Path) -> None:
    result = pkg("completion", "bash")
    assert result.returncode == 0
    script = tmp_path / "pkg.bash"
    script.write_text(result.stdout)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for command in COMMAND_MODULES:
        assert command in result.stdout
    assert "--target" in result.stdout
