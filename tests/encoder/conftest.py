"""The minilm-embed bundle, built once per session by the real `pkg build` pipeline (cached by content)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from packager.encoder.build import EncoderBuildResult

REPO = Path(__file__).resolve().parents[2]
EMBED_FUNCTION = REPO / "functions" / "minilm-embed"
API_KEY = "embed-test-key"


@pytest.fixture(scope="session")
def embed_build() -> EncoderBuildResult:
    from packager.build import build_function
    from packager.progress import StepProgress
    from packager.spec import load_spec

    previous = Path.cwd()
    os.chdir(REPO)
    try:
        result = build_function(load_spec(EMBED_FUNCTION), StepProgress())
    finally:
        os.chdir(previous)
    assert isinstance(result, EncoderBuildResult)
    return result


@pytest.fixture(scope="session")
def embed_bundle(embed_build: EncoderBuildResult) -> Path:
    return REPO / embed_build.bundle


@dataclass(frozen=True)
class EmbedServer:
    url: str
    headers: dict[str, str]


@pytest.fixture(scope="module")
def embed_server(embed_bundle: Path) -> Iterator[EmbedServer]:
    """`python -m runtime serve` on a free port: the same process the local target starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "EMBED_TEST_KEY": API_KEY}
    command = [
        *(sys.executable, "-m", "runtime", "serve", str(embed_bundle), "--port", str(port)),
        *("--api-key-env", "EMBED_TEST_KEY", "--max-batch", "8", "--no-verify", "--log-level", "warning"),
    ]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the embedding server did not become ready in 60 s"
            time.sleep(0.1)
        yield EmbedServer(url=url, headers={"Authorization": f"Bearer {API_KEY}"})
    finally:
        process.terminate()
        process.wait(timeout=15)


CLASSIFY_FUNCTION = "tiny-classify"


@dataclass(frozen=True)
class ClassifierBuild:
    root: Path  # the working folder `pkg` ran in (holds functions/ and build/)
    model_dir: Path  # the Hugging Face folder of the tiny classifier
    function_dir: Path
    bundle: Path
    build_output: str  # what `pkg build` printed


def pkg(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The `pkg` CLI in a fresh process, as a user runs it."""
    environment = {**os.environ, "COLUMNS": "200", **(env or {})}
    command = [sys.executable, "-m", "packager.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=environment, timeout=300)


@pytest.fixture(scope="session")
def classifier_build(tmp_path_factory: pytest.TempPathFactory) -> ClassifierBuild:
    """The tiny random-weight BERT classifier built at fp32 by `pkg build` (export, parity, verify, bundle)."""
    from tests.encoder.tiny_classifier import make_tiny_classifier

    root = tmp_path_factory.mktemp("classify")
    model_dir = make_tiny_classifier(root / "tiny-bert-classifier")
    function_dir = root / "functions" / CLASSIFY_FUNCTION
    function_dir.mkdir(parents=True)
    (function_dir / "function.toml").write_text(
        f'name = "{CLASSIFY_FUNCTION}"\n\n[model]\nsource = "hf:{model_dir}"\ntask = "classification"\n\n'
        '[export]\nprecision = "fp32"\n\n[runtime]\nmax_batch = 8\nthreads = 2\n\n'
        '[endpoint]\napi_key_env = "CLASSIFY_TEST_KEY"\n'
    )
    result = pkg("build", f"functions/{CLASSIFY_FUNCTION}", cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    bundle = root / "build" / CLASSIFY_FUNCTION / "bundle"
    return ClassifierBuild(root, model_dir, function_dir, bundle, result.stdout)
