"""`pkg image build --push` and `pkg image push` stream a multi-GB bundle: their memory does not grow with it.

The bundle is the demo's with its weights file grown by a 1.5 GB hole (tests/fixtures/large_bundle.py): the bundle
layer's tar, its digests and the registry upload each go through those bytes. Each command runs as its own process,
the resident memory of its process tree sampled from outside (as the build's bound is checked). The bound is what
a Python process with the packager's imports and a few upload chunks needs: a sixth of the bundle.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import requests

from packager.bench.local_registry import LocalRegistry
from packager.bench.shipping import image_cache
from packager.image import ImageResult
from packager.memory import SampledRun, run_sampled
from tests.fixtures.large_bundle import padded_function

REPO = Path(__file__).resolve().parents[2]
NAME = "image-at-size"
PADDING = 1_500_000_000
BOUND = 256 << 20


@pytest.fixture(scope="module")
def project(demo_image: ImageResult, demo_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project whose function's bundle is the padded demo, and a cache of its own that shares only the runtime
    base layers (already built for `demo_image`): the bundle layer is written by the command measured."""
    root = tmp_path_factory.mktemp("image-at-size")
    padded_function(root, NAME, demo_bundle, PADDING)
    image_cache(root / "cache")
    return root


def pkg(project: Path, *argv: str) -> tuple[SampledRun, str]:
    env = {**os.environ, "ONNXFN_CACHE_DIR": str(project / "cache"), "PYTHONPATH": str(REPO)}
    log_path = project / f"pkg-{argv[1]}.log"
    with log_path.open("w+") as log:
        run = run_sampled([sys.executable, "-m", "packager.cli", *argv], cwd=project, env=env, stdout=log)
        log.seek(0)
        output = log.read()
    assert run.returncode == 0, output[-3000:]
    return run, output


def bundle_layer_size(registry: LocalRegistry, repository: str, layout: Path) -> int:
    """The size the registry holds of the image's bundle layer (third of four), asked of the registry."""
    blobs = layout / "blobs" / "sha256"
    index = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    manifest_digest = json.loads((blobs / index.removeprefix("sha256:")).read_text())["manifests"][0]["digest"]
    manifest = json.loads((blobs / manifest_digest.removeprefix("sha256:")).read_text())
    digest = manifest["layers"][2]["digest"]
    head = requests.head(f"http://{registry.address}/v2/{repository}/blobs/{digest}", timeout=10)
    assert head.status_code == 200, (repository, digest, head.status_code)
    return int(head.headers["Content-Length"])


def test_image_build_and_push_of_a_multi_gb_bundle_stay_in_bounded_memory(
    project: Path, registry: LocalRegistry
) -> None:
    weights = (project / "build" / NAME / "bundle" / "model.onnx.data").stat().st_size
    assert weights > PADDING

    built, output = pkg(project, "image", "build", f"functions/{NAME}", "--push", f"{registry.address}/onnxfn/{NAME}")
    print(f"\npkg image build --push of a {weights / 1e9:.2f} GB bundle: {built.seconds:.1f} s, "
          f"peak RSS {built.peak_rss / 2**20:.0f} MiB")  # fmt: skip
    assert "peak RSS of the build" in output
    assert built.peak_rss < BOUND, f"pkg image build peaked at {built.peak_rss / 2**20:.0f} MiB"
    layout = project / "build" / NAME / "image"
    assert bundle_layer_size(registry, f"onnxfn/{NAME}", layout) > weights

    # `pkg image push` of the built layout to another repository: every blob is uploaded again.
    pushed, output = pkg(project, "image", "push", f"functions/{NAME}", f"{registry.address}/onnxfn/{NAME}-copy")
    print(f"pkg image push: {pushed.seconds:.1f} s, peak RSS {pushed.peak_rss / 2**20:.0f} MiB")
    assert "peak RSS of this push" in output and "0 already there" in output
    assert pushed.peak_rss < BOUND, f"pkg image push peaked at {pushed.peak_rss / 2**20:.0f} MiB"
    assert bundle_layer_size(registry, f"onnxfn/{NAME}-copy", layout) > weights
