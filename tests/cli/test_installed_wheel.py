"""`pkg` from a wheel installed outside the checkout: nothing may reach into the source tree (`scripts/`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(command: list[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(part) for part in command], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
    return result


def test_pkg_and_pkg_bench_run_from_an_installed_wheel(tmp_path: Path, demo_bundle: Path) -> None:
    # Built from a copy: setuptools writes build/lib inside the project, which is where `pkg build` puts functions,
    # and a reused build/lib would carry modules since deleted into the wheel.
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source / "pyproject.toml")
    for package in ("packager", "runtime"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", source],
        cwd=tmp_path)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("onnxfn-*.whl")
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
