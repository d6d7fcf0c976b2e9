"""Constrained decoding with llguidance: grammars for a request, and token masks for a decode batch.

A request asks for structure with `SamplingParams.grammar`, an llguidance grammar (the JSON the
`*_grammar` builders below return: JSON schema, regex or Lark). Each of its sequences gets a
`GrammarConstraint` (an `LLMatcher`) when it is submitted; every step, `mask_logits` has llguidance
fill the allowed-token bitmasks of all constrained rows in one parallel call, sets every other token
of those rows to -inf before sampling, and `advance` feeds each row its chosen token. Rows without a
grammar are never touched.

llguidance is imported on first use (it costs ~140 ms), and the llguidance tokenizer (~0.2-0.8 s,
~28 MB) is built on the first constrained request, so servers that never see one pay nothing.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.engine.request import InvalidRequestError

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer

# Compact JSON, one space after separators: the form small models were trained on, and no whitespace
# runs for a model to loop in (with flexible whitespace, SmolLM2-135M pads objects with newlines).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TEMPLATE_CACHE = 64  # compiled grammars kept per engine; a matcher for a cached one is a cheap deep copy


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
    """Why `grammar` cannot be used (llguidance's message), or None when it is valid."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else None


class GrammarConstraint:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher


class Grammars:
    """An engine's grammar service: the llguidance tokenizer and a cache of compiled grammars."""

    def __init__(self, tokenizer_path: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_path = tokenizer_path
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None
        self._templates: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # submitting threads share the tokenizer build and the cache

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh constraint for one sequence; an unusable grammar is a 400 naming `grammar`."""
        with self._lock:
            template = self._templates.get(grammar)
            if template is None:
                template = self._compile(grammar)
                self._templates[grammar] = template
                if len(self._templates) > _TEMPLATE_CACHE:
                    self._templates.popitem(last=False)
            else:
                self._templates.move_to_end(grammar)
            return GrammarConstraint(template.deep_copy())

    def _compile(self, grammar: str) -> LLMatcher:
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the grammar cannot be used: {matcher.get_error()}", param="grammar")
        return matcher

    def _llg_tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            # eos_token must be given: llguidance would otherwise guess id 0, which is not this model's end.
            text = self._tokenizer_path.read_text(encoding="utf-8")
            self._tokenizer = LLTokenizer(text, n_vocab=self._vocab_size, eos_token=self._eos)
        return self._tokenizer


def mask_logits(logits: np.ndarray, constrained: Sequence[tuple[int, GrammarConstraint]]) -> None:
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


def advance(constrained: Sequence[tuple[int, GrammarConstraint]], chosen: np.ndarray) -> None:
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
