"""Same inputs, same digests: layers ignore mtimes, owners and walk order; the code layer's bytecode does
not depend on the host; the Dockerfile describes the same image as the daemonless build."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shlex
import subprocess
import tarfile
from pathlib import Path

import pytest

from packager.errors import UserError
from packager.image import RegistryTarget
from packager.image.app_layer import ENTRYPOINT, code_layer, image_env, render_entrypoint
from packager.image.base import runtime_requirements
from packager.image.dockerfile import render_dockerfile
from packager.image.layers import EPOCH, tree_entries, write_layer


def make_tree(root: Path, *, mtime: float, uid: int) -> None:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "b.py").write_text("B = 2\n")
    (root / "pkg" / "a.py").write_text("A = 1\n")
    (root / "pkg" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 64)
    os.symlink("a.py", root / "pkg" / "alias.py")
    for path in [*root.rglob("*"), root]:
        os.utime(path, (mtime, mtime), follow_symlinks=False)
        os.lchown(path, uid, uid)


def test_layer_digest_ignores_mtime_owner_and_location(tmp_path: Path) -> None:
    make_tree(tmp_path / "one", mtime=EPOCH + 10_000_000, uid=0)
    make_tree(tmp_path / "two", mtime=EPOCH + 20_000_000, uid=1234)
    first = write_layer(tree_entries(tmp_path / "one", "/opt/x"), tmp_path / "one.tar.gz", "t")
    second = write_layer(tree_entries(tmp_path / "two", "/opt/x"), tmp_path / "two.tar.gz", "t")
    assert first.digest == second.digest and first.diff_id == second.diff_id
    assert first.digest == "sha256:" + hashlib.sha256((tmp_path / "one.tar.gz").read_bytes()).hexdigest()
    assert (
        first.diff_id == "sha256:" + hashlib.sha256(gzip.decompress((tmp_path / "one.tar.gz").read_bytes())).hexdigest()
    )

    with tarfile.open(tmp_path / "one.tar.gz") as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert names[:3] == ["opt", "opt/x", "opt/x/pkg"]  # parents come first, with the layer
    assert {(m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, "", "")}
    assert {m.mtime for m in members} == {EPOCH}
    assert next(m for m in members if m.name.endswith("alias.py")).linkname == "a.py"

    (tmp_path / "two" / "pkg" / "a.py").write_text("A = 3\n")
    changed = write_layer(tree_entries(tmp_path / "two", "/opt/x"), tmp_path / "three.tar.gz", "t")
    assert changed.digest != first.digest


def test_uncompressed_layer_has_one_digest(tmp_path: Path) -> None:
    make_tree(tmp_path / "t", mtime=EPOCH, uid=0)
    layer = write_layer(tree_entries(tmp_path / "t", "/b"), tmp_path / "b.tar", "bundle", compress=False)
    assert layer.digest == layer.diff_id and layer.size == layer.tar_size
    assert layer.media_type == "application/vnd.oci.image.layer.v1.tar"


def test_code_layer_is_reproducible_with_bytecode(tmp_path: Path) -> None:
    script = render_entrypoint("fn", ["--max-batch", "8", "--system-prompt", "You're kind; be brief"], [])
    first = code_layer(tmp_path / "a.tar.gz", script)
    second = code_layer(tmp_path / "b.tar.gz", script)
    assert first.digest == second.digest
    with tarfile.open(first.path) as tar:
        names = tar.getnames()
        entry = tar.extractfile(ENTRYPOINT.lstrip("/"))
        assert entry is not None
        text = entry.read().decode()
    assert "opt/onnxfn/app/runtime/http/__pycache__/app.cpython-311.pyc" in names
    assert not any("/work/" in n for n in names)
    assert "--system-prompt 'You'\"'\"'re kind; be brief'" in text  # shell-quoted, not split
    # The queue modes get the same flags as one shell word, their $ONNXFN_FLAGS defaults.
    (assignment,) = [line for line in text.splitlines() if line.startswith("function_flags=")]
    word = subprocess.run(["sh", "-c", f'{assignment}; printf %s "$function_flags"'], capture_output=True, text=True)
    assert shlex.split(word.stdout) == ["--max-batch", "8", "--system-prompt", "You're kind; be brief"]


def test_dockerfile_matches_the_image(tmp_path: Path) -> None:
    text = render_dockerfile("smollm2-chat", "latest")
    for variable in image_env():
        assert f"ENV {variable}" in text
    assert f'ENTRYPOINT ["{ENTRYPOINT}"]' in text and 'CMD ["http"]' in text
    copies = [line.split()[-1] for line in text.splitlines() if line.startswith("COPY ")]
    assert copies[1:] == ["/opt/onnxfn/python", "/opt/onnxfn/bundle/", "/opt/onnxfn/app/"]  # bundle below code
    requirements = runtime_requirements()
    assert any(r.startswith("onnxruntime==") for r in requirements)
    assert not any(r.split("==")[0] in ("torch", "transformers", "sympy") for r in requirements)


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("127.0.0.1:5000/onnxfn/chat:v1", ("127.0.0.1:5000", "onnxfn/chat", "v1", True)),
        ("localhost:5000/chat", ("localhost:5000", "chat", "latest", True)),
        (
            "123456789012.dkr.ecr.eu-west-1.amazonaws.com/onnxfn/chat:2",
            ("123456789012.dkr.ecr.eu-west-1.amazonaws.com", "onnxfn/chat", "2", False),
        ),
    ],
)
def test_registry_reference(reference: str, expected: tuple[str, str, str, bool]) -> None:
    target = RegistryTarget.parse(reference)
    assert (target.registry, target.repository, target.tag, target.insecure) == expected
    assert target.is_ecr == ("ecr" in reference)


def test_registry_reference_without_host_is_refused() -> None:
    with pytest.raises(UserError, match="expected HOST\\[:PORT\\]/REPOSITORY\\[:TAG\\]"):
        RegistryTarget.parse("onnxfn/chat:latest")


def test_documents_are_canonical(tmp_path: Path) -> None:
    from packager.image.layout import Document

    document = Document.of("application/json", {"b": 1, "a": [1, 2]})
    assert document.data == b'{"a":[1,2],"b":1}'
    assert json.loads(document.data) == {"a": [1, 2], "b": 1}
