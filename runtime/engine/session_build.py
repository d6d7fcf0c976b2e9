"""Building the decoder's ONNX Runtime sessions: their options, a one-token warm-up, a build on a helper thread."""

from __future__ import annotations

import atexit
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from runtime.adapters.layout import INDEX_INPUT
from runtime.bundle import Bundle, ModelFacts
from runtime.engine.config import EngineConfig
from runtime.engine.graphs import decoder_facts, prefill_graph_path, prefill_graph_usable
from runtime.engine.huge_pages import Interval, memory_map, subtract
from runtime.engine.providers import plan_providers
from runtime.engine.tables import inference_session
from runtime.threads import lower_priority

if TYPE_CHECKING:
    from numpy.typing import NDArray


@dataclass(frozen=True)
class SessionOptions:
    threads: int = 2
    providers: tuple[str, ...] = ("cpu",)
    allow_spinning: bool = True

    @classmethod
    def for_engine(cls, config: EngineConfig) -> SessionOptions:
        return cls(config.threads, config.providers, config.allow_spinning)


def create_session(model_path: Path, options: SessionOptions, bundle: Bundle | None = None) -> ort.InferenceSession:
    """A session on the first available requested provider; TensorRT reuses its engine cache beside the bundle.

    `bundle`: the bundle the graph is from (or a copy of), for the scale tables it names (tables.py)."""
    plan = plan_providers(options.providers, ort.get_available_providers(), model_path.parent)
    so = ort.SessionOptions()
    so.intra_op_num_threads = options.threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if options.allow_spinning else "0")
    # Spin-wait only inside a run: between decode steps the engine's Python work needs the cores, and the
    # decode and prefill sessions' pools must not spin against each other. Without it a pool thread spins on
    # for tens of ms after a run (~75 % of a 50 ms idle gap, measured here), and a second session starting
    # 20 ms after the first one's last run decoded its next 32 tokens 3-4 % slower.
    so.add_session_config_entry("session.force_spinning_stop", "1")
    # Prepack the weights on the intra-op threads: session creation 343 -> 247 ms (decode graph), 590 -> 370 ms
    # (prefill graph) on 2 cores; the packed weights are the same.
    so.add_session_config_entry("session.prepack.enable_parallel", "1")
    if plan.tensorrt_cache is not None:
        plan.tensorrt_cache.directory.mkdir(parents=True, exist_ok=True)
        model_path = plan.tensorrt_cache.model_to_load(model_path)
    providers = list(zip(plan.names, plan.options, strict=True))
    return inference_session(model_path, so, providers, bundle)


@dataclass(frozen=True)
class WarmUp:
    """A one-token forward with an empty past: runs every kernel once and writes no shared buffer."""

    facts: ModelFacts

    def feed(self, session: ort.InferenceSession) -> dict[str, NDArray[np.generic]]:
        facts, io = self.facts, self.facts.io
        empty = np.zeros((1, facts.num_kv_heads, 0, facts.head_dim), dtype=facts.kv_dtype)
        feed = {io.input_ids: np.zeros((1, 1), np.int64), io.attention_mask: np.ones((1, 1), np.int64)}
        return feed | {past: empty for past, _ in io.cache_names(facts.num_layers)} | base_adapter_feed(session)


def base_adapter_feed(session: ort.InferenceSession) -> dict[str, NDArray[np.generic]]:
    """A graph taking LoRA adapters (runtime/adapters/layout.py) run as the base model: index 0, no slot bound."""
    feed: dict[str, NDArray[np.generic]] = {}
    for graph_input in session.get_inputs():
        if graph_input.name == INDEX_INPUT:
            feed[graph_input.name] = np.zeros(1, np.int64)
        elif graph_input.name.startswith("adapters."):
            rows, columns = graph_input.shape
            shape = (rows, 0) if isinstance(rows, int) else (0, columns)  # A [in, 0], B [0, out]: nothing bound
            feed[graph_input.name] = np.zeros(shape, np.float32)
    return feed


