"""`pkg image build|push|pull|run`: the function's OCI image, without a Docker daemon.

Registry credentials come from the environment, never from flags (they would land in shell history):
ONNXFN_REGISTRY_USER + ONNXFN_REGISTRY_PASSWORD (basic auth, or to obtain bearer tokens) or
ONNXFN_REGISTRY_TOKEN (a bearer token); ECR registries use boto3's credentials.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from packager.errors import UserError
from packager.memory import PeakRss
from packager.paths import build_dir, bundle_dir
from packager.progress import StepProgress
from packager.spec import load_spec

if TYPE_CHECKING:
    from packager.image import PushReport, RegistryTarget
    from packager.image.build import ImageResult

console = Console()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("image", help="build, push, pull or run the function's OCI image (no Docker)")
    actions = parser.add_subparsers(dest="image_command", required=True, metavar="ACTION")

    build = actions.add_parser("build", help="build the OCI image layout from the bundle (and push it with --push)")
    build.add_argument("function", type=Path, help="function folder holding function.toml")
    build.add_argument("--platform", action="append", help="linux/amd64 (default) or linux/arm64; repeatable")
    build.add_argument("--tag", default="latest")
    build.add_argument("--push", metavar="REGISTRY/REPOSITORY[:TAG]", help="push the image there after building")
    build.set_defaults(run=_build)

    push = actions.add_parser("push", help="push the image built by `pkg image build`")
    push.add_argument("function", type=Path)
    push.add_argument("reference", metavar="REGISTRY/REPOSITORY[:TAG]")
    push.set_defaults(run=_push)

    pull = actions.add_parser("pull", help="pull an image back, verifying every digest, into an OCI layout")
    pull.add_argument("reference", metavar="REGISTRY/REPOSITORY[:TAG]")
    pull.add_argument("--out", type=Path, required=True, help="directory for the OCI layout")
    pull.set_defaults(run=_pull)

    run = actions.add_parser("run", help="run the built image with podman (runc), in the foreground")
    run.add_argument("function", type=Path)
    run.add_argument("--port", type=int, default=8080, help="port on 127.0.0.1 (the container uses the host network)")
    run.add_argument("mode", nargs="?", default="http", choices=("http", "serve", "lambda"))
    run.set_defaults(run=_run)

    jetson = actions.add_parser("jetson", help="render a Docker build context for NVIDIA Jetson (L4T base, GPU ORT)")
    jetson.add_argument("function", type=Path)
    jetson.add_argument("--wheel", type=Path, required=True, help="the aarch64 onnxruntime-gpu wheel for the JetPack")
    jetson.set_defaults(run=_jetson)


def _target(reference: str) -> RegistryTarget:
    from packager.image import RegistryAuth, RegistryTarget

    return RegistryTarget.parse(reference, auth=RegistryAuth.from_env())


def _build(args: argparse.Namespace) -> int:
    from packager.image import build_image

    spec = load_spec(args.function)
    progress = StepProgress()
    result = build_image(
        bundle_dir(spec),
        spec,
        platforms=tuple(args.platform or ["linux/amd64"]),
        progress=progress,
        tag=args.tag,
        push_to=_target(args.push) if args.push else None,
    )
    print_image(spec.name, result)
    peak = max((record.peak_rss for record in progress.records if not record.cached), default=0)
    console.print(f"peak RSS of the build: {peak / 2**20:.0f} MiB", style="dim", highlight=False)
    return 0


def print_image(name: str, result: ImageResult) -> None:
    """Layers per platform as a table, where the outputs are, and what a push sent."""
    table = Table(title=f"image {name}:{result.tag}  {result.index_digest[:19]}")
    for column in ("platform", "layer", "digest", "compressed MB", "unpacked MB", "cache"):
        table.add_column(column)
    for layer in result.layers:
        table.add_row(
            layer.platform,
            layer.name,
            layer.digest[7:19],
            f"{layer.size / 1e6:.1f}",
            f"{layer.tar_size / 1e6:.1f}",
            "reused" if layer.reused else "built",
        )
    console.print(table)
    console.print(f"OCI layout: {result.layout}   Dockerfile: {result.docker_context / 'Dockerfile'}")
    if result.push is not None:
        _print_push(result.push)


def _push(args: argparse.Namespace) -> int:
    from packager.image import push_layout

    spec = load_spec(args.function)
    layout = build_dir(spec) / "image"
    if not (layout / "index.json").is_file():
        raise UserError(f"no image at {layout}: run pkg image build {args.function} first")
    with PeakRss() as peak:  # the layers stream from disk in chunks: reported, and bounded by the tests
        report = push_layout(layout, _target(args.reference))
    _print_push(report)
    console.print(f"peak RSS of this push: {peak.bytes / 2**20:.0f} MiB", style="dim", highlight=False)
    return 0


def _pull(args: argparse.Namespace) -> int:
    from packager.image import pull_image

    start = time.perf_counter()
    pulled = pull_image(_target(args.reference), args.out)
    size = sum(pulled.blobs.values())
    console.print(
        f"pulled {args.reference} ({pulled.index_digest[:19]}): {len(pulled.manifests)} platform(s), "
        f"{len(pulled.blobs)} blobs, {size / 1e6:.1f} MB, every digest verified, "
        f"{time.perf_counter() - start:.1f}s -> {args.out}",
        highlight=False,
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    from packager.image.run import Podman, load_layout

    spec = load_spec(args.function)
    layout = build_dir(spec) / "image"
    podman = Podman(build_dir(spec) / "image-work" / "podman")
    name = f"localhost/onnxfn/{spec.name}:latest"
    load_layout(podman, layout, "latest", name)
    extra = [] if args.mode == "lambda" else ["--host", "127.0.0.1", "--port", str(args.port)]
    env = [f"--env={spec.endpoint.api_key_env}"] if spec.endpoint.api_key_env else []
    command = podman.command("run", "--rm", "--network", "host", *env, name, args.mode, *extra)
    os.execvpe(command[0], command, podman.environment())


def _jetson(args: argparse.Namespace) -> int:
    from packager.image.jetson import write_jetson_context

    spec = load_spec(args.function)
    context = write_jetson_context(build_dir(spec) / "jetson", spec, bundle_dir(spec), args.wheel)
    console.print(f"Jetson build context: {context}  (on the device: docker build -t {spec.name}:jetson {context})")
    return 0


def _print_push(report: PushReport) -> None:
    console.print(
        f"pushed {report.reference} ({report.index_digest[:19]}): {report.bytes_sent / 1e6:.1f} MB in "
        f"{len(report.blobs_sent)} blobs, {len(report.blobs_skipped)} already there, {report.seconds:.1f}s",
        highlight=False,
    )
