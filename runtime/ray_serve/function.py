"""One replica's start, without Ray: the bundle by its digest into this node's cache, then the model through
`runtime.startup` and the runtime's own HTTP app around it, as `python -m runtime serve` builds it.

The node's cache (`$ONNXFN_BUNDLE_CACHE`, else the target's `cache_dir`) keeps each bundle under its digest,
verified against its manifest as it arrives (`runtime.bundle_fetch`): the first replica on a node fetches it,
later ones (and restarts) open it from disk. The runtime's other state (verification records, the prefill
graph's derived weights) goes beside it unless `$ONNXFN_STATE_DIR` says otherwise, so a node's disk holds all
of a function's files in one place.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.bundle_fetch import fetch_bundle, folder_opener, s3_opener
from runtime.ray_serve.settings import ReplicaSettings
from runtime.verified import RECORD_DIR_ENV

if TYPE_CHECKING:
    from runtime.bundle import Manifest
    from runtime.http.state import ServerState

log = logging.getLogger("runtime.ray_serve")
STATE_SUBDIR = "state"


@dataclass
class StartedFunction:
    app: Any  # the ASGI app Serve's proxy hands requests to (the runtime's app behind its Host check)
    service: ServerState  # the app's state: its engine, auth and metrics


def fetch(settings: ReplicaSettings) -> Path:
    """The bundle, verified, in this node's cache (fetched only when it is not there yet)."""
    where = settings.bundle_location()
    if where.startswith("s3://"):
        s3 = _s3_client(settings)
        opener = s3_opener(where, s3)
    else:
        opener = folder_opener(Path(where))
    return fetch_bundle(where, opener, settings.bundle_digest, settings.cache())


def _s3_client(settings: ReplicaSettings) -> Any:
    """An S3 client from the node's credentials (instance role, pod identity, environment)."""
    import boto3

    return boto3.client("s3", endpoint_url=settings.store_endpoint_url, region_name=settings.store_region)


def server_arguments(bundle: Path, flags: list[str]) -> argparse.Namespace:
    """`flags` read by `python -m runtime serve`'s own parser: the same defaults, checks and meaning."""
    from runtime.http import serve

    parser = argparse.ArgumentParser(prog="onnxfn replica")
    serve.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", str(bundle), *flags])


def start_function(settings: ReplicaSettings) -> StartedFunction:
    """Fetch, load and wrap the function; raises what failed (the replica's constructor then fails, and Serve
    reports the deployment unhealthy with this message)."""
    from runtime.bundle import read_manifest
    from runtime.http.auth import load_api_key
    from runtime.startup import begin_loading

    started = time.monotonic()
    bundle = fetch(settings)
    fetched = time.monotonic()
    os.environ.setdefault(RECORD_DIR_ENV, str(settings.cache() / STATE_SUBDIR))
    args = server_arguments(bundle, settings.server_flags)
    api_key = load_api_key(settings.api_key_env, None)
    manifest = read_manifest(bundle)
    loading = begin_loading(bundle, args)
    app = _http_app(args, manifest, api_key, loading.engine.result)
    service: ServerState = app.state.server
    if not service.load(loading.engine.result):  # loaded before Serve routes to it (the lifespan's load returns it)
        raise RuntimeError(f"the engine of {settings.function} failed to load: {service.load_error}")
    loaded = time.monotonic()
    log.info(
        "%s: bundle %s ready in %.2f s (fetch and verify %.2f s, load %.2f s)",
        settings.function, settings.bundle_digest[:19], loaded - started, fetched - started, loaded - fetched,
    )  # fmt: skip
    return StartedFunction(_guarded(app, args), service)


def _http_app(args: argparse.Namespace, manifest: Manifest, api_key: str | None, load: Callable[[], Any]) -> Any:
    from runtime.http.app import create_app
    from runtime.http.state import ServerSettings
    from runtime.startup import fingerprint, request_policy

    settings = ServerSettings(
        policy=request_policy(args, manifest),
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        fingerprint=fingerprint(manifest),
        max_waiting=args.max_waiting,
    )
    return create_app(settings, load, task=manifest.task)


def _guarded(app: Any, args: argparse.Namespace) -> Any:
    """The Host check `python -m runtime serve` puts in front of the app (runtime/http/host_guard.py): a browser
    page rebinding its name to Serve's proxy is refused as it would be at a server of its own."""
    from runtime.http.host_guard import HostGuard, allowed_hosts

    return HostGuard(app, allowed_hosts(args.allowed_host))
