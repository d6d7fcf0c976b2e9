"""Start-up, the same for every frontend: the model flags, opening the bundle, building the engine, restoring
the bundle's snapshot into the prefix cache, and what a restored process snapshot must refresh.

The HTTP server (`python -m runtime serve`), the queue worker, Lambda and the edge agent all start a model
through `begin_loading` (or `load_model` on a thread of their own) and read the same flags
(`add_model_arguments`): one bundle starts the same way wherever it runs.

Start-up order is the cold-start path. The bundle is hashed once and a record of that is trusted later
(`runtime.verified`); ONNX Runtime's session build begins before anything else is imported, and builds
without the GIL, so a frontend that waits for it to begin (`wait_for_session_start`) has its own imports
overlap the build. The bundle's snapshot seeds the prefix cache (`runtime.snapshot`). A bundle's prefill
graph loads after `/ready`, once the engine is quiet, at low CPU priority (`EngineConfig.defer_prefill_graph`):
a start waits for one session, not two, and a first request does not share the cores with the second.
Each phase lands in the start-up timeline (`runtime.timeline`).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.threads import in_thread
from runtime.timeline import TIMELINE

if TYPE_CHECKING:
    from runtime.api.protocol import RequestPolicy
    from runtime.bundle import Manifest
    from runtime.encoder.engine import EncoderConfig
    from runtime.engine.config import EngineConfig
    from runtime.engine.engine import Engine
    from runtime.engine.reports import StepReport

log = logging.getLogger("runtime.startup")

# Flags that map one-to-one onto EngineConfig fields (unset flags keep EngineConfig's defaults).
_ENGINE_FLAGS = ("max_batch", "max_queue", "prefill_chunk", "max_context", "threads")
SESSION_START_WAIT = 1.0  # seconds a frontend waits for the session build to start (more: hashing)
SESSION_IMPORTS = "imports_onnxruntime"  # the start-up phase whose end the session build follows at once


@dataclass
class LoadingModel:
    """A bundle's model loading on a helper thread (see `begin_loading`)."""

    manifest: Manifest
    engine: Future[Engine]


def begin_loading(bundle: Path, args: argparse.Namespace) -> LoadingModel:
    """Start loading `bundle`'s model on a helper thread; return once its session has begun building.

    Whatever the caller imports and builds before waiting on `engine` (its HTTP stack, mangum, boto3 and
    its clients) overlaps the build instead of coming before it. A bad bundle raises `BundleError` here.
    """
    from runtime.bundle import read_manifest

    manifest = read_manifest(bundle)
    engine = in_thread(lambda: load_model(bundle, manifest, args), "onnxfn-engine-loader")
    wait_for_session_start()
    return LoadingModel(manifest, engine)


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
        "--max-adapters",
        type=int,
        metavar="N",
        help="LoRA adapters resident at once, for a bundle whose graph takes them (default: the engine's, 4); "
        "loading one more evicts the least recently used idle one",
    )
    engine.add_argument(
        "--adapter-dir",
        type=Path,
        metavar="DIR",
        help="where adapters added while serving (PUT /v1/adapters/NAME, `pkg adapter add`) are kept, and read "
        "from at start (default: none; adapters cannot be added)",
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


def request_policy(args: argparse.Namespace, manifest: Manifest) -> RequestPolicy:
    """The request limits and defaults set by `add_model_arguments`' flags."""
    from runtime.api.protocol import RequestPolicy

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
    if args.max_adapters is not None:
        overrides["max_adapters"] = args.max_adapters
    if args.adapter_dir is not None:
        overrides["adapter_dir"] = args.adapter_dir
    if args.providers:
        overrides["providers"] = tuple(p.strip() for p in args.providers.split(",") if p.strip())
    return EngineConfig(**overrides)


def encoder_config(args: argparse.Namespace) -> EncoderConfig:
    """The encoder settings from `add_model_arguments`' flags; unset flags keep the encoder's defaults."""
    from runtime.encoder.engine import EncoderConfig

    providers = tuple(p.strip() for p in args.providers.split(",") if p.strip()) if args.providers else None
    flags = {"threads": args.threads, "max_rows": args.max_batch, "max_queue": args.max_queue, "providers": providers}
    return EncoderConfig(**{k: v for k, v in flags.items() if v})


def load_model(bundle: Path, manifest: Manifest, args: argparse.Namespace) -> Engine:
    """The engine `bundle` needs, set by `add_model_arguments`' flags: an encoder for an embedding or
    classification bundle (`--max-batch` caps its rows per forward), the generation engine otherwise."""
    if manifest.encoder is None:
        config = engine_config(args)
        engine = start_engine(
            bundle,
            config,
            verify=not args.no_verify,
            system_prompt=args.system_prompt,
            use_snapshot=not args.no_snapshot,
        )
        limit, facts = args.max_prompt_tokens, manifest.model
        if facts is not None and limit is not None and limit >= engine.max_context:
            from runtime.engine.kv_cache import context_reason

            reason = context_reason(facts, config.max_batch, config.kv_memory_bytes, config.max_context)
            log.warning(
                "[endpoint] max_prompt_tokens (--max-prompt-tokens) is %d, but %s: prompts are limited to %d tokens",
                limit, reason, engine.max_context - 1,
            )  # fmt: skip
        return engine
    with TIMELINE.phase(SESSION_IMPORTS):  # the encoder's module imports onnxruntime; its session follows
        from runtime.encoder.engine import start_encoder

    encoder = start_encoder(bundle, encoder_config(args), verify=not args.no_verify)
    return encoder  # type: ignore[return-value]  # its frontends need only stats() and shutdown() of either engine


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
    build = SessionBuild(decode_graph_path(bundle, config), SessionOptions.for_engine(config), bundle=bundle)
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


def wait_for_session_start() -> None:
    """Return once a loader thread has imported onnxruntime and begun its session (or after `SESSION_START_WAIT`).

    Imports hold the GIL, and ONNX Runtime builds a session without it: a caller that waits for the build to
    begin before importing anything else has its imports overlap the build instead of delaying its start.
    """
    TIMELINE.wait_for(SESSION_IMPORTS, timeout=SESSION_START_WAIT)


def after_restore(refresh: Callable[[], None]) -> None:
    """A process restored from a snapshot (Lambda SnapStart, the local target's CRIU snapshot): give this copy
    its own randomness, and rebuild what was bound to the snapshot's moment and identity (`refresh`).

    Per-request samplers draw their own OS entropy already; the `random` and numpy global generators are
    reseeded here because every copy of one snapshot would otherwise draw the same numbers.
    """
    import numpy as np

    random.seed(os.urandom(32))
    np.random.seed(int.from_bytes(os.urandom(4), "little"))
    refresh()
    log.info("restored from a snapshot: generators reseeded, clients and clocks refreshed")
