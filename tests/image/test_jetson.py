"""The Jetson variant's build context, checked against its contract (nothing is built: no Jetson here)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from packager.errors import UserError
from packager.image.jetson import JETPACK_6, write_jetson_context
from packager.spec import FunctionSpec


def wheel(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("onnxruntime/__init__.py", "")
    return path


def test_context_uses_l4t_the_wheel_and_gpu_providers(
    demo_bundle: Path, demo_spec: FunctionSpec, tmp_path: Path
) -> None:
    gpu_wheel = wheel(tmp_path, "onnxruntime_gpu-1.23.0-cp310-cp310-linux_aarch64.whl")
    context = write_jetson_context(tmp_path / "jetson", demo_spec, demo_bundle, gpu_wheel)
    dockerfile = (context / "Dockerfile").read_text()
    assert dockerfile.splitlines()[6] == f"FROM {JETPACK_6.reference}"
    assert f"COPY wheels/{gpu_wheel.name} requirements.txt /tmp/onnxfn/" in dockerfile
    assert (context / "wheels" / gpu_wheel.name).read_bytes() == gpu_wheel.read_bytes()
    requirements = (context / "requirements.txt").read_text().split()
    assert "onnxruntime" not in requirements and "numpy" in requirements and "awslambdaric" in requirements
    entrypoint = (context / "app" / "entrypoint.sh").read_text()
    assert entrypoint.count("--providers tensorrt,cuda,cpu") == 3  # http, SageMaker and the queue modes' flags
    assert "--providers cpu" not in entrypoint
    assert sorted(p.name for p in (context / "bundle").iterdir()) == sorted(p.name for p in demo_bundle.iterdir())


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("onnxruntime_gpu-1.23.0-cp310-cp310-linux_x86_64.whl", "is not aarch64"),
        ("onnxruntime_gpu-1.23.0-cp311-cp311-linux_aarch64.whl", "does not include cp310"),
        ("onnxruntime-1.23.0-cp310-cp310-linux_aarch64.whl", "is not onnxruntime_gpu"),
    ],
)
def test_wrong_wheel_is_refused(
    demo_bundle: Path, demo_spec: FunctionSpec, tmp_path: Path, name: str, problem: str
) -> None:
    with pytest.raises(UserError, match=problem):
        write_jetson_context(tmp_path / "jetson", demo_spec, demo_bundle, wheel(tmp_path, name))
