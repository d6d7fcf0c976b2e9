"""The workload: prompts of an exact token length, the same token ids for every system.

Prompts are windows of a long English text found on the machine (no network). Each window is chosen
so that decoding its ids to text and encoding that text again gives the same ids, with the bundle's
tokenizer and with any other tokenizer given (llama.cpp's pre-tokenizer splits some whitespace runs
differently): HTTP servers take text, in-process systems take ids, and all must see identical tokens.
A server encodes a text prompt with the special tokens its tokenizer adds (Gemma's `<bos>`; SmolLM2's
adds none), so every prompt starts with them and counts them in its length.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers

LICENSES = Path("/usr/share/common-licenses")
# Distinct texts (older versions of the same licence left out): ~35k tokens, enough for a full run
# without ever handing out the same window twice.
LICENSE_NAMES = ("Apache-2.0", "Artistic", "CC0-1.0", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1", "MPL-2.0")
FALLBACK = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "LICENSE.txt"
MAX_ATTEMPTS = 64  # windows tried per prompt; with collapsed whitespace nearly every window round-trips
PREFIX_KEY = 32  # prompts never share their first 32 tokens, so no prefix cache can serve one from another


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    text: str

    def to_json(self) -> dict[str, object]:
        return {"ids": list(self.ids), "text": self.text}


def source_text() -> tuple[str, str]:
    """The texts with every whitespace run collapsed to one space: tokenizers disagree about how to split
    runs of newlines and indentation, and agree on plain prose."""
    paths = [LICENSES / name for name in LICENSE_NAMES if (LICENSES / name).is_file()] or [FALLBACK]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"no prompt text found: {', '.join(map(str, missing))} do not exist")
    text = " ".join(" ".join(p.read_text(encoding="utf-8").split()) for p in paths)
    return ", ".join(p.name for p in paths), text


class PromptsUsedUp(ValueError):
    """The run asks for more distinct prompts than the prompt text holds."""


class PromptFactory:
    """Hands out distinct prompts of exactly `length` tokens, deterministically."""

    def __init__(self, tokenizer_path: Path, other_tokenizers: Sequence[Callable[[str], list[int]]] = ()) -> None:
        self._tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        self._added = added_prefix(self._tokenizer)
        self._others = tuple(other_tokenizers)
        self._prefixes: set[tuple[int, ...]] = set()
        self.source, text = source_text()
        self._ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        self._cursor = 0
        self._passes = 0  # times the text was used up and started over

    def take(self, length: int) -> Prompt:
        """The next prompt of `length` tokens (the tokenizer's added ones, then a window of the text) that
        round-trips and starts unlike every earlier prompt.

        Once the text is used up, windows start over one token further in: they overlap earlier prompts'
        text but never start like one, which is all a prefix cache could reuse.
        """
        window_length = length - len(self._added)
        for _ in range(MAX_ATTEMPTS):
            start = self._cursor
            while start + window_length > len(self._ids):
                self._passes += 1
                if self._passes >= min(window_length, len(self._ids) - window_length + 1):
                    raise PromptsUsedUp(
                        f"the prompt text ({len(self._ids)} tokens) has no more distinct {length}-token windows; "
                        "ask for fewer rounds"
                    )
                start = self._cursor = self._passes
            window = self._ids[start : start + window_length]
            self._cursor = start + 1
            if tuple(window[:PREFIX_KEY]) in self._prefixes:
                continue
            text = self._tokenizer.decode(window, skip_special_tokens=False)
            ids = self._added + window
            encodings = [self._tokenizer.encode(text).ids]
            encodings += [encode(text) for encode in self._others]
            if all(encoded == ids for encoded in encodings):
                self._cursor = start + window_length
                self._prefixes.add(tuple(window[:PREFIX_KEY]))
                return Prompt(ids=tuple(ids), text=text)
        raise ValueError(
            f"{MAX_ATTEMPTS} {length}-token windows of {self.source} in a row fail a decode/encode round trip"
        )

    def batch(self, count: int, length: int) -> list[Prompt]:
        return [self.take(length) for _ in range(count)]


def added_prefix(tokenizer: tokenizers.Tokenizer) -> list[int]:
    """The special tokens `tokenizer` puts before a text of its own (a `<bos>`); none for most chat models."""
    plain = tokenizer.encode("text", add_special_tokens=False).ids
    full = tokenizer.encode("text").ids
    if full[len(full) - len(plain) :] != plain:
        raise ValueError("the tokenizer adds special tokens after a text too; the bench cannot keep prompts' lengths")
    return full[: len(full) - len(plain)]