_building: set[Future[ort.InferenceSession]] = set()


@atexit.register
def _finish_builds() -> None:
    """Let sessions still being built finish before the interpreter exits.

    ONNX Runtime aborts a process that exits while it builds a session on another thread
    ("terminate called without an active exception"), whichever way the process ends.
    """
    futures_wait(list(_building))


class SessionBuild:
    """A session being created on a helper thread.

    ONNX Runtime releases the GIL while it loads the graph and prepacks the weights (most of a cold
    start), so whatever the caller does meanwhile (imports, parsing the tokenizer) comes for free.
    """

    def __init__(
        self,
        model_path: Path | Callable[[], Path],
        options: SessionOptions,
        *,
        background: bool = False,
        warm_up: WarmUp | None = None,
        start: bool = True,
        bundle: Bundle | None = None,
    ) -> None:
        """`model_path`: the graph, or a function returning it (called on the building thread).

        `background`: build at a low CPU priority, so requests served meanwhile lose little time to it.

        `warm_up`: a one-token forward run before the session is handed over (ONNX Runtime's first run
        allocates and initialises), for a session that is not used at once: it costs this thread only.
        `start`: begin now; otherwise at `start()`, or at `result()` at the latest.
        `bundle`: the bundle the graph is from, for the scale tables it names (tables.py).
        """
        self.started = time.monotonic()
        self.finished: float | None = None
        # The anonymous memory that appeared while the session was built (mostly its prepacked weights).
        self.allocated: list[Interval] = []
        self._done: Future[ort.InferenceSession] = Future()
        self._args = (model_path, options, background, warm_up, bundle)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    def start(self) -> None:
        """Begin building, once (later calls do nothing)."""
        with self._lock:
            if self._thread is not None:
                return
            self.started = time.monotonic()
            _building.add(self._done)  # only builds that run: the exit waits for them
            self._done.add_done_callback(_building.discard)
            self._thread = threading.Thread(target=self._build, args=self._args, name="onnxfn-session", daemon=True)
            self._thread.start()

    def _build(
        self,
        model_path: Path | Callable[[], Path],
        options: SessionOptions,
        background: bool,
        warm_up: WarmUp | None,
        bundle: Bundle | None,
    ) -> None:
        if background:
            lower_priority()  # the session's pool threads, created here, inherit it
        try:
            path = model_path if isinstance(model_path, Path) else model_path()
            before = memory_map()
            session = create_session(path, options, bundle)
            self.allocated = subtract(memory_map(), before)
            if warm_up is not None:
                session.run(None, warm_up.feed(session))
        except BaseException as exc:  # raised again by `result()` on the waiting thread
            self._done.set_exception(exc)
            return
        self.finished = time.monotonic()
        self._done.set_result(session)

    def result(self) -> ort.InferenceSession:
        self.start()
        return self._done.result()

    @property
    def done(self) -> bool:
        return self._done.done()

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the build has finished or failed (on the building thread, or here if it has)."""
        self._done.add_done_callback(lambda _: callback())

    @property
    def duration(self) -> float:
        return (self.finished or time.monotonic()) - self.started


def prefill_session_build(bundle: Bundle, config: EngineConfig, background: bool) -> SessionBuild | None:
    """The build of the bundle's prefill graph (if it has one and the engine runs on the CPU), started now beside
    the decoder's, or in the `background` when the engine starts it."""
    if not prefill_graph_usable(bundle, config):
        return None
    # A graph used at once gets its warm-up through the engine's bindings (`DecoderSession.warm_up`); one
    # built in the background is warmed on its own thread, before the engine switches to it.
    warm_up = WarmUp(decoder_facts(bundle)) if background else None
    options = SessionOptions.for_engine(config)
    # Resolved on the building thread: a derived graph may be written first (engine/derived.py), and a failure
    # there is the build's, which a deferred build survives by serving prompts through the decode graph.
    path = functools.partial(prefill_graph_path, bundle, config)
    return SessionBuild(path, options, background=background, warm_up=warm_up, start=not background, bundle=bundle)
