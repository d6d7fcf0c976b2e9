"""An engine's compiled grammars: each compile within llguidance's limits, the cache within a byte budget.

A grammar is compiled once into an `LLMatcher` template; each sequence that uses it gets a deep copy,
which shares the template's lexer (the part that holds the memory). What a grammar costs is mostly that
lexer, and llguidance builds it lazily, at the first token mask: `((a{100}){100}){100}`, 150 bytes of
request, compiles in 1 ms and then takes 0.7 s and 172 MB at its first mask. So a compile here also
computes one mask and takes one token on a throwaway copy: the expensive part happens off the engine
thread, a lexer that ran out of fuel is found now (llguidance reports it only at the next token), and
the bytes the grammar keeps are measured.

Measuring. llguidance reports no sizes, so an entry's bytes are the change in the C heap's in-use bytes
(glibc's `mallinfo2`, engine/heap.py) across its compile and first mask. Compiles run one at a time, so
no other compile shares the measurement; other threads (decoding) add noise of a few MB either way, and
each entry counts at least `_floor(grammar)`. The lexer can still grow while sequences decode
(new lexer states), within llguidance's per-token fuel and `max_lexer_states`; that growth is not
counted.

Budget (`GrammarBudget`): a grammar measuring more than `grammar_bytes` is refused (a 400) instead of
cached; the cache evicts least recently used grammars while it holds more than `cache_bytes` or
`entries`. An evicted grammar's memory is freed once the sequences using it end. Large frees hand
their pages back to the kernel (`heap.release_free_memory`), so RSS falls back too.

Threads. Every compile and check runs on a grammar thread of its own with a large stack, one at a time:
llguidance's compiler recurses once per rule reference, and a 116 KB JSON schema that chains 3,276
`$ref`s (or a Lark chain of 3,000 rules) overflows a default 8 MB stack, a segfault that ends the
server. The deepest chains 128 KiB of request can spell (8,884 Lark rules, 4,036 `$ref`s) need 16-32 MB;
256 MB leaves room for a larger request limit. The stack is address space until touched, and each
thread, its stack with it, ends with its compile, so what one deep grammar touched is not kept. The
server waits on `submit`'s future (never on the event loop's thread or the engine's step loop); at most
`_MAX_PENDING` jobs wait for their turn, more are refused as overload.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from runtime.engine import heap
from runtime.engine.constraints import GrammarConstraint, parser_limits, plain_message
from runtime.engine.request import EngineOverloadedError, InvalidRequestError

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

T = TypeVar("T")

_MAX_PENDING = 8  # compiles waiting for their turn; each takes well under a second within the limits
_TRIM_AFTER = 8 << 20  # freeing this much at once is worth a `malloc_trim`
_STACK_BYTES = 256 << 20
_STACK_SIZE = threading.Lock()  # `threading.stack_size` is process-wide: set it only around our own starts
_on_grammar_thread = threading.local()


@dataclass(frozen=True)
class GrammarBudget:
    cache_bytes: int = 128 << 20  # compiled grammars kept, in measured bytes
    grammar_bytes: int = 32 << 20  # one grammar above this is refused (real schemas and regexes measure < 1 MB)
    entries: int = 64
    compile_s: float = 5.0  # how long a request waits for its grammar to compile (the server's 400 beyond)


class GrammarError(InvalidRequestError):
    """A grammar llguidance cannot compile, or one over the budget; `problem` says why in one plain line."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"the grammar cannot be used: {problem}", param="grammar")
        self.problem = problem


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    text: str
    template: LLMatcher
    nbytes: int  # measured at compile: what keeping `template` costs

    def constraint(self) -> GrammarConstraint:
        """A fresh position in the grammar for one sequence (a deep copy: microseconds)."""
        return GrammarConstraint(self.template.deep_copy())


