"""A Docker build context for people who build with Docker: Dockerfile (from `templates/`) plus its inputs.

It yields the same layers, in the same order and with the same paths and settings, as the daemonless
build; byte-identical digests are not promised (Docker stamps its own mtimes).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jinja2

from packager.image import app_layer
from packager.image.app_layer import APP_DIR, BUNDLE_DIR, ENTRYPOINT, TEMPLATES, image_env
from packager.image.base import DEBIAN_SUITE, DEPS_PRUNE, IMAGE_PYTHON, PYTHON_DIR, runtime_requirements
from packager.spec import FunctionSpec

DEFAULT_BASE = f"debian:{DEBIAN_SUITE}-slim"


def render_dockerfile(function: str, tag: str, *, base: str = DEFAULT_BASE, port: int = 8080) -> str:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), keep_trailing_newline=True, undefined=jinja2.StrictUndefined
    )
    return environment.get_template("Dockerfile.j2").render(
        function=function,
        tag=tag,
        base=base,
        python=IMAGE_PYTHON,
        suite=DEBIAN_SUITE,
        python_dir=PYTHON_DIR,
        bundle_dir=BUNDLE_DIR,
        app_dir=APP_DIR,
        prune_paths=" ".join(f"{PYTHON_DIR}/{p}" for p in DEPS_PRUNE if not p.startswith("**/")),
        prune_names=[p.removeprefix("**/") for p in DEPS_PRUNE if p.startswith("**/")],
        env=image_env(),
        port=port,
        entrypoint=json.dumps([ENTRYPOINT]),
        cmd=json.dumps(["http"]),
    )


def write_docker_context(target: Path, spec: FunctionSpec, bundle: Path, entrypoint: str, tag: str) -> Path:
    """Fill `target` with Dockerfile, requirements.txt, bundle/ (hard links) and app/; returns `target`."""
    shutil.rmtree(target, ignore_errors=True)
    app = target / "app"
    shutil.copytree(app_layer.RUNTIME_SOURCE, app / "runtime", ignore=shutil.ignore_patterns("__pycache__"))
    script = app / "entrypoint.sh"
    script.write_text(entrypoint)
    script.chmod(0o755)
    shutil.copytree(bundle, target / "bundle", copy_function=link_or_copy)
    (target / "requirements.txt").write_text("\n".join(runtime_requirements()) + "\n")
    (target / "Dockerfile").write_text(render_dockerfile(spec.name, tag))
    (target / ".dockerignore").write_text("**/__pycache__\n")
    return target


def link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
