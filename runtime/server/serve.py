"""`python -m runtime serve BUNDLE_DIR`: the OpenAI-compatible HTTP server for one bundle.

Every setting is a flag, so the runtime never reads the function spec: the packager (or a container's
command line) translates the spec into flags. Heavy imports wait until `run`, so `--help` stays instant.

Start-up order is the cold-start path: bind the port, start loading the engine on a background thread
(ONNX Runtime builds its session without holding the GIL), and only then import the HTTP stack, which
runs alongside. The bundle is hashed once and a record of that is trusted later (`runtime.verified`);
the bundle's snapshot seeds the prefix cache (`runtime.snapshot`). A bundle's prefill graph loads after
`/ready`, once the engine is quiet, at low CPU priority (`EngineConfig.defer_prefill_graph`): a start waits
for one session, not two, and a first request does not share the cores with the second.
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

from runtime.server.connection_limits import ConnectionLimits, add_connection_arguments
from runtime.startup import RUNTIME_IMPORTED, TIMELINE
from runtime.threads import in_thread

if TYPE_CHECKING:
    from runtime.bundle import Manifest
    from runtime.encoder.engine import EncoderConfig
    from runtime.engine.config import EngineConfig
    from runtime.engine.engine import Engine
    from runtime.engine.reports import StepReport
    from runtime.server.protocol import RequestPolicy

log = logging.getLogger("runtime.server")

# Flags that map one-to-one onto EngineConfig fields (unset flags keep EngineConfig's defaults).
_ENGINE_FLAGS = ("max_batch", "max_queue", "prefill_chunk", "max_context", "threads")
_PROBE_PATHS = ("/health", "/ready", "/metrics")
SESSION_START_WAIT = 1.0  # seconds a frontend waits for the session build to start (more: hashing)
SESSION_IMPORTS = "imports_onnxruntime"  # the start-up phase whose end the session build follows at once


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="serve a bundle over an OpenAI-compatible HTTP API")
    parser.add_argument("bundle", type=Path, metavar="BUNDLE_DIR", help="a bundle written by `pkg build`")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    auth = parser.add_argument_group("auth (neither flag: no auth)")
    auth.add_argument("--api-key-env", metavar="NAME", help="read the bearer API key from $NAME")
    auth.add_argument("--api-key-file", type=Path, metavar="PATH", help="read the bearer API key from a file")
    add_model_arguments(parser)
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request bodies above this get 413")
    parser.add_argument(
        "--max-waiting", type=int, help="requests that may wait for a slot before 429 (default: --max-queue decides)"
    )
    add_connection_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--sagemaker", action="store_true", help="also serve SageMaker's /ping and /invocations")
    parser.set_defaults(run=run)


def uvicorn_config(app: Any, args: argparse.Namespace, **settings: Any) -> Any:
    """uvicorn's settings for `app`, with the connection limits of `add_connection_arguments`' flags.

    httptools parses and frames HTTP in C: 8 streams over HTTP on 2 cores +9 %, 8 % less server CPU than
    uvicorn's pure-Python h11 (measured here; uvloop gave the same gain, not more). asyncio's loop, not
    uvloop: libuv >= 1.50 keeps an io_uring, which CRIU cannot dump (the local target's process snapshot).
    """
    import uvicorn

    from runtime.log_limits import limit_repeats
    from runtime.server.connections import guarded_protocol

    limits = ConnectionLimits.for_process(
        args.max_connections,
        max_header_bytes=args.max_header_bytes,
        head_timeout=args.head_timeout,
        body_timeout=args.body_timeout,
    )
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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine and request flags every frontend shares (the HTTP server, the queue worker, Lambda)."""
    parser.add_argument("--model-name", help="the model id clients send (default: the bundle's function name)")
    engine = parser.add_argument_group("engine (unset: the engine's defaults)")
    engine.add_argument("--max-batch", type=int, help="sequences decoded together (KV slots)")
    engine.add_argument("--max-queue", type=int, help="requests waiting beyond that before 429")
    engine.add_argument("--kv-memory-mb", type=int, help="KV cache budget")
    engine.add_argument("--prefix-cache-mb", type=int, help="prefix cache budget")
    engine.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill step")
    engine.add_argument("--max-context", type=int, help="context length cap (default: the model's)")
    engine.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads")
    engine.add_argument(
        "--spin",
        action=argparse.BooleanOptionalAction,
        help="ONNX Runtime threads spin-wait inside a forward pass (default: on; --no-spin on shared CPUs)",
    )
    engine.add_argument("--providers", help="execution providers in order, comma-separated (cpu,cuda,tensorrt)")
    engine.add_argument(
        "--decode",
        choices=("latency", "throughput"),
        help="latency: the int8 graph decodes (fastest single stream); throughput: the prefill graph decodes too "
        "(faster from ~3 concurrent streams on CPUs without int8 dot products). Default: latency",
    )
    engine.add_argument(
        "--prefill-matmuls",
        choices=("auto", "fp32", "quantized"),
        help="which prefill graph prompts run through: the model's quantized matmuls or fp32 ones; auto: quantized "
        "on a CPU with int8 dot products (VNNI), fp32 elsewhere. Default: auto",
    )
    engine.add_argument(
        "--speculative",
        action=argparse.BooleanOptionalAction,
        help="prompt-lookup speculative decoding for greedy requests decoding alone (default: the engine's, off)",
    )
    engine.add_argument(
        "--no-verify", action="store_true", help="never hash the bundle's files (default: once, then a stat check)"
    )
    engine.add_argument("--no-snapshot", action="store_true", help="ignore the bundle's cold-start snapshot")
    engine.add_argument(
        "--prepacked",
        type=Path,
        metavar="DIR",
        help="load the graphs from DIR, copies with their weights packed for this CPU (pkg deploy --target local "
        "writes them), when they are valid for this bundle and machine",
    )
    requests = parser.add_argument_group("requests")
    requests.add_argument("--temperature", type=float, default=1.0, help="default temperature")
    requests.add_argument("--top-p", type=float, default=1.0, help="default top_p")
    requests.add_argument("--max-tokens", type=int, default=256, help="default max_tokens")
    requests.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a client may ask")
    requests.add_argument("--max-prompt-tokens", type=int, help="longest prompt accepted (default: context)")
    requests.add_argument("--system-prompt", help="used when a chat has no system message; its KV is pre-warmed")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from runtime.bundle import BundleError, read_manifest
    from runtime.server.auth import AuthConfigError, load_api_key

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

        from runtime.server import connections  # noqa: F401  (uvicorn's protocol module: part of this phase)
        from runtime.server.app import create_app
        from runtime.server.state import ServerSettings
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
    from runtime.events.snapstart import after_restore
    from runtime.server.auth import AuthConfigError, BearerAuth, load_api_key

    def refresh() -> None:
        if args.api_key_file is None:
            return  # a key from the environment cannot change: the deploy resumes only the same one
        try:
            app.state.server.auth = BearerAuth(load_api_key(None, args.api_key_file))
        except AuthConfigError as exc:
            log.error("after a restore: %s; stopping rather than serving with the snapshot's key", exc)
            stop_server()

    after_restore(refresh)


def wait_for_session_start() -> None:
    """Return once a loader thread has imported onnxruntime and begun its session (or after `SESSION_START_WAIT`).

    Imports hold the GIL, and ONNX Runtime builds a session without it: a caller that waits for the build to
    begin before importing anything else has its imports overlap the build instead of delaying its start.
    """
    TIMELINE.wait_for(SESSION_IMPORTS, timeout=SESSION_START_WAIT)


def request_policy(args: argparse.Namespace, manifest: Manifest) -> RequestPolicy:
    """The request limits and defaults set by `add_model_arguments`' flags."""
    from runtime.server.protocol import RequestPolicy

    return RequestPolicy(
        model_name=args.model_name or manifest.function,
        vocab_size=(manifest.encoder or manifest.model).vocab_size,  # type: ignore[union-attr]
        default_temperature=args.temperature,
        default_top_p=args.top_p,
        default_max_tokens=args.max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_prompt_tokens=args.max_prompt_tokens,
        max_n=args.max_batch or 16,
        system_prompt=args.system_prompt,
    )


def fingerprint(manifest: Manifest) -> str:
    """OpenAI's `system_fingerprint` for this bundle, so clients can tell builds apart."""
    return "fp_" + manifest.digest.removeprefix("sha256:")[:12]


def _skip_probes(record: logging.LogRecord) -> bool:
    """Keep health checks and scrapes (several a second while starting) out of the access log."""
    args = record.args
    return not (isinstance(args, tuple) and len(args) > 2 and args[2] in _PROBE_PATHS)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings from `add_model_arguments`' flags; unset flags keep the engine's defaults."""
    from runtime.engine.config import EngineConfig

    overrides: dict[str, Any] = {name: getattr(args, name) for name in _ENGINE_FLAGS if getattr(args, name)}
    overrides["defer_prefill_graph"] = True  # a server is ready once the decode graph is loaded
    if args.kv_memory_mb is not None:
        overrides["kv_memory_bytes"] = args.kv_memory_mb << 20
    if args.prefix_cache_mb is not None:
        overrides["prefix_cache_bytes"] = args.prefix_cache_mb << 20
    if args.speculative is not None:
        overrides["speculative"] = args.speculative
    if args.decode is not None:
        overrides["decode"] = args.decode
    if args.prefill_matmuls is not None:
        overrides["prefill_matmuls"] = args.prefill_matmuls
    if args.spin is not None:
        overrides["allow_spinning"] = args.spin
    if args.prepacked is not None:
        overrides["prepacked"] = args.prepacked
    if args.providers:
        overrides["providers"] = tuple(p.strip() for p in args.providers.split(",") if p.strip())
    return EngineConfig(**overrides)


def load_model(bundle: Path, manifest: Manifest, args: argparse.Namespace) -> Engine:
    """The engine `bundle` needs, set by `add_model_arguments`' flags: an encoder for an embedding or
    classification bundle (`--max-batch` caps its rows per forward), the generation engine otherwise."""
    if manifest.encoder is None:
        return start_engine(
            bundle,
            engine_config(args),
            verify=not args.no_verify,
            system_prompt=args.system_prompt,
            use_snapshot=not args.no_snapshot,
        )
    with TIMELINE.phase(SESSION_IMPORTS):  # the encoder's module imports onnxruntime; its session follows
        from runtime.encoder.engine import start_encoder

    encoder = start_encoder(bundle, encoder_config(args), verify=not args.no_verify)
    return encoder  # type: ignore[return-value]  # its frontends need only stats() and shutdown() of either engine


def encoder_config(args: argparse.Namespace) -> EncoderConfig:
    """The encoder settings from `add_model_arguments`' flags; unset flags keep the encoder's defaults."""
    from runtime.encoder.engine import EncoderConfig

    providers = tuple(p.strip() for p in args.providers.split(",") if p.strip()) if args.providers else None
    flags = {"threads": args.threads, "max_rows": args.max_batch, "max_queue": args.max_queue, "providers": providers}
    return EncoderConfig(**{k: v for k, v in flags.items() if v})


def start_engine(
    bundle_dir: Path,
    config: EngineConfig,
    *,
    verify: bool = True,
    system_prompt: str | None = None,
    use_snapshot: bool = True,
) -> Engine:
    """Open the bundle (hashing it unless a record says it is unchanged), start the engine, seed its prefix cache.

    The system prompt's KV comes from the bundle's snapshot when it holds a compatible one, and is computed
    otherwise. Each phase lands in the start-up timeline.
    """
    with TIMELINE.phase("bundle_verify"):
        from runtime.bundle import open_bundle
        from runtime.verified import open_verified

        bundle = open_verified(bundle_dir)[0] if verify else open_bundle(bundle_dir, verify=False)
    # The session is the longest part of a start: begin it before anything else is imported.
    with TIMELINE.phase(SESSION_IMPORTS):
        from runtime.engine.graphs import decode_graph_path
        from runtime.engine.session_build import SessionBuild, SessionOptions
    build = SessionBuild(decode_graph_path(bundle, config), SessionOptions.for_engine(config))
    with TIMELINE.phase("imports_engine"):
        from runtime.engine.engine import Engine
        from runtime.snapshot import restore_snapshot, system_prompt_prefixes

    engine = Engine(bundle, config, on_step=_record_first_step, session_build=build)
    TIMELINE.record("session", build.started, build.started + build.duration)
    TIMELINE.record("engine", build.started, time.monotonic())
    tokenizer_start = time.monotonic() - engine.load_times.total
    TIMELINE.record("tokenizer", tokenizer_start, tokenizer_start + engine.load_times.tokenizer)
    engine.start()
    restored: set[tuple[int, ...]] = set()
    if use_snapshot:
        with TIMELINE.phase("snapshot_restore"):
            result = restore_snapshot(engine, bundle)
        restored = {p.token_ids for p in result.restored}
        if result.restored:
            log.info("snapshot: %d prefix token(s) restored into the prefix cache", result.restored_tokens)
    if system_prompt:
        prefixes = system_prompt_prefixes(engine.tokenizer, system_prompt)
        if not restored.issuperset(prefixes):
            with TIMELINE.phase("system_prompt_prefill"):
                computed = engine.warm_prefixes(prefixes)
            log.info("system prompt: %d tokens computed and pinned in the prefix cache", computed)
    return engine


def _record_first_step(report: StepReport) -> None:
    """The first request's prefill step (it samples the first token too) completes the start-up timeline."""
    if report.prefill_tokens and not TIMELINE.has("first_step"):
        end = time.monotonic()
        TIMELINE.record("first_step", end - report.duration, end)
        log.info("%s", TIMELINE.log_line())


def bind(host: str, port: int) -> socket.socket | None:
    """The listening socket, bound before anything loads so a taken port fails in milliseconds, not after the
    model has loaded; None once the reason is printed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        print(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return None
