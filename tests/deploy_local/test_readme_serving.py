"""The README's "Serving" section runs as written: its shell lines, then its Python snippet, against a
function deployed the way the README deploys it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.deploy_local.conftest import FUNCTION, Workspace

pytestmark = pytest.mark.real_model


def serving_blocks() -> dict[str, str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Serving\n", 1)[1].split("\n## ", 1)[0]
    blocks = dict(re.findall(r"```(bash|python)\n(.*?)```", section, re.S))
    assert set(blocks) == {"bash", "python"}, "the Serving section shows one shell and one Python block"
    return blocks


def test_the_serving_snippet_streams_a_reply_as_written(workspace: Workspace) -> None:
    blocks = serving_blocks()
    assert "smollm2-chat" in blocks["bash"] and FUNCTION == "smollm2-chat"
    workspace.add_function(FUNCTION)
    # The README runs from a checkout: `.venv/bin/pkg` there is this interpreter's environment.
    (workspace.root / ".venv").symlink_to(Path(sys.executable).parents[1])
    assert workspace.pkg("deploy", f"functions/{FUNCTION}", "--target", "local").returncode == 0
    (workspace.root / "snippet.py").write_text(blocks["python"])
    env = {k: v for k, v in workspace.env.items() if not k.startswith("OPENAI_")}
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", blocks["bash"] + ".venv/bin/python snippet.py\n"],
        cwd=workspace.root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip()) > 10, result.stdout
    assert workspace.pkg("destroy", f"functions/{FUNCTION}").returncode == 0
