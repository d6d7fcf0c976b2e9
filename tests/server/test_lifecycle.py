"""Start-up states (`/health` vs `/ready`), load failures, and the `python -m runtime serve` exit codes."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from packager.runtime_flags import server_flags
from packager.spec import load_spec
from runtime.api.protocol import RequestPolicy
from runtime.bundle import MANIFEST_NAME, Manifest, file_digest, manifest_bytes, read_manifest
from runtime.http.app import create_app
from runtime.http.state import ServerSettings
from runtime.startup import add_model_arguments, engine_config
from tests.conftest import DEMO_FUNCTION

POLICY = RequestPolicy(model_name="fn", vocab_size=100)
CHAT = {"model": "fn", "messages": [{"role": "user", "content": "hi"}]}


def test_ready_follows_the_engine_load_and_reports_its_failure() -> None:
    gate = threading.Event()
    failures: list[str] = []

    def load_engine() -> object:
        gate.wait(10)
        raise RuntimeError("model.onnx is corrupt")

    settings = ServerSettings(policy=POLICY)
    app = create_app(settings, load_engine, on_load_failure=lambda: failures.append("x"))  # type: ignore[arg-type]
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "ok"}
        assert (client.get("/ready").status_code, client.get("/ready").json()) == (503, {"status": "loading"})
        loading = client.post("/v1/chat/completions", json=CHAT)
        assert loading.status_code == 503
        assert "still loading" in loading.json()["error"]["message"]
        assert "onnxfn_ready 0.0" in client.get("/metrics").text
        gate.set()
        deadline = time.monotonic() + 10
        while client.get("/ready").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.get("/ready").json() == {"status": "failed", "error": "RuntimeError: model.onnx is corrupt"}
        failed = client.post("/v1/chat/completions", json=CHAT)
        assert failed.status_code == 503
        assert failed.json()["error"]["message"] == "the model failed to load: RuntimeError: model.onnx is corrupt"
        assert client.get("/health").status_code == 200
    assert failures == ["x"]


def run_serve(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_serve_refuses_a_missing_bundle_or_key(tmp_path: Path, demo_bundle: Path) -> None:
    missing = run_serve(str(tmp_path / "nothing"))
    assert missing.returncode == 2
    assert "manifest.json is missing" in missing.stderr
    no_key = run_serve(str(demo_bundle), "--api-key-env", "ONNXFN_TEST_UNSET_KEY")
    assert no_key.returncode == 2
    assert "ONNXFN_TEST_UNSET_KEY is unset or empty" in no_key.stderr
    both = run_serve(str(demo_bundle), "--decode", "throughput", "--speculative")
    assert both.returncode == 2
    assert "--speculative verifies drafts through the int8 graph" in both.stderr
    assert "Traceback" not in both.stderr


def test_serve_exits_1_when_the_engine_cannot_load(tmp_path: Path, demo_bundle: Path) -> None:
    """A well-formed bundle whose model file is garbage: the server must stop, not sit there unready."""
    real = read_manifest(demo_bundle)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    shutil.copy(demo_bundle / real.tokenizer_file, bundle / real.tokenizer_file)
    (bundle / real.model_file).write_bytes(b"this is not an ONNX model")
    files = {name: file_digest(bundle / name) for name in (real.model_file, real.tokenizer_file)}
    manifest = Manifest.from_json({**real.to_json(), "files": {k: v.__dict__ for k, v in files.items()}})
    (bundle / MANIFEST_NAME).write_bytes(manifest_bytes(manifest.to_json()))
    result = run_serve(str(bundle), "--port", "0")
    assert result.returncode == 1, result.stderr
    assert "the engine failed to load" in result.stderr


def test_the_prefill_graph_choice_reaches_the_engine_from_function_toml() -> None:
    """`[runtime] prefill_matmuls` → the deploy's server flags → the server's `EngineConfig`."""
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert engine_config(parser.parse_args([])).prefill_matmuls == "auto"
    spec = load_spec(DEMO_FUNCTION)
    for choice in ("auto", "fp32", "quantized"):
        runtime = dataclasses.replace(spec.runtime, prefill_matmuls=choice)
        flags = server_flags(dataclasses.replace(spec, runtime=runtime))
        assert flags[flags.index("--prefill-matmuls") + 1] == choice
        assert engine_config(parser.parse_args(flags)).prefill_matmuls == choice
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["--prefill-matmuls", "int4"])
    assert refused.value.code == 2
