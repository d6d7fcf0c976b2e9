"""`python -m runtime serve BUNDLE_DIR`: the OpenAI-compatible HTTP server for one bundle.

Every setting is a flag, so the runtime never reads the function spec: the packager (or a container's
command line) translates the spec into flags. Heavy imports wait until `run`, so `--help` stays instant.

Start-up order is the cold-start path: bind the port (a taken port fails in milliseconds), start loading
the engine on a background thread (`runtime.startup`), and only then import the HTTP stack, which runs
alongside the session build.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.http.connection_limits import MAX_BODY_BYTES, ConnectionLimits, add_connection_arguments
from runtime.startup import add_model_arguments, fingerprint, load_model, request_policy, wait_for_session_start
from runtime.threads import in_thread
from runtime.timeline import RUNTIME_IMPORTED, TIMELINE

if TYPE_CHECKING:
    from runtime.engine.engine import Engine

log = logging.getLogger("runtime.http")

_PROBE_PATHS = ("/health", "/ready", "/metrics")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="serve a bundle over an OpenAI-compatible HTTP API")
    parser.add_argument("bundle", type=Path, metavar="BUNDLE_DIR", help="a bundle written by `pkg build`")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    auth = parser.add_argument_group("auth (neither flag: no auth)")
    auth.add_argument("--api-key-env", metavar="NAME", help="read the bearer API key from $NAME")
    auth.add_argument("--api-key-file", type=Path, metavar="PATH", help="read the bearer API key from a file")
    add_model_arguments(parser)
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="request bodies above this get 413")
    parser.add_argument(
        "--max-waiting", type=int, help="requests that may wait for a slot before 429 (default: --max-queue decides)"
    )
    add_connection_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--sagemaker", action="store_true", help="also serve SageMaker's /ping and /invocations")
    add_host_arguments(parser)
    parser.set_defaults(run=run)


def add_host_arguments(parser: Any) -> None:
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a DNS name clients may reach this server by (the Host header; repeatable; also $ONNXFN_ALLOWED_HOSTS, "
        "comma-separated; '*' allows any). IP addresses, localhost and local names (one label, *.local, *.internal) "
        "are always allowed; other names are refused, as a web page rebinding its name here would be",
    )


def uvicorn_config(app: Any, args: argparse.Namespace, **settings: Any) -> Any:
    """uvicorn's settings for `app` behind the Host guard (host_guard.py; not for SageMaker), with the connection
    limits of `add_connection_arguments`' flags.

    httptools parses and frames HTTP in C: 8 streams over HTTP on 2 cores +9 %, 8 % less server CPU than
    uvicorn's pure-Python h11 (measured here; uvloop gave the same gain, not more). asyncio's loop, not
    uvloop: libuv >= 1.50 keeps an io_uring, which CRIU cannot dump (the local target's process snapshot).
    """
    import uvicorn

    from runtime.http.connections import guarded_protocol
    from runtime.http.host_guard import HostGuard, allowed_hosts
    from runtime.log_limits import limit_repeats

    limits = ConnectionLimits.for_process(
        args.max_connections,
        max_header_bytes=args.max_header_bytes,
        head_timeout=args.head_timeout,
        body_timeout=args.body_timeout,
    )
    if not getattr(args, "sagemaker", False):  # SageMaker reaches its container by names of its own (host_guard.py)
        app = HostGuard(app, allowed_hosts(args.allowed_host))
    config = uvicorn.Config(
        app,
        loop="asyncio",
        http=guarded_protocol(limits),
        backlog=limits.backlog,
        timeout_keep_alive=limits.keep_alive_timeout,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        lifespan="on",
        **settings,
    )
    limit_repeats("uvicorn", "uvicorn.error", "uvicorn.access")  # after uvicorn.Config installed its handlers
    return config


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from runtime.bundle import BundleError, read_manifest
    from runtime.http.auth import AuthConfigError, load_api_key

    if args.speculative and args.decode == "throughput":
        print("error: --speculative verifies drafts through the int8 graph, which --decode throughput does not load; "
              "drop one of them", file=sys.stderr)  # fmt: skip
        return 2
    try:
        manifest = read_manifest(args.bundle)
        api_key = load_api_key(args.api_key_env, args.api_key_file)
    except (BundleError, AuthConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    listener = bind(args.host, args.port)
    if listener is None:
        return 1
    args.port = listener.getsockname()[1]
    model_name = args.model_name or manifest.function

    def load() -> Engine:
        if args.sagemaker:  # adapters added with `pkg adapter add --target aws-sagemaker`, from the function's bucket
            from runtime.adapters.s3_store import SAGEMAKER, fetch_adapters

            fetch_adapters(args, args.bundle, target=SAGEMAKER)
        engine = load_model(args.bundle, manifest, args)
        served = model_name if manifest.encoder is None else f"{manifest.task} of {model_name}"
        elapsed = time.monotonic() - RUNTIME_IMPORTED
        log.info("serving %s on http://%s:%d (%.2f s after start)", served, args.host, args.port, elapsed)
        log.info("%s", TIMELINE.log_line())
        return engine

    loading = in_thread(load, "onnxfn-engine-loader")
    wait_for_session_start()  # the HTTP stack imports while the session builds
    with TIMELINE.phase("imports_server"):
        import uvicorn

        from runtime.http import connections  # noqa: F401  (uvicorn's protocol module: part of this phase)
        from runtime.http.app import create_app
        from runtime.http.state import ServerSettings
    policy = request_policy(args, manifest)
    settings = ServerSettings(
        policy=policy,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        fingerprint=fingerprint(manifest),
        max_waiting=args.max_waiting,
    )
    if api_key is None:
        log.warning("no API key configured: /v1/* is open to anyone who can reach %s:%d", args.host, args.port)

    def stop_server() -> None:
        server.should_exit = True

    app = create_app(
        settings, loading.result, on_load_failure=stop_server, sagemaker=args.sagemaker, task=manifest.task
    )
    signal.signal(signal.SIGUSR1, lambda signum, frame: _resumed_from_process_snapshot(args, app, stop_server))
    server = uvicorn.Server(uvicorn_config(app, args))
    logging.getLogger("uvicorn.access").addFilter(_skip_probes)
    server.run(sockets=[listener])
    return 1 if app.state.server.load_error is not None else 0


def _resumed_from_process_snapshot(args: argparse.Namespace, app: Any, stop_server: Callable[[], None]) -> None:
    """The local target restored this process from a CRIU snapshot and says so with SIGUSR1: run the
    after-restore hook SnapStart runs. Every copy of a snapshot gets its own random generators, and the key
    file is read again: a deploy may have generated a new key since the snapshot was taken."""
    from runtime.http.auth import AuthConfigError, BearerAuth, load_api_key
    from runtime.startup import after_restore

    def refresh() -> None:
        if args.api_key_file is None:
            return  # a key from the environment cannot change: the deploy resumes only the same one
        try:
            app.state.server.auth = BearerAuth(load_api_key(None, args.api_key_file))
        except AuthConfigError as exc:
            log.error("after a restore: %s; stopping rather than serving with the snapshot's key", exc)
            stop_server()

    after_restore(refresh)


def _skip_probes(record: logging.LogRecord) -> bool:
    """Keep health checks and scrapes (several a second while starting) out of the access log."""
    args = record.args
    return not (isinstance(args, tuple) and len(args) > 2 and args[2] in _PROBE_PATHS)


def bind(host: str, port: int) -> socket.socket | None:
    """The listening socket, bound before anything loads so a taken port fails in milliseconds, not after the
    model has loaded; None once the reason is printed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        print(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return None
