"""Lambda start-up: load the engine in the init phase, and SnapStart's runtime hooks around it.

Lambda runs module-level code of the handler in its init phase, with a full CPU boost; on-demand
functions therefore load the engine there (`initialize`), not on the first invocation. With SnapStart,
that init phase runs once when a version is published; Lambda snapshots the microVM's memory after it
and every cold start resumes from the snapshot. Before the snapshot the engine is loaded and warmed (one
short generation touches the weights, ONNX Runtime's arena and its thread pool); after a restore, state
that copies of one snapshot must not share is refreshed: the `random` and numpy global generators are
reseeded from the OS (per-request samplers already draw their own OS entropy), and the wiring's `refresh`
rebuilds what is bound to the snapshot's moment and identity (AWS clients, whose credentials were the
snapshot's; creation timestamps).

The hooks are registered with `snapshot-restore-py`; `awslambdaric` runs the before-snapshot ones (last
registered first) once the handler module is imported, asks the Runtime API for `restore/next` (where
the snapshot is taken and, later, resumed), then runs the after-restore ones in registration order.

SnapStart exists for zip-packaged functions only; when the Lambda target uses it and when a container
image: docs/targets/aws-lambda.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from runtime.startup import after_restore

if TYPE_CHECKING:
    from runtime.engine.engine import Engine

log = logging.getLogger("runtime.aws_lambda")
INIT_TYPE_ENV = "AWS_LAMBDA_INITIALIZATION_TYPE"  # "snap-start" while Lambda prepares a snapshot
WARMUP_PROMPT = "Hello"


def initialize(load: Callable[[], Engine], refresh: Callable[[], None]) -> None:
    """Call at the handler module's import: under SnapStart register the hooks, otherwise load right away."""
    if os.environ.get(INIT_TYPE_ENV) == "snap-start":
        register_hooks(load, refresh)
    else:
        load()


def register_hooks(load: Callable[[], Engine], refresh: Callable[[], None]) -> None:
    from snapshot_restore_py import register_after_restore, register_before_snapshot

    register_before_snapshot(before_snapshot, load)
    register_after_restore(after_restore, refresh)


def before_snapshot(load: Callable[[], Engine]) -> None:
    """Load the engine (the bundle's system-prompt KV restored into its prefix cache) and warm it."""
    warm_up(load())
    log.info("SnapStart: engine loaded and warmed before the snapshot")


def warm_up(engine: Engine) -> None:
    """One greedy token from a tiny prompt (one forward for an encoder): faults the weights in and sizes ORT's
    arena and threads."""
    from runtime.encoder.engine import EncoderEngine
    from runtime.engine.request import GenerationRequest, SamplingParams

    if isinstance(engine, EncoderEngine):
        engine.embed_texts([WARMUP_PROMPT])
        return
    prompt = tuple(engine.tokenizer.encode(WARMUP_PROMPT))
    engine.generate(GenerationRequest("snapstart-warmup", prompt, SamplingParams(max_tokens=1, temperature=0)))
