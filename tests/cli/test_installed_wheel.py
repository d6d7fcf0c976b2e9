"""`pkg` from a wheel installed outside the checkout: nothing may reach into the source tree (`scripts/`), and
without its extras every command but `build` works (issue 47, row 7)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The base dependencies' wheels, downloaded once (pip's configured index: PyPI) and reused by later runs, so the
# lean install resolves offline (`--no-index`) in seconds.
WHEELHOUSE = Path(os.environ.get("ONNXFN_TEST_WHEELHOUSE", Path.home() / ".cache" / "onnxfn-tests" / "wheelhouse"))


def run(command: list[str | Path], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = failing(command, cwd, env)
    assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
    return result


def failing(
    command: list[str | Path], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(part) for part in command], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy: setuptools writes build/lib inside the project, which is where `pkg build` puts functions,
    # and a reused build/lib would carry modules since deleted into the wheel.
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source / "pyproject.toml")
    for package in ("packager", "runtime"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", root / "dist", source],
        cwd=root)  # fmt: skip
    (built,) = (root / "dist").glob("onnxfn-*.whl")
    return built


def test_pkg_and_pkg_bench_run_from_an_installed_wheel(tmp_path: Path, wheel: Path, demo_bundle: Path) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    python = venv / "bin" / "python"
    # The dependencies come from this venv's site-packages, added as a plain path: its editable install of onnxfn
    # is a .pth hook, which a plain path entry does not run, so `packager` can only come from the wheel.
    purelib = Path(
        run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path).stdout.strip()
    )
    (purelib / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", wheel], cwd=tmp_path)

    where = run(
        [python, "-c", "import packager.bench.worker, runtime; print(packager.bench.worker.__file__)"], tmp_path
    )
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    assert "deploy" in run([venv / "bin" / "pkg", "--help"], tmp_path).stdout
    cold = run([venv / "bin" / "pkg", "bench", "cold", "--help"], tmp_path).stdout
    assert "--runs" in cold and "--no-peers" in cold
    # And it measures: its workers start by module name, from the wheel (before: "runs from a source checkout").
    out = tmp_path / "cold.json"
    run([venv / "bin" / "pkg", "bench", "cold", demo_bundle.resolve(), "--runs", "1", "--no-peers", "--out", out],
        tmp_path)  # fmt: skip
    results = json.loads(out.read_text())
    assert results["runs"] == 1 and "onnxfn, no snapshot" in results["warm_cache"], results


def test_without_extras_every_command_but_build_works_and_build_says_what_to_install(
    tmp_path: Path, wheel: Path
) -> None:
    """`pip install onnxfn` (no extras) into a fresh venv: before, every command, `--help` included, died with
    `ModuleNotFoundError: No module named 'gguf'` (the adapter command imported the GGUF LoRA reader)."""
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary", ":all:", "--dest", WHEELHOUSE, wheel],
        tmp_path)  # fmt: skip
    venv = tmp_path / "lean"
    run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    python, pkg = venv / "bin" / "python", venv / "bin" / "pkg"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-compile", "--no-index",
         "--find-links", WHEELHOUSE, wheel], tmp_path)  # fmt: skip
    for heavy in ("torch", "transformers", "gguf", "onnx", "onnxruntime_genai", "peft", "oras"):
        assert failing([python, "-c", f"import {heavy}"], tmp_path).returncode == 1, f"{heavy} is installed"

    project = tmp_path / "project"
    project.mkdir()
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "PATH": f"{venv / 'bin'}:/usr/bin:/bin"}
    # `pkg --help` builds every command's parser: every command module imports without the extras.
    listed = run([pkg, "--help"], project, env).stdout
    assert all(f"    {command} " in listed for command in ("init", "validate", "build", "deploy", "adapter")), listed
    assert "--target" in run([pkg, "deploy", "--help"], project, env).stdout
    assert "--allowed-host" in run([python, "-m", "runtime", "serve", "--help"], project, env).stdout

    run([pkg, "init", "my-chat", "--template", "chat"], project, env)
    assert (project / "functions" / "my-chat" / "function.toml").is_file()
    folder = project / "functions" / "gguf-chat"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    (folder / "function.toml").write_text('name = "gguf-chat"\n[model]\nsource = "gguf:model.gguf"\n')
    assert "valid" in run([pkg, "validate", "functions/gguf-chat"], project, env).stdout
    assert run([pkg, "ps", "--json"], project, env).stdout.strip() == "[]"
    assert "gguf-chat is not deployed" in run([pkg, "status", "functions/gguf-chat"], project, env).stdout
    assert "complete -o bashdefault" in run([pkg, "completion", "bash"], project, env).stdout

    build = failing([pkg, "build", "functions/gguf-chat"], project, env)
    assert build.returncode == 1, build.stdout + build.stderr
    assert "pip install 'onnxfn[packager]'" in build.stderr and "Traceback" not in build.stderr, build.stderr
