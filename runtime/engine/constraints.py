"""Constrained decoding with llguidance: grammars for a request, and token masks for a decode batch.

A request asks for structure with `SamplingParams.grammar`, an llguidance grammar (the JSON the
`*_grammar` builders below return: JSON schema, regex or Lark). Each of its sequences gets a
`GrammarConstraint` (a copy of the grammar compiled once, engine/grammar_cache.py) when it is
submitted; every step, `mask_logits` has llguidance fill the allowed-token bitmasks of all constrained
rows in one parallel call, sets every other token of those rows to -inf before sampling, and `advance`
feeds each row its chosen token. Rows without a grammar are never touched.

llguidance is imported on first use (it costs ~140 ms), and the llguidance tokenizer (~0.2-0.8 s,
~28 MB) is built on the first constrained request, so servers that never see one pay nothing.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher, LLParserLimits
    from llguidance._lib import JsonCompileOptions  # the stubs define it; the package does not export it
    from numpy.typing import NDArray

# Compact JSON, one space after separators: the form small models were trained on, and no whitespace
# runs for a model to loop in (with flexible whitespace, SmolLM2-135M pads objects with newlines).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance builds a grammar's lexer at its first token mask and spends this much fuel on it at most. At
# llguidance's default (1,000,000) the regex `((a{100}){100}){100}` took 0.7 s and kept 172 MB before failing
# anyway; at 200,000 it fails in 85 ms having allocated 38 MB. The heaviest real grammars measured (a
# 150-property schema, a 2,000-value enum, 50,000-character strings, dates, emails) spend a small part of it.
INITIAL_LEXER_FUEL = 200_000
_OUT_OF_FUEL = "too many expressions constructed"
_DUMPS = ("<state>", "<non-verbose/>", "<backtrace>")  # what llguidance appends to an error's own text
_MAX_MESSAGE = 500


def json_schema_grammar(schema: dict[str, Any], *, strict: bool = True) -> str:
    """A grammar for JSON documents valid against `schema`.

    `strict` (OpenAI's flag) rejects keywords llguidance cannot enforce; without it they are ignored.
    """
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, overrides={**JSON_OPTIONS, "lenient": not strict})


def json_object_grammar() -> str:
    """OpenAI's `json_object` mode: any JSON object."""
    return json_schema_grammar({"type": "object"}, strict=False)


def regex_grammar(pattern: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(pattern)


def lark_grammar(text: str) -> str:
    """A grammar in llguidance's Lark dialect (which embeds JSON schemas with `%json {...}`) or llama.cpp's GBNF.

    Raises ValueError when GBNF text cannot be converted; other problems show in `grammar_problem`.
    """
    from llguidance import grammar_from

    return grammar_from("grammar", text)


def choice_grammar(choices: Sequence[str]) -> str:
    """Exactly one of `choices`."""
    from llguidance import grammar_from

    return grammar_from("choice", json.dumps(list(choices)))


def grammar_problem(grammar: str) -> str | None:
    """Why `grammar` cannot be used (llguidance's message, one plain line), or None when it is valid."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, limits=parser_limits())
    return plain_message(messages[0]) if is_error else None


def parser_limits() -> LLParserLimits:
    """llguidance's limits for every grammar this server checks or compiles (see `INITIAL_LEXER_FUEL`)."""
    from llguidance import LLParserLimits

    # Error messages without the parser state and grammar dump that verbose errors append.
    return LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL, verbose_errors=False)


def plain_message(error: str) -> str:
    """llguidance's error as text a client can read: never a Rust panic, a backtrace or a parser state dump.

    A panic is an internal assertion (an 85,000-alternative grammar overflows a 16-bit symbol table), so
    it becomes a plain "too large"; other errors keep their text (a regex error points at the column)
    up to the first dump llguidance appends.
    """
    text = error.strip()
    if not text or text.startswith("panic") or "<backtrace>" in text:
        return "the grammar is too large or too complex to compile"
    for marker in _DUMPS:
        text = text.split(marker, 1)[0]
    text = text.rstrip()
    if _OUT_OF_FUEL in text:
        return f"the grammar is too complex: building its lexer ran out of fuel ({text})"
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "…"


class GrammarConstraint:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher


def mask_logits(logits: NDArray[np.float32], constrained: Sequence[tuple[int, GrammarConstraint]]) -> None:
    """Set every token a row's grammar forbids to -inf, for all `(row, constraint)` pairs in one parallel call.

    A matcher in an error state allows only end-of-sequence, so such a row ends instead of failing the batch.
    """
    from llguidance.numpy import fill_next_token_bitmask_par

    vocab = logits.shape[1]
    bitmask = np.empty((len(constrained), (vocab + 31) // 32), dtype=np.int32)
    fill_next_token_bitmask_par(_executor(), [(c.matcher, i) for i, (_, c) in enumerate(constrained)], bitmask)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
    for (row, _), row_allowed in zip(constrained, allowed, strict=True):
        np.putmask(logits[row], row_allowed == 0, -np.inf)


def advance(constrained: Sequence[tuple[int, GrammarConstraint]], chosen: NDArray[np.intp]) -> None:
    """Feed each row's constraint the token sampled for it (always one its mask allowed)."""
    if len(constrained) == 1:
        row, constraint = constrained[0]
        constraint.matcher.consume_token(int(chosen[row]))
        return
    _executor().consume_token_par([(c.matcher, int(chosen[row])) for row, c in constrained])


@functools.cache
def _executor() -> LLExecutor:
    from llguidance import LLExecutor

    # Masks are filled between forward passes, while ONNX Runtime's threads are idle: use every core.
    return LLExecutor(num_threads=os.cpu_count() or 1)
