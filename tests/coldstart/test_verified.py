"""Verification once: the first start hashes the bundle and records it; later starts check identities only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.bundle import FORMAT_VERSION, BundleError, Manifest, file_digest, manifest_bytes
from runtime.verified import open_verified
from tests.coldstart.test_prefix_pins import FACTS


def make_bundle(root: Path) -> Path:
    root.mkdir()
    (root / "model.onnx").write_bytes(b"graph" * 1000)
    (root / "tokenizer.json").write_text("{}")
    (root / "snapshot").mkdir()
    (root / "snapshot" / "system_prompt.npy").write_bytes(b"kv" * 100)
    names = ("model.onnx", "tokenizer.json", "snapshot/system_prompt.npy")
    manifest = Manifest(
        format_version=FORMAT_VERSION, function="f", spec_digest="sha256:0", model_file="model.onnx",
        tokenizer_file="tokenizer.json", model=FACTS, files={n: file_digest(root / n) for n in names}, created_by={},
    )  # fmt: skip
    (root / "manifest.json").write_bytes(manifest_bytes(manifest.to_json()))
    return root


def test_second_open_trusts_the_record(tmp_path: Path) -> None:
    root, records = make_bundle(tmp_path / "bundle"), tmp_path / "records"
    assert open_verified(root, records)[1] is True
    assert len(list(records.iterdir())) == 1
    bundle, hashed = open_verified(root, records)
    assert hashed is False and bundle.manifest.model_file == "model.onnx"


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda root: (root / "model.onnx").write_bytes(b"GRAPH" * 1000), "model.onnx has sha256"),  # same size
        (lambda root: (root / "snapshot" / "extra.npy").write_bytes(b"x"), "snapshot/extra.npy"),  # added
        (lambda root: (root / "tokenizer.json").unlink(), "missing tokenizer.json"),
    ],
)
def test_a_changed_bundle_is_hashed_again_and_refused(tmp_path: Path, tamper: object, message: str) -> None:
    root, records = make_bundle(tmp_path / "bundle"), tmp_path / "records"
    open_verified(root, records)
    tamper(root)  # type: ignore[operator]
    with pytest.raises(BundleError, match=message):
        open_verified(root, records)


def test_hard_links_do_not_invalidate_the_record(tmp_path: Path) -> None:
    """The image builder hard-links bundle files into its layer: content unchanged, ctime changed."""
    root, records = make_bundle(tmp_path / "bundle"), tmp_path / "records"
    open_verified(root, records)
    os.link(root / "model.onnx", tmp_path / "layer-model.onnx")
    assert open_verified(root, records)[1] is False


def test_an_unwritable_record_dir_only_means_hashing_again(tmp_path: Path) -> None:
    root = make_bundle(tmp_path / "bundle")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the record folder should be")
    assert open_verified(root, blocker)[1] is True
    assert open_verified(root, blocker)[1] is True
