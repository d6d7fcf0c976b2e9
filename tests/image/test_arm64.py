"""The two-platform index: linux/amd64 and linux/arm64 built from each architecture's own packages.

Slow on a fresh machine (debootstrap of arm64 runs its package scripts under qemu, several minutes),
so it runs only with ONNXFN_SLOW_TESTS=1; arm64 is build-and-inspect only, as ORT segfaults under qemu.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from packager.image import build_image
from packager.progress import StepProgress
from packager.spec import FunctionSpec

pytestmark = pytest.mark.skipif(not os.environ.get("ONNXFN_SLOW_TESTS"), reason="set ONNXFN_SLOW_TESTS=1 (minutes)")
ELF_MACHINE = {"x86_64": 0x3E, "aarch64": 0xB7}


def elf_machine(tar: tarfile.TarFile, name: str) -> int:
    member = tar.extractfile(name)
    assert member is not None
    header = member.read(20)
    assert header[:4] == b"\x7fELF"
    return int.from_bytes(header[18:20], "little")


def test_index_holds_amd64_and_arm64_built_from_their_own_packages(
    image_tools: None, demo_bundle: Path, demo_spec: FunctionSpec, tmp_path: Path
) -> None:
    result = build_image(
        demo_bundle, demo_spec, platforms=("linux/amd64", "linux/arm64"), progress=StepProgress(), out_dir=tmp_path
    )
    assert set(result.manifests) == {"linux/amd64", "linux/arm64"}
    by_platform = {image.platform.oci: image for image in result.images}
    arm, amd = by_platform["linux/arm64"], by_platform["linux/amd64"]
    assert b'"architecture":"arm64"' in arm.config.data and b'"variant":"v8"' in arm.config.data
    # The bundle and code layers are architecture-independent: one blob serves both images.
    assert [layer.digest for layer in arm.layers[2:]] == [layer.digest for layer in amd.layers[2:]]
    assert arm.layers[0].digest != amd.layers[0].digest

    for image, machine in ((amd, "x86_64"), (arm, "aarch64")):
        os_layer, deps_layer = image.layers[0], image.layers[1]
        with tarfile.open(os_layer.path) as tar:
            assert elf_machine(tar, "usr/bin/python3.11") == ELF_MACHINE[machine]
        with tarfile.open(deps_layer.path) as tar:
            library = next(n for n in tar.getnames() if n.endswith(".so") and "onnxruntime/capi/" in n)
            assert elf_machine(tar, library) == ELF_MACHINE[machine]
