"""`python -m runtime agent --bundle-root DIR --token-file F`: the edge agent.

It serves the current bundle with the same HTTP API as `python -m runtime serve` and takes new bundles
through `/agent/*` (token auth; with `--client-ca`, clients also need a certificate signed by that CA).
The port is bound first; the last good bundle loads in the background while `/health` already answers.
"""

from __future__ import annotations

import argparse
import logging
import ssl
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.http.connection_limits import add_connection_arguments
from runtime.http.serve import add_host_arguments, bind, uvicorn_config
from runtime.startup import add_model_arguments

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("runtime.agent")
AGENT_PREFIX = "/agent/"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("agent", help="edge agent: serve the current bundle, accept pushed ones")
    parser.add_argument("--bundle-root", type=Path, required=True, metavar="DIR", help="where bundles are kept")
    parser.add_argument("--token-file", type=Path, required=True, help="file holding the token /agent/* requires")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8470)
    tls = parser.add_argument_group("TLS (all three for mutual TLS)")
    tls.add_argument("--tls-cert", type=Path, help="server certificate (PEM)")
    tls.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    tls.add_argument("--client-ca", type=Path, help="require client certificates signed by this CA (PEM)")
    serving = parser.add_argument_group("serving")
    serving.add_argument("--api-key-file", type=Path, help="bearer key for /v1/* (default: /v1 has no auth)")
    serving.add_argument("--max-body-bytes", type=int, default=1 << 20, help="/v1 request bodies above this get 413")
    serving.add_argument("--max-upload-mb", type=int, default=16384, help="largest bundle archive accepted")
    serving.add_argument("--smoke-timeout", type=float, default=120.0, help="seconds the smoke generation may take")
    serving.add_argument("--drain-timeout", type=float, default=30.0, help="seconds a replaced bundle may finish in")
    add_model_arguments(parser)
    add_connection_arguments(parser)
    add_host_arguments(parser)  # a device is reached by its address; by a name only when allowed
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from runtime.http.auth import AuthConfigError, load_api_key

    try:
        token = load_api_key(None, args.token_file)
        api_key = load_api_key(None, args.api_key_file) if args.api_key_file else None
        tls = _tls_settings(args)
    except (AuthConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    listener = bind(args.host, args.port)
    if listener is None:
        return 1
    import uvicorn

    app = build_app(args, token, api_key)
    config = uvicorn_config(app, args, **tls)
    scheme = "https" if tls else "http"
    log.info(
        "agent listening on %s://%s:%d, bundles in %s", scheme, args.host, listener.getsockname()[1], args.bundle_root
    )
    uvicorn.Server(config).run(sockets=[listener])
    return 0


def build_app(args: argparse.Namespace, token: str | None, api_key: str | None) -> ASGIApp:
    from runtime.agent.history import History
    from runtime.agent.install import Installer
    from runtime.agent.layout import BundleRoot
    from runtime.agent.routes import agent_routes, control_app
    from runtime.agent.serving import ServingOptions, ServingSlot, load_serving
    from runtime.agent.uploads import UploadStore
    from runtime.http.auth import BearerAuth
    from runtime.startup import engine_config

    root = BundleRoot(args.bundle_root.resolve())
    root.prepare()
    # Adapters added with `pkg adapter add --device` live beside the bundles, not in one: every bundle served
    # gets this folder as its `--adapter-dir`, so they outlive swaps, rollbacks and restarts.
    if getattr(args, "adapter_dir", None) is None:
        args.adapter_dir = root.adapters
    slot = ServingSlot()
    options = ServingOptions(args, api_key, args.max_body_bytes, args.smoke_timeout)
    installer = Installer(
        root,
        UploadStore(root.uploads, args.max_upload_mb << 20),
        slot,
        History(root.history_file),
        lambda bundle: load_serving(bundle, options),
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        threading.Thread(target=installer.recover, name="onnxfn-agent-recover", daemon=True).start()
        yield
        if slot.current is not None:
            slot.current.shutdown()

    config = engine_config(args)
    budgets = (config.kv_memory_bytes, config.prefix_cache_bytes)
    control = control_app(agent_routes(installer, BearerAuth(token), args.drain_timeout, api_key, budgets), lifespan)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or scope.get("path", "").startswith(AGENT_PREFIX):
            await control(scope, receive, send)
        else:
            await slot(scope, receive, send)

    return app


def _tls_settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.tls_cert is None and args.tls_key is None and args.client_ca is None:
        return {}
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key (and --client-ca for mutual TLS)")
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--client-ca", args.client_ca)):
        if path is not None and not path.is_file():
            raise ValueError(f"{flag} {path}: no such file")
    settings: dict[str, Any] = {"ssl_certfile": str(args.tls_cert), "ssl_keyfile": str(args.tls_key)}
    if args.client_ca is not None:
        settings.update(ssl_ca_certs=str(args.client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return settings
