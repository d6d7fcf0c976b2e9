"""The embed and classify templates list the keys those tasks read, and no chat-only ones; they still validate
(issue 39)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from packager.spec_reference import TASK_KEYS, spec_keys, tasks_of


def pkg(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "packager.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)  # fmt: skip


def listed_keys(text: str) -> set[str]:
    """The dotted keys and tables the rendered function.toml shows, set or commented out."""
    keys: set[str] = set()
    table = ""
    for line in text.splitlines():
        header = re.match(r"^(?:# )?\[([\w.-]+)\](?:  \(optional table\))?$", line)
        if header:
            table = header.group(1)
            keys.add(table)
            continue
        value = re.match(r"^(?:# )?([\w-]+) = ", line)
        if value:
            keys.add(f"{table}.{value.group(1)}" if table else value.group(1))
    return keys


@pytest.mark.parametrize(("template", "task"), [("embed", "embedding"), ("classify", "classification")])
def test_an_encoder_template_lists_only_what_its_task_reads(tmp_path: Path, template: str, task: str) -> None:
    args = ["init", "fn", "--template", template]
    if template == "classify":
        from tests.encoder.tiny_classifier import make_tiny_classifier

        args += ["--model", f"hf:{make_tiny_classifier(tmp_path / 'tiny')}"]
    result = pkg(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "functions" / "fn" / "function.toml").read_text()
    assert tomllib.loads(text)["model"]["task"] == task
    shown = listed_keys(text)
    for key in spec_keys():
        if key.key == "targets":
            continue  # a table of tables: shown as its subtables
        assert (key.key in shown) == key.applies_to(task), f"{key.key}: listed should be {key.applies_to(task)}"
    for chat_only in ("kv_memory_mb", "system_prompt", "[runtime.sampling]", "max_context =", "prepack ="):
        assert chat_only not in text, chat_only
    chat = pkg("init", "chat", "--template", "chat", cwd=tmp_path)
    assert chat.returncode == 0
    chat_lines = len((tmp_path / "functions" / "chat" / "function.toml").read_text().splitlines())
    assert len(text.splitlines()) < chat_lines - 50  # the chat keys' prose is gone, not just their values

    validated = pkg("validate", "functions/fn", cwd=tmp_path)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "longest input" in validated.stdout and "context" not in validated.stdout.split("longest input")[0]


def test_every_task_specific_key_is_a_spec_key() -> None:
    keys = {key.key for key in spec_keys()}
    assert set(TASK_KEYS) <= keys, set(TASK_KEYS) - keys
    assert tasks_of("runtime.sampling.top_p") == ("chat", "completion")  # a section's tasks hold for its keys
    assert tasks_of("runtime.max_batch") is None
