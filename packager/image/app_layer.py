"""The two layers that change per build: the function's bundle and the runtime code with its entry point.

The bundle layer holds exactly the bundle's files (its digest follows the manifest's), so it is built
once per bundle and cached; the code layer is small and rebuilt every time. Both are reproducible.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
from pathlib import Path, PurePosixPath

import jinja2

import runtime
from packager.cache import cached_dir, digest_of, read_json, write_json
from packager.image.base import IMAGE_PYTHON, compile_tree
from packager.image.layers import Entry, Layer, tree_entries, write_layer
from runtime.bundle import Manifest, open_bundle

APP_DIR = "/opt/onnxfn/app"
BUNDLE_DIR = "/opt/onnxfn/bundle"
ENTRYPOINT = f"{APP_DIR}/entrypoint.sh"
LAMBDA_HANDLER = "runtime.aws_lambda.handler.handler"
TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
RUNTIME_SOURCE = Path(runtime.__file__).resolve().parent
BUNDLE_LAYER_VERSION = 2


def bundle_layer(bundle: Path, manifest: Manifest) -> tuple[Layer, bool]:
    """The bundle's files under `BUNDLE_DIR`, cached by the manifest's digest (which covers every file's hash)."""
    key = digest_of("bundle-layer", BUNDLE_LAYER_VERSION, manifest.digest)

    def produce(entry: Path) -> None:
        open_bundle(bundle, verify=True)  # the files must match the manifest whose digest keys this entry
        layer = write_layer(tree_entries(bundle, BUNDLE_DIR), entry / "layer.tar", "bundle", compress=False)
        write_json(entry / "layer.json", {**layer.to_json(), "path": "layer.tar"})

    entry, reused = cached_dir("image-bundle", key, produce)
    data = read_json(entry / "layer.json")
    return Layer.from_json({**data, "path": str(entry / data["path"])}), reused


def code_layer(out: Path, entrypoint: str) -> Layer:
    """The `runtime` package (sources and hash-checked bytecode) and the rendered entry point."""
    with tempfile.TemporaryDirectory(prefix="onnxfn-code-") as scratch:
        package = Path(scratch) / "runtime"
        shutil.copytree(RUNTIME_SOURCE, package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        compile_tree(package, f"{APP_DIR}/runtime")
        script = Path(scratch) / "entrypoint.sh"
        script.write_text(entrypoint)
        script.chmod(0o755)
        entries = [*tree_entries(package, f"{APP_DIR}/runtime"), Entry(script, PurePosixPath(ENTRYPOINT))]
        return write_layer(entries, out, "code")


def render_entrypoint(
    function: str, server_flags: list[str], auth_flags: list[str], *, bundle_dir: str = BUNDLE_DIR
) -> str:
    """The entry script; `server_flags` configure every mode, `auth_flags` only the OpenAI API.

    SageMaker's `serve` mode has no bearer key: SageMaker authenticates callers (IAM) before the container.
    """
    template = _templates().get_template("entrypoint.sh.j2")
    return template.render(
        function=function,
        bundle_dir=shlex.quote(bundle_dir),
        flags=shlex.join(server_flags),
        function_flags=shlex.quote(shlex.join(server_flags)),  # one shell word: the queue modes' ONNXFN_FLAGS
        auth_flags=shlex.join(auth_flags),
        lambda_handler=LAMBDA_HANDLER,
    )


def image_env() -> list[str]:
    return [
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        f"PYTHONPATH={APP_DIR}:/opt/onnxfn/python",
        "PYTHONUNBUFFERED=1",
        f"ONNXFN_PYTHON={IMAGE_PYTHON}",
    ]


def _templates() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), keep_trailing_newline=True, undefined=jinja2.StrictUndefined
    )