class Grammars:
    """An engine's grammar service: the llguidance tokenizer, the compile thread and the compiled grammars."""

    def __init__(
        self,
        tokenizer_path: Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        budget: GrammarBudget = GrammarBudget(),
    ) -> None:
        self.budget = budget
        self._tokenizer_path = tokenizer_path
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None
        self._entries: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the cache and the pending count
        self._turn = threading.Lock()  # one grammar job at a time: a compile's heap change is its own
        self._pending = 0

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def cached(self, grammar: str) -> CompiledGrammar | None:
        with self._lock:
            entry = self._entries.get(grammar)
            if entry is not None:
                self._entries.move_to_end(grammar)
            return entry

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh constraint for one sequence, compiling on a miss; an unusable grammar is a `GrammarError`."""
        return (self.cached(grammar) or self.compile(grammar)).constraint()

    def compile(self, grammar: str) -> CompiledGrammar:
        """`grammar` compiled and cached; blocks (up to ~0.3 s within the request limits) for a grammar thread."""
        entry = self.cached(grammar)
        if entry is not None:
            return entry
        if getattr(_on_grammar_thread, "yes", False):  # inside `submit`'s work: this thread holds the turn
            return self._compile(grammar)
        return self._run(lambda: self._compile(grammar)).result()

    def submit(self, work: Callable[[], T]) -> Future[T]:
        """Run grammar `work` (building, checking, `compile`) on a grammar thread; overload past `_MAX_PENDING`.

        The future can be cancelled until the work has its turn; then it runs to its end.
        """
        with self._lock:
            if self._pending >= _MAX_PENDING:
                raise EngineOverloadedError(
                    f"{self._pending} grammars are waiting to compile; retry shortly", retry_after=1.0
                )
            self._pending += 1
        try:
            return self._run(work, counted=True)
        except BaseException:
            self._finished()
            raise

    def _run(self, work: Callable[[], T], *, counted: bool = False) -> Future[T]:
        future: Future[T] = Future()

        def job() -> None:
            _on_grammar_thread.yes = True
            try:
                with self._turn:
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(work())
                        except BaseException as exc:  # handed to whoever waits on the future
                            future.set_exception(exc)
            finally:
                if counted:
                    self._finished()

        thread = threading.Thread(target=job, name="onnxfn-grammar", daemon=True)
        with _STACK_SIZE:
            previous = threading.stack_size(_STACK_BYTES)
            try:
                thread.start()
            finally:
                threading.stack_size(previous)
        return future

    def _finished(self) -> None:
        with self._lock:
            self._pending -= 1

    def _compile(self, grammar: str) -> CompiledGrammar:
        entry = self.cached(grammar)  # compiled while this job waited for its turn
        if entry is not None:
            return entry
        tokenizer = self._llg_tokenizer()  # shared by every grammar, so built outside the measurement
        before = heap.allocated_bytes()
        template, problem = _build(tokenizer, grammar)
        after = heap.allocated_bytes()
        measured = after - before if before is not None and after is not None else 0
        nbytes = max(measured, _floor(grammar))
        if problem is None and nbytes > self.budget.grammar_bytes:
            problem = (
                f"it takes {nbytes / 2**20:.1f} MiB compiled; "
                f"this server allows {self.budget.grammar_bytes / 2**20:.0f} MiB per grammar"
            )
        if problem is not None or template is None:
            del template
            if measured >= _TRIM_AFTER:
                heap.release_free_memory()
            raise GrammarError(problem or "llguidance could not compile it")
        entry = CompiledGrammar(grammar, template, nbytes)
        self._keep(entry)
        return entry

    def _keep(self, entry: CompiledGrammar) -> None:
        freed = 0
        with self._lock:
            self._entries[entry.text] = entry
            self._bytes += entry.nbytes
            while len(self._entries) > 1 and (
                self._bytes > self.budget.cache_bytes or len(self._entries) > self.budget.entries
            ):
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
                freed += old.nbytes
        if freed >= _TRIM_AFTER:
            heap.release_free_memory()  # what sequences still decoding with an evicted grammar hold stays

    def _llg_tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            # eos_token must be given: llguidance would otherwise guess id 0, which is not this model's end.
            text = self._tokenizer_path.read_text(encoding="utf-8")
            self._tokenizer = LLTokenizer(text, n_vocab=self._vocab_size, eos_token=self._eos)
        return self._tokenizer


def _build(tokenizer: LLTokenizer, grammar: str) -> tuple[LLMatcher | None, str | None]:
    """The template for `grammar` with its lexer built, and why it cannot be used (None when it can)."""
    from llguidance import LLMatcher

    try:
        template = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    except (ValueError, TypeError, RuntimeError) as exc:  # not llguidance's grammar JSON at all
        return None, plain_message(str(exc))
    if template.is_error():
        return template, plain_message(template.get_error())
    probe = template.deep_copy()
    mask = np.frombuffer(probe.compute_bitmask(), dtype=np.uint8)
    allowed = np.flatnonzero(mask)
    if allowed.size:  # a lexer that ran out of fuel while being built fails at the next token, not at the mask
        byte = int(allowed[0])
        probe.consume_token(byte * 8 + (int(mask[byte]) & -int(mask[byte])).bit_length() - 1)
    return template, plain_message(probe.get_error()) if probe.is_error() else None


def _floor(grammar: str) -> int:
    """The least an entry counts for, whatever the heap said: its text, and the ~16x of it a compile keeps."""
    return (64 << 10) + 16 * len(grammar)
