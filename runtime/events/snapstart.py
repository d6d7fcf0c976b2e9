"""Lambda start-up: load the engine in the init phase, and SnapStart's runtime hooks around it.

Lambda runs module-level code of the handler in its init phase, with a full CPU boost; on-demand
functions therefore load the engine there (`initialize`), not on the first invocation. With SnapStart,
that init phase runs once when a version is published; Lambda snapshots the microVM's memory after it
and every cold start resumes from the snapshot. Before the snapshot the engine is loaded and warmed (one
short generation touches the weights, ONNX Runtime's arena and its thread pool); after a restore, state
that copies of one snapshot must not share is refreshed: the `random` and numpy global generators are
reseeded from the OS (per-request samplers already draw their own OS entropy), and the callables the
wiring passes (AWS clients, whose credentials may have expired) are rebuilt.

Zip package or container image: AWS offers SnapStart for zip-packaged functions only (Python 3.12+),
not for container images, and a zip package (with layers) is limited to 250 MB unzipped, so onnxruntime
(~60 MB), numpy, tokenizers and the runtime fit, but the demo's 270 MB bundle does not. SnapStart does
not combine with EFS, provisioned concurrency or ephemeral storage above 512 MB, so with SnapStart the
bundle is fetched from S3 into /tmp (512 MB) in the init phase, once, before the snapshot: that suits
bundles up to ~400 MB. Larger bundles, or functions without SnapStart, use a container image (up to
10 GB) carrying the bundle in its own layer; its init phase pays the full start on every cold start.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

log = logging.getLogger("runtime.events")
INIT_TYPE_ENV = "AWS_LAMBDA_INITIALIZATION_TYPE"  # "snap-start" while Lambda prepares a snapshot
WARMUP_PROMPT = "Hello"


def initialize(load: Callable[[], Any], refresh: Sequence[Callable[[], None]] = ()) -> None:
    """Call at the handler module's import: under SnapStart register the hooks, otherwise load right away."""
    if os.environ.get(INIT_TYPE_ENV) == "snap-start":
        register_hooks(load, refresh)
    else:
        load()


def register_hooks(load: Callable[[], Any], refresh: Sequence[Callable[[], None]] = ()) -> None:
    from snapshot_restore_py import register_after_restore, register_before_snapshot

    register_before_snapshot(before_snapshot, load)
    register_after_restore(after_restore, tuple(refresh))


def before_snapshot(load: Callable[[], Any]) -> None:
    """Load the queue handler's engine and run one short generation, so the snapshot holds a warm engine."""
    handler = load()
    engine = handler.state.require_engine()
    warm_up(engine)
    log.info("SnapStart: engine loaded and warmed before the snapshot")


def warm_up(engine: Any) -> None:
    """One greedy token from a tiny prompt: faults the weights in and sizes ORT's arena and threads."""
    from runtime.engine.request import GenerationRequest, SamplingParams

    prompt = tuple(engine.tokenizer.encode(WARMUP_PROMPT))
    engine.generate(GenerationRequest("snapstart-warmup", prompt, SamplingParams(max_tokens=1, temperature=0)))


def after_restore(refresh: Sequence[Callable[[], None]] = ()) -> None:
    """Give this copy of the snapshot its own randomness, and rebuild what was bound to the snapshot's moment."""
    reseed_generators()
    for rebuild in refresh:
        rebuild()
    log.info("SnapStart: restored; generators reseeded, %d client(s) refreshed", len(refresh))


def reseed_generators() -> None:
    random.seed(os.urandom(32))
    np.random.seed(int.from_bytes(os.urandom(4), "little"))
