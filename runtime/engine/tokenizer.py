"""Text in and out: encoding, the chat template, incremental detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from runtime.engine.request import InvalidRequestError

_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


class Tokenizer:
    def __init__(
        self,
        path: Path,
        chat_template: str | None,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = HFTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # Chat templates may reference these by name.
        self._special_tokens = {
            name: self._tok.id_to_token(token_id) or ""
            for name, token_id in (("bos_token", bos_token_id), ("eos_token", next(iter(eos_token_ids), None)))
            if token_id is not None
        }
        self._template = None
        if chat_template is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(chat_template)

    def encode(self, text: str) -> list[int]:
        # Special tokens written in the text (the chat template's markers) map to their ids.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt, with the special tokens the tokenizer itself adds (Gemma's `<bos>`).

        transformers and vLLM encode a completion prompt this way; a base model given none of them
        can degenerate (Gemma 3 repeats " The"). A chat template writes its own, so chats use `encode`.
        """
        return self._tok.encode(text).ids

    @property
    def hf(self) -> HFTokenizer:
        """The `tokenizers` tokenizer underneath."""
        return self._tok

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_text(self, token_id: int) -> str:
        """The text of one token as OpenAI's logprobs show it (special tokens included)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True) -> str:
        """Render `messages` (a list of `{"role", "content"}`) with the model's chat template."""
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; use the completions API", param="messages")
        rendered_messages = [_checked_message(i, m) for i, m in enumerate(_checked_list(messages))]
        try:
            return self._template.render(
                messages=rendered_messages, add_generation_prompt=add_generation_prompt, **self._special_tokens
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc


def _checked_list(messages: Any) -> list[Any]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty list of messages", param="messages")
    return messages


def _checked_message(index: int, message: Any) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'", param=where)
    role = message.get("role")
    if role not in _ROLES:
        raise InvalidRequestError(f"{where}.role is {role!r}; allowed: {sorted(_ROLES)}", param=f"{where}.role")
    return {"role": role, "content": _content_text(message.get("content"), f"{where}.content")}


def _content_text(content: Any, where: str) -> str:
    """A message's text: a string, or OpenAI's list of `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidRequestError(
                    f"{where}[{i}] must be a text part {{'type': 'text', 'text': ...}}; this model reads text only",
                    param=where,
                )
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(f"{where} must be a string or a list of text parts, got {content!r}", param=where)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    `tokenizers`' `DecodeStream` does the work in one native call per token (the prefix/read-offset
    technique of vLLM and TGI). It returns nothing while the text ends in an unfinished character;
    those tokens are kept here so the end of a sequence can flush them.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._held: list[int] = []

    def push(self, token_id: int) -> str:
        text = self._stream.step(self._tokenizer.hf, token_id)
        if text is None:
            self._held.append(token_id)
            return ""
        self._held.clear()
        return text

    def flush(self) -> str:
        """The text still held back at the end of the sequence (an unfinished character decodes as U+FFFD)."""
        held, self._held = self._held, []
        return self._tokenizer.decode(held) if held else ""


class StopStringFilter:
    """Passes text through until a stop string appears; never emits the stop string itself.

    Text that could be the beginning of a stop string is held back until the next delta shows
    whether it is.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if not self._stops:
            return text
        pending = self._held + text
        first = min((i for i in (pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if first >= 0:
            self._held = ""
            self.stopped = True
            return pending[:first]
        hold = self._partial_stop_length(pending)
        self._held = pending[len(pending) - hold :] if hold else ""
        return pending[: len(pending) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
