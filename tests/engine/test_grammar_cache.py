"""The grammar cache's budgets with real llguidance grammars on the demo tokenizer (engine/grammar_cache.py).

`(x{100}){450}` is a regex that compiles within llguidance's fuel and keeps ~18 MB of lexer once its
first mask is built: heavy enough for the heap measurement to see, quick (~40 ms) to compile.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest

from runtime.bundle import read_manifest
from runtime.engine import heap
from runtime.engine.constraints import lark_grammar, plain_message, regex_grammar
from runtime.engine.grammar_cache import GrammarBudget, GrammarError, Grammars
from runtime.engine.request import EngineOverloadedError

pytestmark = pytest.mark.real_model

MiB = 1 << 20


def settled(timeout_s: float = 60.0) -> None:
    """Wait for other engines' background work in this process (an earlier test's engine finishing its deferred
    prefill build or its huge-page move) to end: the compiled size is the heap's growth, which their frees would
    hide (a full-suite run saw a 34 MB grammar pass a 24 MiB limit while one ran)."""
    deadline = time.monotonic() + timeout_s
    busy = ("onnxfn-prefill-wait", "onnxfn-huge-pages", "onnxfn-engine-loader")
    while any(thread.name in busy for thread in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.1)
    gc.collect()


def grammars(bundle: Path, budget: GrammarBudget = GrammarBudget()) -> Grammars:  # noqa: B008 (frozen)
    settled()
    model = read_manifest(bundle).model
    service = Grammars(bundle / "tokenizer.json", model.vocab_size, model.eos_token_ids, budget)
    service.compile(regex_grammar("warm"))  # builds the llguidance tokenizer, outside every measurement below
    return service


def heavy(letter: str, repeats: int = 450) -> str:
    return regex_grammar(f"({letter}{{100}}){{{repeats}}}")


def test_the_cache_holds_its_byte_budget_evicting_the_least_recently_used(demo_bundle: Path) -> None:
    service = grammars(demo_bundle, GrammarBudget(cache_bytes=48 * MiB, grammar_bytes=32 * MiB))
    a = service.compile(heavy("a"))
    b_bytes = service.compile(heavy("b")).nbytes  # the cache alone holds `b`
    assert 12 * MiB < a.nbytes < 24 * MiB and 12 * MiB < b_bytes < 24 * MiB  # measured, not the floor
    assert service.cached(a.text) is a  # `a` is now the most recently used
    before = heap.allocated_bytes()
    c = service.compile(heavy("c"))
    after = heap.allocated_bytes()
    # `c` pushed the total past 48 MiB: `b`, least recently used, went; `a`, touched, stayed.
    assert service.cached(heavy("b")) is None and service.cached(a.text) is a and service.cached(c.text) is c
    assert service.cached_bytes == a.nbytes + c.nbytes <= 48 * MiB
    # What `b` held went back to the heap as `c` came in: the process grew by far less than `c`.
    assert before is not None and after is not None and after - before < c.nbytes / 2
    # The cache reuses what it holds: the same grammar again is the same compiled template.
    assert service.compile(heavy("a")) is a and len(service) == 3 - 1


def test_a_grammar_over_the_per_grammar_limit_is_refused_and_freed(demo_bundle: Path) -> None:
    service = grammars(demo_bundle, GrammarBudget(grammar_bytes=24 * MiB))
    before = heap.allocated_bytes()
    with pytest.raises(GrammarError, match=r"it takes \d+\.\d MiB compiled; this server allows 24 MiB per grammar"):
        service.compile(heavy("a", 850))  # ~41 MB, within llguidance's fuel: far over the limit
    after = heap.allocated_bytes()
    assert len(service) == 1 and before is not None and after is not None and after - before < 4 * MiB


def test_the_row_2_regexes_run_out_of_fuel_and_keep_nothing(demo_bundle: Path) -> None:
    # Issue 37 row 2: each of these kept ~170 MB in the cache (RSS 1.00 -> 2.18 GB for eight).
    service = grammars(demo_bundle)
    before = heap.allocated_bytes()
    for n in range(100, 104):
        with pytest.raises(GrammarError) as refused:
            service.compile(regex_grammar(f"((a{{100}}){{100}}){{{n}}}"))
        assert refused.value.problem == (
            "the grammar is too complex: building its lexer ran out of fuel "
            "(lexer error: too many expressions constructed)"
        )
    after = heap.allocated_bytes()
    assert len(service) == 1 and service.cached_bytes < MiB
    assert before is not None and after is not None and after - before < 8 * MiB


def test_a_compiler_panic_is_one_plain_line(demo_bundle: Path) -> None:
    # 65,530 alternatives overflow llguidance's 16-bit symbol table: a Rust panic whose text (with
    # `<backtrace>`) used to reach the client. Compiled here past the request size limit on purpose.
    text = "start: " + " | ".join(f"/w{i}/" for i in range(65_530))
    with pytest.raises(GrammarError) as refused:
        grammars(demo_bundle).compile(lark_grammar(text))
    assert refused.value.problem == "the grammar is too large or too complex to compile"
    assert plain_message("at 1(8): invalid regex\n<state>\nTokens: x") == "at 1(8): invalid regex"


def test_grammar_work_waits_its_turn_and_overload_is_refused(demo_bundle: Path) -> None:
    service = grammars(demo_bundle)
    release = threading.Event()
    first = service.submit(release.wait)  # holds the turn
    waiting = [service.submit(lambda: service.compile(regex_grammar("[0-9]+"))) for _ in range(7)]
    with pytest.raises(EngineOverloadedError, match="8 grammars are waiting"):
        service.submit(lambda: None)
    assert waiting[-1].cancel()  # not started: a caller that stops waiting takes it out of the line
    release.set()
    assert first.result(timeout=30) is True
    compiled = {future.result(timeout=30) for future in waiting[:-1]}
    assert len(compiled) == 1  # compiled once, found in the cache by the other six
    assert service.submit(lambda: 42).result(timeout=30) == 42
