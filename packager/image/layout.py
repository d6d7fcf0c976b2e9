"""OCI image documents (config, manifest, index) as canonical bytes, and an OCI image layout on disk.

Every document is serialised once, with sorted keys and no spaces; its digest is of those bytes, and
those exact bytes are what the layout stores and the registry receives.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packager.image.layers import Layer
from packager.image.platforms import Platform

MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
REF_NAME = "org.opencontainers.image.ref.name"
CREATED = "2023-11-14T22:13:20Z"  # layers.EPOCH: the image says nothing about when it was built


@dataclass(frozen=True)
class Document:
    """A JSON document in its one serialised form."""

    media_type: str
    data: bytes

    @classmethod
    def of(cls, media_type: str, value: object) -> Document:
        return cls(media_type, json.dumps(value, sort_keys=True, separators=(",", ":")).encode())

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    def descriptor(self, **extra: object) -> dict[str, object]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data), **extra}


@dataclass(frozen=True)
class PlatformImage:
    """One platform's image: its config, layers (bottom first) and manifest."""

    platform: Platform
    config: Document
    layers: tuple[Layer, ...]
    manifest: Document


@dataclass(frozen=True)
class ContainerConfig:
    env: list[str]
    entrypoint: list[str]
    cmd: list[str]
    labels: dict[str, str]
    exposed_port: int


def platform_image(platform: Platform, layers: tuple[Layer, ...], container: ContainerConfig) -> PlatformImage:
    config = Document.of(
        CONFIG_MEDIA_TYPE,
        {
            "created": CREATED,
            "architecture": platform.architecture,
            "os": "linux",
            **({"variant": platform.variant} if platform.variant else {}),
            "config": {
                "Env": container.env,
                "Entrypoint": container.entrypoint,
                "Cmd": container.cmd,
                "WorkingDir": "/",
                "ExposedPorts": {f"{container.exposed_port}/tcp": {}},
                "Labels": container.labels,
            },
            "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
            "history": [{"created": CREATED, "created_by": f"onnxfn: {layer.name} layer"} for layer in layers],
        },
    )
    manifest = Document.of(
        MANIFEST_MEDIA_TYPE,
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": config.descriptor(),
            "layers": [layer.descriptor() for layer in layers],
            "annotations": {
                "org.opencontainers.image.title": container.labels.get("org.opencontainers.image.title", "")
            },
        },
    )
    return PlatformImage(platform, config, layers, manifest)


def image_index(images: list[PlatformImage]) -> Document:
    return Document.of(
        INDEX_MEDIA_TYPE,
        {
            "schemaVersion": 2,
            "mediaType": INDEX_MEDIA_TYPE,
            "manifests": [image.manifest.descriptor(platform=platform_json(image.platform)) for image in images],
        },
    )


def platform_json(platform: Platform) -> dict[str, str]:
    return {
        "architecture": platform.architecture,
        "os": "linux",
        **({"variant": platform.variant} if platform.variant else {}),
    }


def write_layout(target: Path, index: Document, images: list[PlatformImage], tag: str) -> None:
    """Write an OCI image layout holding `index` (tagged `tag`) and everything it references, atomically.

    Layer blobs are hard-linked from the cache where the file system allows; blobs of earlier builds
    are not carried over.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        blobs = staging / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        for image in images:
            for layer in image.layers:
                _link_or_copy(layer.path, blobs / layer.digest.removeprefix("sha256:"))
            for document in (image.config, image.manifest):
                (blobs / document.digest.removeprefix("sha256:")).write_bytes(document.data)
        (blobs / index.digest.removeprefix("sha256:")).write_bytes(index.data)
        (staging / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
        top = Document.of(
            INDEX_MEDIA_TYPE,
            {"schemaVersion": 2, "manifests": [index.descriptor(annotations={REF_NAME: tag})]},
        )
        (staging / "index.json").write_bytes(top.data)
        _replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def blob_path(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def _link_or_copy(source: Path, destination: Path) -> None:
    if destination.exists():
        return
    try:
        os.link(source, destination)
    except OSError:
        try:
            shutil.copyfile(source, destination)
        except OSError as exc:  # name the file being written, not the cache entry being read
            raise OSError(exc.errno, exc.strerror, str(destination)) from exc


def _replace_dir(staging: Path, target: Path) -> None:
    previous = target.with_name(f".{target.name}-previous")
    shutil.rmtree(previous, ignore_errors=True)
    if target.exists():
        target.rename(previous)
    staging.rename(target)
    shutil.rmtree(previous, ignore_errors=True)
