"""`build_image`: a verified bundle → an OCI image layout (one image per platform under one index).

Layers, bottom first: `os` (Debian + python3), `python-deps` (the runtime's wheels), `bundle` (the
function's files), `code` (the runtime package and the entry point). The bundle sits below the code
so the Dockerfile rendered alongside caches the same way; in the registry every layer is addressed by
content, so a code change uploads the code layer and the small documents, never the weights.
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass, field
from pathlib import Path

from packager.errors import UserError
from packager.image.app_layer import (
    BUNDLE_DIR,
    ENTRYPOINT,
    bundle_layer,
    code_layer,
    image_env,
    render_entrypoint,
)
from packager.image.base import base_layers
from packager.image.dockerfile import write_docker_context
from packager.image.layers import Layer
from packager.image.layout import ContainerConfig, PlatformImage, image_index, platform_image, write_layout
from packager.image.platforms import parse_platforms
from packager.image.registry import PushReport, RegistryTarget, push_layout
from packager.paths import cache_root
from packager.progress import StepProgress
from packager.runtime_flags import server_flags
from packager.spec import FunctionSpec
from runtime.bundle import BundleError
from runtime.verified import open_verified

SERVE_PORT = 8080


@dataclass(frozen=True)
class LayerReport:
    name: str
    platform: str
    digest: str
    size: int  # compressed bytes, as pushed
    tar_size: int  # bytes once unpacked
    reused: bool  # taken from the cache rather than built


@dataclass(frozen=True)
class ImageResult:
    layout: Path  # the OCI image layout directory
    tag: str
    index_digest: str
    manifests: dict[str, str]  # platform → manifest digest
    layers: list[LayerReport]
    docker_context: Path  # Dockerfile + context for people who build with Docker
    seconds: float
    push: PushReport | None = None
    images: list[PlatformImage] = field(default_factory=list, repr=False)


def build_image(
    bundle: Path,
    spec: FunctionSpec,
    *,
    platforms: tuple[str, ...] = ("linux/amd64",),
    progress: StepProgress,
    out_dir: Path | None = None,
    tag: str = "latest",
    push_to: RegistryTarget | None = None,
) -> ImageResult:
    """Build the image of `bundle` for `platforms` into `out_dir` (default: next to the bundle) and push it
    to `push_to` when given. The layout is tagged `tag`."""
    try:
        return _build(bundle, spec, platforms, progress, out_dir or bundle.parent, tag, push_to)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise UserError(f"cannot build the image: {exc.filename or out_dir}: {exc.strerror or exc}") from exc
        raise UserError(
            f"no space left on the device holding {exc.filename or out_dir or bundle.parent} while building the "
            f"image (the bundle alone needs {_size(bundle) / 1e6:.0f} MB there and again in the cache "
            f"{cache_root()}); free space or move the cache with ONNXFN_CACHE_DIR"
        ) from exc


def _build(
    bundle: Path,
    spec: FunctionSpec,
    platforms: tuple[str, ...],
    progress: StepProgress,
    out: Path,
    tag: str,
    push_to: RegistryTarget | None,
) -> ImageResult:
    start = time.perf_counter()
    targets = parse_platforms(platforms)
    try:
        # The whole bundle is checked before anything is built: the layer cache is keyed by the manifest, so
        # a tampered file beside an unchanged manifest would otherwise slip into the Docker context.
        manifest = open_verified(bundle)[0].manifest
    except BundleError as exc:
        raise UserError(f"cannot build an image: {exc}\nbuild the bundle first: pkg build {spec.directory}") from exc
    reports: list[LayerReport] = []

    with progress.step("image bundle layer", "pack the bundle layer") as step:
        try:
            bundle_blob, reused = bundle_layer(bundle, manifest)
        except BundleError as exc:
            raise UserError(f"cannot build an image: {exc}\nrebuild the bundle: pkg build {spec.directory}") from exc
        if reused:
            step.cached(f"bundle {manifest.digest[:19]}")
    with progress.step("image code layer", "pack the runtime code layer"):
        entrypoint = render_entrypoint(spec.name, server_flags(spec), _auth_flags(spec))
        code_blob = code_layer(out / "image-work" / "code.tar.gz", entrypoint)

    container = ContainerConfig(
        env=image_env(),
        entrypoint=[ENTRYPOINT],
        cmd=["http"],
        labels={
            "org.opencontainers.image.title": spec.name,
            "dev.onnxfn.bundle.digest": manifest.digest,
            "dev.onnxfn.bundle.path": BUNDLE_DIR,
        },
        exposed_port=SERVE_PORT,
    )
    images: list[PlatformImage] = []
    for platform in targets:
        with progress.step(f"image base {platform.oci}", f"runtime base for {platform.oci}") as step:
            base = base_layers(platform, lambda message: progress.console.print(f"  {message}", highlight=False))
            if base.os_reused and base.deps_reused:
                step.cached("os + python-deps")
        layers: tuple[Layer, ...] = (base.os, base.deps, bundle_blob, code_blob)
        reused_by_name = {"os": base.os_reused, "python-deps": base.deps_reused, "bundle": reused, "code": False}
        reports += [
            LayerReport(layer.name, platform.oci, layer.digest, layer.size, layer.tar_size, reused_by_name[layer.name])
            for layer in layers
        ]
        images.append(platform_image(platform, layers, container))
    index = image_index(images)

    layout = out / "image"
    with progress.step("image layout", f"write OCI layout {layout}"):
        write_layout(layout, index, images, tag)
        docker_context = write_docker_context(out / "docker", spec, bundle, entrypoint, tag)
    push = None
    if push_to is not None:
        with progress.step("image push", f"push to {push_to.reference}"):
            push = push_layout(layout, push_to)
    return ImageResult(
        layout=layout,
        tag=tag,
        index_digest=index.digest,
        manifests={image.platform.oci: image.manifest.digest for image in images},
        layers=reports,
        docker_context=docker_context,
        seconds=time.perf_counter() - start,
        push=push,
        images=images,
    )


def _auth_flags(spec: FunctionSpec) -> list[str]:
    name = spec.endpoint.api_key_env
    return ["--api-key-env", name] if name else []


def _size(bundle: Path) -> int:
    return sum(path.stat().st_size for path in bundle.iterdir() if path.is_file()) if bundle.is_dir() else 0
