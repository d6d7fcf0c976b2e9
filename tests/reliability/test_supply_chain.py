"""Bundles that were tampered with, point outside themselves or come from another format are refused with a
precise message by `runtime.bundle.open_bundle` and, before anything is built, by the image builder.

The bundles here are small copies of the demo's manifest with tiny files, so each case costs milliseconds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from packager.errors import UserError
from packager.image import build_image
from packager.progress import StepProgress
from packager.spec import load_spec
from runtime.bundle import MANIFEST_NAME, BundleError, Manifest, file_digest, manifest_bytes, open_bundle, read_manifest
from tests.reliability.live import REPO

FILES = {"model.onnx": b"graph" * 100, "tokenizer.json": b"{}", "snapshot/system_prompt.npy": b"kv" * 50}


def write_bundle(root: Path, demo: Path, *, listed: dict[str, bytes] | None = None) -> Path:
    """A bundle holding `FILES` under the demo's model facts, with a manifest that matches them."""
    for name, data in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    real = read_manifest(demo)
    files = {name: file_digest(root / name) for name in (listed or FILES)}
    manifest = Manifest.from_json({**real.to_json(), "files": {k: v.__dict__ for k, v in files.items()}})
    (root / MANIFEST_NAME).write_bytes(manifest_bytes(manifest.to_json()))
    return root


def edit_manifest(root: Path, change: Callable[[dict], None]) -> None:
    data = json.loads((root / MANIFEST_NAME).read_text())
    change(data)
    (root / MANIFEST_NAME).write_text(json.dumps(data))


def tampered(root: Path) -> None:
    (root / "model.onnx").write_bytes(b"graph" * 99 + b"GRAPH")  # same size, other bytes


def truncated(root: Path) -> None:
    (root / "model.onnx").write_bytes(b"graph")


def added_file(root: Path) -> None:
    (root / "extra.py").write_text("import os")


def dotdot_entry(root: Path) -> None:
    (root.parent / "outside.bin").write_bytes(b"x")
    edit_manifest(
        root, lambda m: m["files"].update({"../outside.bin": file_digest(root.parent / "outside.bin").__dict__})
    )


def absolute_entry(root: Path) -> None:
    edit_manifest(root, lambda m: m["files"].update({"/etc/hostname": file_digest(Path("/etc/hostname")).__dict__}))


def model_file_outside(root: Path) -> None:
    edit_manifest(root, lambda m: m.update(model_file="../model.onnx"))


def file_symlink_out(root: Path) -> None:
    target = root.parent / "elsewhere.onnx"
    (root / "model.onnx").rename(target)
    (root / "model.onnx").symlink_to(target)


def folder_symlink_out(root: Path) -> None:
    outside = root.parent / "outside-snapshot"
    (root / "snapshot").rename(outside)
    (root / "snapshot").symlink_to(outside)


def fifo_added(root: Path) -> None:
    os.mkfifo(root / "pipe")


def other_format_version(root: Path) -> None:
    edit_manifest(root, lambda m: m.update(format_version=2))


CASES = [
    (tampered, r"model\.onnx has sha256 .* the manifest says .*tampered with"),
    (truncated, r"model\.onnx is 5 bytes, the manifest says 500"),
    (added_file, r"holds files its manifest does not list: extra\.py"),
    (dotdot_entry, r"lists the file '\.\./outside\.bin', which points outside the bundle"),
    (absolute_entry, r"lists the file '/etc/hostname', which points outside the bundle"),
    (model_file_outside, r"model_file '\.\./model\.onnx' is not one of the bundle's listed files"),
    (file_symlink_out, r"missing model\.onnx \(or it is not a regular file\)"),
    (folder_symlink_out, r"holds files its manifest does not list: snapshot|outside the bundle"),
    (fifo_added, r"holds files its manifest does not list: pipe"),
    (other_format_version, r"format_version 2 is not supported by this runtime \(it reads version 1\)"),
]
IDS = [case.__name__ for case, _ in CASES]


@pytest.fixture
def bundle(tmp_path: Path, demo_bundle: Path) -> Path:
    root = tmp_path / "bundle"
    root.mkdir()
    return write_bundle(root, demo_bundle)


def test_the_untouched_copy_opens(bundle: Path) -> None:
    assert open_bundle(bundle).manifest.files.keys() == FILES.keys()


@pytest.mark.parametrize(("damage", "message"), CASES, ids=IDS)
def test_open_bundle_refuses(bundle: Path, damage: Callable[[Path], None], message: str) -> None:
    damage(bundle)
    with pytest.raises(BundleError, match=message):
        open_bundle(bundle)


@pytest.mark.parametrize(("damage", "message"), CASES, ids=IDS)
def test_image_builder_refuses_before_building(
    bundle: Path, tmp_path: Path, damage: Callable[[Path], None], message: str
) -> None:
    damage(bundle)
    out = tmp_path / "image-out"
    spec = load_spec(REPO / "functions" / "smollm2-chat")
    with pytest.raises(UserError, match=f"cannot build an image: .*({message})"):
        build_image(bundle, spec, progress=StepProgress(), out_dir=out)
    assert not out.exists()  # refused before any layer, layout or Docker context was written
