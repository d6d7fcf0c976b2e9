"""The bundle being served: the runtime's own HTTP app over a fresh engine, swappable under live traffic.

Each bundle gets its own app from `runtime.http.app.create_app` (the same routes, auth, errors and
metrics as `python -m runtime serve`), built only after its engine passed a smoke generation. The slot
routes every non-`/agent` request to whichever app is current when the request arrives; a swap is one
attribute assignment, so no request is refused during it. The old app keeps the requests it already
has (streams included) until they finish, then its engine is shut down.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from runtime.api.errors import unavailable
from runtime.bundle import Bundle

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from runtime.engine.engine import Engine

SMOKE_TOKENS = 4
SMOKE_PROMPT = "Hello"


class LoadError(Exception):
    """The bundle passed verification but could not serve: its engine failed to start or to generate."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Serving:
    bundle: Bundle
    app: Starlette
    loaded_at: float = field(default_factory=time.time)
    in_flight: int = 0  # requests inside `app`; only the event loop thread changes it

    @property
    def engine(self) -> Engine:
        return self.app.state.server.require_engine()

    def shutdown(self) -> None:
        self.app.state.server.shutdown()


@dataclass(frozen=True)
class ServingOptions:
    """How every bundle is served: the `add_model_arguments` flags, the /v1 key, and the smoke test's time limit."""

    args: argparse.Namespace
    api_key: str | None
    max_body_bytes: int
    smoke_timeout: float


def load_serving(bundle: Bundle, options: ServingOptions) -> Serving:
    """Start a fresh engine for `bundle`, smoke-test it, and wrap it in the runtime's HTTP app."""
    from runtime.http.app import create_app
    from runtime.http.state import ServerSettings
    from runtime.startup import engine_config, fingerprint, request_policy, start_engine

    args = options.args
    try:
        engine = start_engine(
            bundle.path,
            engine_config(args),
            verify=False,  # the installer verified it a moment ago
            system_prompt=args.system_prompt,
            use_snapshot=not args.no_snapshot,
        )
    except Exception as exc:
        raise LoadError(
            f"the bundle's engine failed to start: {type(exc).__name__}: {exc}", code="load_failed"
        ) from exc
    try:
        smoke_test(engine, bundle, options.smoke_timeout)
    except BaseException:
        engine.shutdown()
        raise
    settings = ServerSettings(
        policy=request_policy(args, bundle.manifest),
        api_key=options.api_key,
        max_body_bytes=options.max_body_bytes,
        fingerprint=fingerprint(bundle.manifest),
    )
    app = create_app(settings, lambda: engine)
    app.state.server.load(lambda: engine)  # the app's own lifespan never runs here: hand it the engine
    return Serving(bundle, app)


def smoke_test(engine: Engine, bundle: Bundle, timeout: float) -> None:
    """Generate `SMOKE_TOKENS` greedy tokens from a short prompt; raise `LoadError` unless that works."""
    from runtime.engine.graphs import decoder_facts
    from runtime.engine.kv_cache import context_reason
    from runtime.engine.request import GenerationRequest, SamplingParams

    tokenizer = engine.tokenizer
    text = SMOKE_PROMPT
    model = bundle.manifest.model
    if model is not None and model.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": SMOKE_PROMPT}])
    request = GenerationRequest(
        f"agent-smoke-{uuid.uuid4().hex[:8]}",
        tuple(tokenizer.encode(text)),
        SamplingParams(max_tokens=SMOKE_TOKENS, temperature=0.0, ignore_eos=True),
    )
    needed = len(request.prompt_token_ids) + SMOKE_TOKENS
    if needed > engine.max_context:  # the KV budget is per device: say which setting, not "reduce the prompt"
        config = engine.config
        reason = context_reason(decoder_facts(bundle), config.max_batch, config.kv_memory_bytes, config.max_context)
        raise LoadError(f"the smoke generation needs {needed} tokens and {reason}", code="smoke_failed")
    with ThreadPoolExecutor(1, thread_name_prefix="onnxfn-smoke") as pool:
        future = pool.submit(engine.generate, request)
        try:
            outputs = future.result(timeout=timeout)
        except FutureTimeout:
            engine.abort(request.request_id)
            raise LoadError(f"the smoke generation took longer than {timeout:g} s", code="smoke_failed") from None
        except Exception as exc:
            raise LoadError(f"the smoke generation failed: {type(exc).__name__}: {exc}", code="smoke_failed") from exc
    produced = outputs[0].completion_tokens if outputs else 0
    if produced != SMOKE_TOKENS:
        raise LoadError(
            f"the smoke generation produced {produced} tokens instead of {SMOKE_TOKENS}", code="smoke_failed"
        )


class ServingSlot:
    """The ASGI app for everything outside `/agent`: the current bundle's app, or 503 while there is none."""

    def __init__(self) -> None:
        self.current: Serving | None = None
        self.state = "starting"  # starting, serving, empty (nothing installed), failed (nothing servable)
        self.problem: str | None = None

    def swap(self, new: Serving) -> Serving | None:
        old, self.current = self.current, new
        self.state, self.problem = "serving", None
        return old

    def unavailable(self, state: str, problem: str) -> None:
        self.state, self.problem = state, problem

    async def drain(self, old: Serving | None, timeout: float) -> None:
        """Let `old` finish the requests it holds (up to `timeout` s), then stop its engine."""
        if old is None:
            return
        deadline = time.monotonic() + timeout
        while old.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(old.shutdown)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        serving = self.current
        if serving is None:
            await self._no_bundle(scope, receive, send)
            return
        serving.in_flight += 1
        try:
            await serving.app(scope, receive, send)
        finally:
            serving.in_flight -= 1

    async def _no_bundle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":  # the process is alive: the agent can still take a push
            response = JSONResponse({"status": "ok", "bundle": None})
        else:
            messages = {
                "starting": "the agent is loading its bundle; retry shortly (GET /ready reports when it is up)",
                "empty": "no bundle is installed on this device yet: push one with `pkg push`",
            }
            message = messages.get(self.state, f"no servable bundle: {self.problem}")
            error = unavailable(message)
            response = JSONResponse(error.body(), status_code=error.status)
        await response(scope, receive, send)
