"""What a build's quality is measured on: fixed chat prompts with fixed answers, and a held-out plain text.

Every system (PyTorch, the fp32 export, each candidate) is teacher-forced on the same token sequences, so a
comparison is one forward per sequence and needs no free-running decode: a model can then be run a layer at a
time over all sequences (verify/segments.py), in memory bounded by a layer instead of the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from packager.errors import UserError

_DATA = files("packager") / "data"


@dataclass(frozen=True)
class Sequences:
    """Token ids of each prompt + its answer (`answers[i]`: where the answer starts), then the held-out text."""

    prompts: tuple[tuple[int, ...], ...]  # prompt + answer
    answers: tuple[int, ...]  # index of each answer's first token
    heldout: tuple[int, ...]

    @property
    def all(self) -> list[tuple[int, ...]]:
        return [*self.prompts, self.heldout]

    def scored(self, index: int) -> slice:
        """The logit positions of sequence `index` that predict its answer (every next token for the held-out)."""
        if index == len(self.prompts):
            return slice(0, len(self.heldout) - 1)
        return slice(self.answers[index] - 1, len(self.prompts[index]) - 1)

    def targets(self, index: int) -> list[int]:
        sequence = self.all[index]
        window = self.scored(index)
        return list(sequence[window.start + 1 : window.stop + 1])


def load_prompts() -> list[list[dict[str, str]]]:
    """The fixed chat prompts, each a list of `{"role", "content"}` messages."""
    return [prompt["messages"] for prompt in _prompt_data()]  # type: ignore[misc]


def load_answers() -> list[str]:
    return [str(prompt["answer"]) for prompt in _prompt_data()]


def _prompt_data() -> list[dict[str, object]]:
    return json.loads((_DATA / "quality_prompts.json").read_text())["prompts"]  # type: ignore[no-any-return]


def heldout_text() -> str:
    return (_DATA / "heldout.txt").read_text()


def render_chat(chat_template: str, messages: list[dict[str, str]]) -> str:
    """Render a Hugging Face chat template the way `apply_chat_template` does, in a sandbox."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.globals["raise_exception"] = _raise_template_error
    return environment.from_string(chat_template).render(messages=messages, add_generation_prompt=True)


def prompt_token_ids(tokenizer: Tokenizer, chat_template: str | None) -> list[list[int]]:
    """Token ids of every fixed prompt; without a chat template, the messages' contents as plain text.

    Plain text is encoded the way the completions API encodes it: with the tokenizer's own special tokens
    (Gemma's `<bos>`; a base model without it degenerates). A chat template writes them itself.
    """
    texts = [
        render_chat(chat_template, messages) if chat_template else "\n".join(m["content"] for m in messages)
        for messages in load_prompts()
    ]
    return [tokenizer.encode(text, add_special_tokens=chat_template is None).ids for text in texts]


def quality_sequences(tokenizer: Tokenizer, chat_template: str | None, context_length: int) -> Sequences:
    prompts = prompt_token_ids(tokenizer, chat_template)
    separator = "" if chat_template else "\n"
    answers = [tokenizer.encode(separator + a, add_special_tokens=False).ids for a in load_answers()]
    heldout = tokenizer.encode(heldout_text(), add_special_tokens=False).ids[:context_length]
    return Sequences(
        prompts=tuple(tuple(p + a)[:context_length] for p, a in zip(prompts, answers, strict=True)),
        answers=tuple(len(p) for p in prompts),
        heldout=tuple(heldout),
    )


def _raise_template_error(message: str) -> None:
    raise UserError(f"the chat template refused the quality prompts: {message}")
