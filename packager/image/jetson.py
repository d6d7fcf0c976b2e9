"""The Jetson variant: a Docker build context on an L4T base with the user's onnxruntime-gpu wheel.

NVIDIA publishes onnxruntime-gpu for Jetson outside PyPI, built per JetPack release, so the user
passes the wheel file; its tags must name aarch64 Linux and the base's CPython. The engine asks for
TensorRT, then CUDA, then CPU. Nothing here is built or run on this machine (no Jetson, no NVIDIA
registry): the context is checked against that contract and rendered for `docker build` on a device.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import jinja2

from packager.errors import UserError
from packager.image import app_layer
from packager.image.app_layer import APP_DIR, BUNDLE_DIR, ENTRYPOINT, TEMPLATES, image_env, render_entrypoint
from packager.image.base import PYTHON_DIR, RUNTIME_DISTRIBUTIONS
from packager.image.dockerfile import link_or_copy
from packager.runtime_flags import server_flags
from packager.spec import FunctionSpec

PROVIDERS = ("tensorrt", "cuda", "cpu")


@dataclass(frozen=True)
class L4TBase:
    reference: str
    python: str  # CPython of the base's Ubuntu, e.g. 3.10


JETPACK_6 = L4TBase("nvcr.io/nvidia/l4t-jetpack:r36.4.0", "3.10")


def check_wheel(wheel: Path, base: L4TBase) -> None:
    """Refuse a wheel that cannot be onnxruntime-gpu for this base: wrong project, CPU arch or CPython."""
    if not wheel.is_file():
        raise UserError(f"onnxruntime-gpu wheel {wheel} does not exist", exit_code=2)
    parts = wheel.name.removesuffix(".whl").split("-")
    if len(parts) < 5 or not wheel.name.endswith(".whl"):
        raise UserError(f"{wheel.name} is not a wheel file name (NAME-VERSION-PYTHON-ABI-PLATFORM.whl)", exit_code=2)
    name, python_tag, platform_tag = parts[0], parts[-3], parts[-1]
    cpython = "cp" + base.python.replace(".", "")
    problems = []
    if name.lower() != "onnxruntime_gpu":
        problems.append(f"project {name!r} is not onnxruntime_gpu")
    if "aarch64" not in platform_tag:
        problems.append(f"platform {platform_tag!r} is not aarch64")
    if cpython not in python_tag.split("."):
        problems.append(f"python tag {python_tag!r} does not include {cpython} (the Python of {base.reference})")
    if problems:
        raise UserError(f"{wheel.name} does not fit the Jetson image: {'; '.join(problems)}", exit_code=2)


def write_jetson_context(
    target: Path, spec: FunctionSpec, bundle: Path, wheel: Path, base: L4TBase = JETPACK_6
) -> Path:
    check_wheel(wheel, base)
    shutil.rmtree(target, ignore_errors=True)
    (target / "wheels").mkdir(parents=True)
    shutil.copy2(wheel, target / "wheels" / wheel.name)
    shutil.copytree(bundle, target / "bundle", copy_function=link_or_copy)
    app = target / "app"
    shutil.copytree(app_layer.RUNTIME_SOURCE, app / "runtime", ignore=shutil.ignore_patterns("__pycache__"))
    flags = [*_without_providers(server_flags(spec)), "--providers", ",".join(PROVIDERS)]
    auth = ["--api-key-env", spec.endpoint.api_key_env] if spec.endpoint.api_key_env else []
    (app / "entrypoint.sh").write_text(render_entrypoint(spec.name, flags, auth))
    (app / "entrypoint.sh").chmod(0o755)
    # Unpinned: the CPU image's pins are for CPython 3.11 (numpy 2.4 no longer supports 3.10).
    others = [name for name in RUNTIME_DISTRIBUTIONS if name != "onnxruntime"]
    (target / "requirements.txt").write_text("\n".join(others) + "\nawslambdaric\n")
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined)
    text = environment.get_template("Dockerfile.jetson.j2").render(
        function=spec.name,
        base=base.reference,
        python=base.python,
        wheel=wheel.name,
        providers=", ".join(PROVIDERS),
        python_dir=PYTHON_DIR,
        bundle_dir=BUNDLE_DIR,
        app_dir=APP_DIR,
        env=[v for v in image_env() if not v.startswith("ONNXFN_PYTHON=")] + [f"ONNXFN_PYTHON={base.python}"],
        port=8080,
        entrypoint=json.dumps([ENTRYPOINT]),
    )
    (target / "Dockerfile").write_text(text + "\n")
    return target


def _without_providers(flags: list[str]) -> list[str]:
    if "--providers" not in flags:
        return flags
    at = flags.index("--providers")
    return flags[:at] + flags[at + 2 :]
