"""`pkg push functions/NAME --device URL[,URL…]`: send the built bundle to edge agents, in parallel.

Each device gets a progress bar; an interrupted push resumes where each device stopped (the agent keeps
what it received, keyed by the archive's sha256). Results show as a table; a device that failed makes the
command exit 1 after every other device finished.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from packager.edge.archive import archive_bundle
from packager.edge.devices import edge_options
from packager.edge.fleet import push
from packager.edge.progress import DeviceProgress, print_results
from packager.memory import PeakRss
from packager.paths import build_dir, bundle_dir
from packager.spec import load_spec

console = Console()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("push", help="push the built bundle to edge devices running the agent")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    add_device_arguments(parser)
    parser.add_argument("--chunk-mb", type=int, help="upload chunk size (default: [targets.edge] chunk_mb)")
    parser.set_defaults(run=run)


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", action="append", metavar="URL[,URL…]", help="agent URL(s); default: [targets.edge] devices"
    )
    parser.add_argument("--token-file", type=Path, help="the agent token (default: $ONNXFN_EDGE_TOKEN)")
    parser.add_argument("--ca-file", type=Path, help="CA certificate of https agents")
    parser.add_argument("--client-cert", type=Path, help="client certificate for agents requiring mutual TLS")
    parser.add_argument("--client-key", type=Path, help="its private key")


def tls_flags(args: argparse.Namespace) -> dict[str, Path | None]:
    return {"ca_file": args.ca_file, "client_cert": args.client_cert, "client_key": args.client_key}


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    settings = spec.targets.edge
    options = edge_options(settings, args.device, args.token_file, tls_flags(args))
    chunk_bytes = (args.chunk_mb or settings.chunk_mb) << 20
    with PeakRss() as peak:  # a multi-GB bundle streams through: reported, and bounded by the tests
        with console.status(f"archiving {bundle_dir(spec)}"):
            archive = archive_bundle(bundle_dir(spec), build_dir(spec) / "edge")
        console.print(f"bundle {archive.manifest.digest[:19]}… archive {archive.size / 1e6:.1f} MB", highlight=False)
        with DeviceProgress(console, options.devices) as progress:
            results = push(options.devices, archive, options.auth, progress.update, chunk_bytes)
    footer = f"peak RSS of this push: {peak.bytes / 2**20:.0f} MiB for an archive of {archive.size / 1e6:.0f} MB"
    return print_results(console, f"push {spec.name}", results, footer=footer)
