"""The engine: a background thread stepping the scheduler, and the API every frontend codes against.

`submit` validates a request and queues it; the step loop admits it, prefills it in chunks and
decodes it alongside everything else running, pushing one `SequenceOutput` per token into the
request's `RequestStream`. Timing for metrics: each stream records `submitted_at` and
`first_output_at`, and the optional `on_step` callback receives a `StepReport` after every step
(batch size, tokens, and the TTFT / time per output token of requests that reached those points).

Start-up is on the cold-start path of every serverless request, so the ORT session (whose weight
prepacking releases the GIL) is built on a helper thread while this thread parses the tokenizer.
Prefix KV (a system prompt) can be computed, pinned in the prefix cache, or restored from a snapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from runtime.bundle import Bundle
from runtime.engine.adapters import EngineAdapters, resolve_adapter
from runtime.engine.background import Idleness, StartupWork
from runtime.engine.config import EngineConfig
from runtime.engine.constraints import GrammarConstraint
from runtime.engine.grammar_cache import CompiledGrammar, GrammarBudget, Grammars
from runtime.engine.graphs import decode_graph_path, decoder_facts, decodes_with_prefill_graph, prefill_graph_file
from runtime.engine.huge_pages import CollapseReport
from runtime.engine.kv_cache import KVPool, PrefixCache, context_for_budget
from runtime.engine.output import OutputProcessor
from runtime.engine.providers import short_name
from runtime.engine.reports import EngineStats, LoadTimes, RequestTiming, StepReport, request_timing
from runtime.engine.request import EngineError, GenerationRequest, InvalidRequestError, SequenceOutput
from runtime.engine.runner import ModelRunner
from runtime.engine.sampling import SequenceSampler
from runtime.engine.scheduler import RequestState, Scheduler, SequenceState
from runtime.engine.session import DecoderSession
from runtime.engine.session_build import SessionBuild, SessionOptions, prefill_session_build
from runtime.engine.speculative import PromptLookup
from runtime.engine.stream import RequestStream, Wakeups
from runtime.engine.tokenizer import Tokenizer
from runtime.engine.validation import validate_request

if TYPE_CHECKING:
    from runtime.engine.kv_cache import KVArray

log = logging.getLogger("runtime.engine")

T = TypeVar("T")


class Engine:
    def __init__(
        self,
        bundle: Bundle,
        config: EngineConfig = EngineConfig(),  # noqa: B008 (frozen, so sharing the default is safe)
        on_step: Callable[[StepReport], None] | None = None,
        session_build: SessionBuild | None = None,
    ) -> None:
        """`session_build`: a session already being created for `bundle` (start-up starts it early)."""
        started = time.perf_counter()
        facts = decoder_facts(bundle)
        self.config = config
        self._facts = facts
        self.max_context = context_for_budget(facts, config.max_batch, config.kv_memory_bytes, config.max_context)
        # The prefill graph may be the one session, decoding included (graphs.decodes_with_prefill_graph).
        self._one_graph = decodes_with_prefill_graph(bundle, config)
        if config.decode == "throughput" and not self._one_graph:
            log.warning("decode = throughput needs the bundle's prefill graph on the CPU: decoding runs the int8 graph")
        if self._one_graph and config.speculative:
            raise ValueError("speculative decoding verifies drafts through the int8 graph: use decode = latency")
        # The bundle file that computes prompts' KV once start-up is over (what a snapshot of prefix KV must match).
        self.prompt_graph_file = prefill_graph_file(bundle, config) or bundle.manifest.model_file
        build = session_build or SessionBuild(
            decode_graph_path(bundle, config), SessionOptions.for_engine(config), bundle=bundle
        )
        prefill_build = None if self._one_graph else prefill_session_build(bundle, config, config.defer_prefill_graph)
        # The session builds (prepacking the weights) on its own thread, without the GIL, while this one
        # parses the tokenizer.
        self.tokenizer = Tokenizer(bundle.tokenizer_path, facts.chat_template, facts.bos_token_id, facts.eos_token_ids)
        tokenizer_s = time.perf_counter() - started
        self._pool = KVPool(facts, config.max_batch, self.max_context)
        budget = GrammarBudget(config.grammar_cache_bytes, config.grammar_max_bytes, compile_s=config.grammar_compile_s)
        self.grammars = Grammars(bundle.tokenizer_path, facts.vocab_size, facts.eos_token_ids, budget)
        session = build.result()
        prefill_session = None
        session_s = build.duration
        if prefill_build is not None and not config.defer_prefill_graph:
            prefill_session = prefill_build.result()
            session_s = max(session_s, prefill_build.duration)
        self.provider = short_name(session.get_providers()[0])  # the one running the graph: `cpu`, `cuda`, …
        self._prefix_cache = PrefixCache(config.prefix_block_size, config.prefix_cache_bytes)
        self.adapters = (
            EngineAdapters.for_bundle(bundle, config.max_adapters, config.adapter_dir, self._pool.slots)
            if bundle.manifest.adapters is not None
            else None
        )
        slots = self.adapters.slots if self.adapters is not None else None
        self._decoder = decoder = DecoderSession(
            session, facts.io, facts.num_layers, self._pool.tensors, facts.vocab_size, config.max_batch,
            config.prefill_chunk, prefill_session, 1 + config.speculative_tokens if config.speculative else 1, slots,
        )  # fmt: skip
        decoder.warm_up()
        self._drafter = PromptLookup(config.speculative_tokens) if config.speculative else None
        self._runner = ModelRunner(decoder, self._pool, self._drafter, slots.rows if slots is not None else None)
        self._scheduler = Scheduler(self._pool, self._prefix_cache, config.max_queue, config.prefill_chunk, slots)
        self._on_step = on_step
        self._streams: dict[str, RequestStream] = {}
        self._stream_wakeups = Wakeups()
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._jobs: list[Callable[[], None]] = []  # run on the engine thread between steps
        self._idleness = Idleness()
        self._tokens_in = self._tokens_out = self._steps = self._last_batch = 0
        self.load_times = LoadTimes(session_s, tokenizer_s, time.perf_counter() - started)
        # Deferred, the prefill graph goes on building while the engine serves (see `_use_prefill_graph`).
        deferred = prefill_build if config.defer_prefill_graph else None
        in_use = [b for b in (build, prefill_build) if b is not None and b is not deferred]
        self._startup = StartupWork(deferred, in_use, config.huge_pages, self._idleness, self._wake)
        self._set_kv_reuse()
        if self._one_graph:  # the line a deferred prefill graph logs when it takes over: prompts run through it
            log.info("prefill graph in use (%s, which decodes too)", self.prompt_graph_file)

    # Lifecycle.
    def start(self) -> None:
        with self._wakeup:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="onnxfn-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._wakeup:
            thread, self._thread = self._thread, None
            self._stopping = True
            self._wakeup.notify()
        if thread is not None:
            thread.join()
        with self._wakeup:
            jobs, self._jobs = self._jobs, []
        for job in jobs:
            job()  # each fails its caller's future: the loop is gone
        for stream in list(self._streams.values()):
            self._scheduler.abort(stream.request_id)
        self._step()

    # Requests.
    def submit(
        self, request: GenerationRequest, *, prompt_param: str = "prompt", grammar: CompiledGrammar | None = None
    ) -> RequestStream:
        """Queue `request`; `prompt_param` names the client field errors about the prompt point at.

        `grammar`: the request's grammar, compiled already (`self.grammars`); without it a grammar is
        compiled here, on the caller's thread, which an event loop must not be.
        """
        validate_request(request, self._facts.vocab_size, self.max_context, self.config.max_batch, prompt_param)
        if grammar is not None and grammar.text != request.sampling.grammar:
            raise ValueError("the compiled grammar is not the one the request's sampling asks for")
        adapter = resolve_adapter(self.adapters, request.adapter)
        now = time.perf_counter()
        group = RequestState(request, submitted_at=now, adapter=adapter)
        group.sequences = [self._sequence(group, i, grammar) for i in range(request.sampling.n)]
        stream = RequestStream(request.request_id, now, self.abort, self._stream_wakeups)
        with self._wakeup:
            if request.request_id in self._streams:
                raise EngineError(f"request id {request.request_id!r} is already in flight")
            self._scheduler.add(group)
            self._streams[request.request_id] = stream
            self._wakeup.notify()
        return stream

    def remove_adapter(self, name: str) -> None:
        """Take `name` out of the catalog; requests running with it finish with it (KeyError: no such adapter)."""
        if self.adapters is None:
            raise KeyError(name)
        self.adapters.remove(name, self._on_engine_thread)

    def abort(self, request_id: str) -> None:
        self._scheduler.abort(request_id)
        self._wake()

    def _wake(self) -> None:
        with self._wakeup:
            self._wakeup.notify()

    def generate(self, request: GenerationRequest, *, prompt_param: str = "prompt") -> list[SequenceOutput]:
        """Run `request` to completion; one merged output per sequence index."""
        self.start()
        merged: dict[int, list[SequenceOutput]] = {}
        for output in self.submit(request, prompt_param=prompt_param):
            merged.setdefault(output.index, []).append(output)
        return [SequenceOutput.joined(merged[i]) for i in sorted(merged)]

    # Prefix KV: what a system prompt snapshot holds.
    def compute_prefix(self, token_ids: Sequence[int]) -> KVArray:
        """The KV of `token_ids` at positions `0..`: `[2 * layers, kv_heads, len(token_ids), head_dim]`."""
        if not 0 < len(token_ids) < self.max_context:
            raise InvalidRequestError(
                f"a prefix must hold 1 to {self.max_context - 1} tokens, got {len(token_ids)}", param="prefix"
            )
        ids = list(token_ids)

        def compute() -> KVArray:
            self._use_prefill_graph(wait=True)  # a pinned prefix must be what a prompt's prefill computes
            return self._runner.compute_prefix(ids, self.config.prefill_chunk)

        return self._on_engine_thread(compute)

    @property
    def prefill_graph(self) -> str:
        """What prompts run through: `decode graph`, `prefill graph`, or `loading` (the decode graph, for now)."""
        if self._startup.prefill_loading:
            return "loading"
        return "prefill graph" if self._decoder.has_prefill_graph or self._one_graph else "decode graph"

    def wait_for_prefill_graph(self) -> None:
        """Block until a deferred prefill graph is in use (or has failed to load); at once without one."""
        self._on_engine_thread(lambda: self._use_prefill_graph(wait=True))

    @property
    def warm(self) -> bool:
        """The start-up work done in the background (prefill graph, huge pages) is over."""
        return self._startup.done

    def wait_until_warm(self) -> CollapseReport | None:
        """Block until the start-up work done in the background is over: the prefill graph, then huge pages."""
        self.wait_for_prefill_graph()
        huge_pages = self._startup.huge_pages
        return huge_pages.result() if huge_pages is not None else None

    def pin_prefix(self, token_ids: Sequence[int], kv: KVArray) -> None:
        """Keep `kv` for every prompt that starts with `token_ids` (never evicted); checks its layout first."""
        facts = self._facts
        expected = (2 * facts.num_layers, facts.num_kv_heads, len(token_ids), facts.head_dim)
        if kv.shape != expected or kv.dtype != np.dtype(facts.kv_dtype):
            raise ValueError(
                f"prefix KV is {kv.dtype}{list(kv.shape)}; this model needs {facts.kv_dtype}{list(expected)}"
            )
        if not 0 < len(token_ids) < self.max_context:
            raise ValueError(f"a pinned prefix must hold 1 to {self.max_context - 1} tokens, got {len(token_ids)}")
        ids = tuple(token_ids)
        self._on_engine_thread(lambda: self._prefix_cache.pin(ids, kv))

    def warm_prefixes(self, prefixes: Sequence[Sequence[int]]) -> int:
        """Compute the KV of the longest of `prefixes` once and pin each (all of its tokens, not only whole
        blocks); every one must start the longest. Returns how many tokens were computed."""
        longest = max(prefixes, key=len)
        if any(tuple(p) != tuple(longest[: len(p)]) for p in prefixes):
            raise ValueError("prefixes to warm together must each start the longest of them")
        kv = self.compute_prefix(longest)
        for prefix in prefixes:
            self.pin_prefix(prefix, kv[:, :, : len(prefix)])
        return len(longest)

    def _on_engine_thread(self, work: Callable[[], T]) -> T:
        """Run `work` between steps on the engine thread (the KV pool's owner), or here if it is not started."""
        done: Future[T] = Future()
        with self._wakeup:
            running = self._thread is not None
            if running:
                self._jobs.append(lambda: _settle(done, work, self._stopping))
                self._wakeup.notify()
        return done.result() if running else work()

    def stats(self) -> EngineStats:
        scheduler = self._scheduler
        computed = sum(s.num_computed for g in list(scheduler.running) for s in g.sequences if s.slot >= 0)
        return EngineStats(
            queued=len(scheduler.waiting),
            running=len(scheduler.running),
            kv_used_bytes=computed * self._pool.bytes_per_token,
            kv_capacity_bytes=self._pool.capacity_bytes,
            prefix_cache_bytes=self._prefix_cache.used_bytes,
            prefix_hits=self._prefix_cache.hits,
            tokens_in=self._tokens_in,
            tokens_out=self._tokens_out,
            steps=self._steps,
            last_batch_size=self._last_batch,
            draft_tokens=self._drafter.stats.drafted if self._drafter is not None else 0,
            accepted_draft_tokens=self._drafter.stats.accepted if self._drafter is not None else 0,
        )

    # The step loop.
    def step(self) -> StepReport:
        """Run one scheduling step on the caller's thread (tests; the loop does this once started)."""
        if self._thread is not None:
            raise RuntimeError("the engine's step loop is running; step() is for an engine that was not started")
        self._use_prefill_graph(wait=False)
        return self._step()

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not (self._stopping or self._scheduler.has_work() or self._jobs or self._startup.prefill_built):
                    self._idleness.enter()
                    self._wakeup.wait()
                self._idleness.leave()
                if self._stopping:
                    return
                jobs, self._jobs = self._jobs, []
            for job in jobs:
                job()
            self._use_prefill_graph(wait=False)
            if not self._scheduler.has_work():
                continue
            try:
                self._step()
            except Exception as exc:
                self._fail_all(exc)

    def _use_prefill_graph(self, wait: bool) -> None:
        """Switch prompts to the deferred prefill graph once it is built (with `wait`: once it is built).

        Not while a prompt is half-prefilled: its KV would mix both graphs. From the switch on, prompt KV
        is prefix-cached again (computed by the graph every later prompt uses), decoded KV still is not.
        """
        if not wait and self._scheduler.mid_prefill():
            return
        build = self._startup.take_prefill(wait)
        if build is None:
            return
        try:
            session = build.result()
        except Exception as exc:  # the engine serves on without it: prompts keep using the decode graph
            log.warning("the prefill graph failed to load (%s); prompts run through the decode graph", exc)
        else:
            self._decoder.attach_prefill(session)
            log.info("prefill graph in use (built in %.2f s)", build.duration)
        self._startup.prefill_switched()
        self._set_kv_reuse()

    def _set_kv_reuse(self) -> None:
        """What the prefix cache may keep follows from the graphs in use: a cache hit must equal a miss.

        Prompt KV only once prompts run through the graph every later prompt uses (not while a prefill
        graph is still loading); generated tokens' KV only when one graph computes prompts and tokens alike.
        """
        loading = self._startup.prefill_loading
        self._scheduler.cache_prompt_kv = not loading
        self._scheduler.cache_decoded_kv = not loading and not self._decoder.has_prefill_graph

    def _step(self) -> StepReport:
        started = time.perf_counter()
        work = self._scheduler.schedule()
        for group in work.aborted:
            for seq in group.sequences:
                self._push(group, seq.output.aborted(), started, close=seq is group.sequences[-1])
        output = self._runner.execute(work)
        now = time.perf_counter()
        booked = self._scheduler.update_from_output(output)
        first_tokens: list[float] = []
        finished: list[RequestTiming] = []
        for token in booked:
            group = token.seq.group
            if group.first_token_at is None:
                group.first_token_at = now
                first_tokens.append(now - group.submitted_at)
            if token.completes_request:
                finished.append(request_timing(group, now))
            self._push(group, token.output, now, close=token.completes_request)
        prefill_tokens = sum(c.stop - c.start for c in work.prefills)
        self._tokens_in += prefill_tokens
        self._tokens_out += len(booked)
        self._steps += 1
        self._last_batch = len(work.decode)
        report = StepReport(
            duration=time.perf_counter() - started,
            batch_size=len(work.decode),
            prefill_tokens=prefill_tokens,
            decode_tokens=len(work.decode),
            first_tokens=tuple(first_tokens),
            finished=tuple(finished),
            queued=len(self._scheduler.waiting),
            kv_used_bytes=sum(s.num_computed for s in work.decode) * self._pool.bytes_per_token,
        )
        if self._on_step is not None:
            self._on_step(report)
        self._stream_wakeups.flush()
        return report

    def _push(self, group: RequestState, output: SequenceOutput, now: float, close: bool) -> None:
        """Hand `output` to the request's stream; `close`: it is the request's last, so the stream ends."""
        stream = self._streams.get(group.request.request_id)
        if stream is None:
            return
        stream.push(output, now)
        if close:
            with self._wakeup:
                self._streams.pop(group.request.request_id, None)
            stream.close()

    def _fail_all(self, exc: Exception) -> None:
        """A step crashed: end every request with the error and start from a clean slate."""
        self._scheduler.reset()
        with self._wakeup:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.push(EngineError(f"the engine failed while running this request: {exc!r}"), time.perf_counter())
            stream.close()
        self._stream_wakeups.flush()

    def _sequence(self, group: RequestState, index: int, grammar: CompiledGrammar | None) -> SequenceState:
        request = group.request
        params = request.sampling
        output = OutputProcessor(
            self.tokenizer, params, self._facts.eos_token_ids, request.request_id, index,
            len(request.prompt_token_ids), self.max_context,
        )  # fmt: skip
        constraint: GrammarConstraint | None
        if grammar is not None:
            constraint = grammar.constraint()
        else:
            constraint = self.grammars.constraint(params.grammar) if params.grammar is not None else None
        sampler = SequenceSampler(params, request.prompt_token_ids, index, constraint)
        return SequenceState(group, index, sampler, output)


def _settle(done: Future[T], work: Callable[[], T], stopping: bool) -> None:
    if stopping:
        done.set_exception(EngineError("the engine shut down before it ran this"))
        return
    try:
        done.set_result(work())
    except BaseException as exc:  # handed to the waiting caller, who re-raises it
        done.set_exception(exc)
