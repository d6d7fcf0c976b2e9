"""Bad input gives a precise error, and a failed push leaves no tag: missing bundle, unreachable registry,
missing or wrong credentials, a blob the registry refuses, a full disk."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests

from packager.bench.local_registry import PASSWORD, USER, LocalRegistry
from packager.errors import UserError
from packager.image import RegistryAuth, RegistryTarget, build_image, pull_image, push_layout
from packager.image.layers import tree_entries, write_layer
from packager.image.layout import ContainerConfig, image_index, platform_image, write_layout
from packager.image.platforms import PLATFORMS
from packager.progress import StepProgress
from packager.spec import FunctionSpec
from packager.targets.local.server_process import free_port


@pytest.fixture
def tiny_layout(tmp_path: Path) -> Path:
    """A one-layer image, so auth and failure paths run in milliseconds."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "hello.txt").write_bytes(os.urandom(200_000))
    layer = write_layer(tree_entries(tree, "/srv"), tmp_path / "layer.tar.gz", "data")
    config = ContainerConfig(env=[], entrypoint=["/bin/true"], cmd=[], labels={}, exposed_port=8080)
    image = platform_image(PLATFORMS["linux/amd64"], (layer,), config)
    layout = tmp_path / "layout"
    write_layout(layout, image_index([image]), [image], "latest")
    return layout


def test_missing_bundle_names_the_fix(demo_spec: FunctionSpec, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"cannot build an image: .*\n.*pkg build .*smollm2-chat"):
        build_image(tmp_path / "no-bundle", demo_spec, progress=StepProgress(), out_dir=tmp_path)


def test_unreachable_registry_fails_fast(tiny_layout: Path) -> None:
    target = RegistryTarget.parse(f"127.0.0.1:{free_port('127.0.0.1')}/onnxfn/tiny:latest")
    start = time.perf_counter()
    with pytest.raises(UserError, match=r"registry 127\.0\.0\.1:\d+ is unreachable \(http\): connection refused"):
        push_layout(tiny_layout, target)
    assert time.perf_counter() - start < 5  # not oras' two minutes of retries


def test_auth_missing_wrong_and_right(tiny_layout: Path, auth_registry: LocalRegistry, tmp_path: Path) -> None:
    reference = f"{auth_registry.address}/onnxfn/tiny:latest"
    with pytest.raises(UserError, match="requires credentials \\(Basic auth\\): none given"):
        push_layout(tiny_layout, RegistryTarget.parse(reference))
    wrong = RegistryAuth(username=USER, password="not-the-password")
    with pytest.raises(UserError, match=r"refused access to onnxfn/tiny \(HTTP 401\).*check the credentials"):
        push_layout(tiny_layout, RegistryTarget.parse(reference, auth=wrong))
    assert _tag_status(auth_registry, "onnxfn/tiny", "latest", auth=(USER, PASSWORD)) == 404

    right = RegistryTarget.parse(reference, auth=RegistryAuth(username=USER, password=PASSWORD))
    report = push_layout(tiny_layout, right)
    assert len(report.blobs_sent) == 2 and report.bytes_sent > 200_000
    pulled = pull_image(right, tmp_path / "pulled")
    assert pulled.index_digest == report.index_digest


def test_refused_blob_leaves_no_tag(tiny_layout: Path, registry: LocalRegistry, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_layout, broken)
    blobs = sorted((broken / "blobs" / "sha256").iterdir(), key=lambda p: p.stat().st_size)
    layer_blob = blobs[-1]  # the biggest is the layer: flip its content so its digest no longer matches
    data = bytearray(layer_blob.read_bytes())
    data[100] ^= 0xFF
    layer_blob.write_bytes(bytes(data))
    target = RegistryTarget.parse(f"{registry.address}/onnxfn/broken:latest")
    with pytest.raises(
        UserError, match=r"uploading sha256:\w+ .*failed: HTTP 400 DIGEST_INVALID.*the tag was not pushed"
    ):
        push_layout(broken, target)
    assert _tag_status(registry, "onnxfn/broken", "latest") == 404


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_disk_is_reported(demo_image: object, demo_bundle: Path, demo_spec: FunctionSpec, tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        with pytest.raises(UserError, match=r"no space left on the device holding .*small.* free space"):
            build_image(demo_bundle, demo_spec, progress=StepProgress(), out_dir=small)
    finally:
        subprocess.run(["umount", str(small)], check=True)


def _tag_status(registry: LocalRegistry, repository: str, tag: str, auth: tuple[str, str] | None = None) -> int:
    url = f"http://{registry.address}/v2/{repository}/manifests/{tag}"
    accept = "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json"
    return requests.get(url, headers={"Accept": accept}, auth=auth, timeout=5).status_code
