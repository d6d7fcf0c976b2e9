"""The bench's prompt source: distinct prompts of an exact length, however many rounds a run asks for."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, processors

from packager.bench.prompts import PREFIX_KEY, PromptFactory, PromptsUsedUp, source_text


def word_tokenizer() -> tokenizers.Tokenizer:
    """A word-level tokenizer over the prompt text's own words: every window round-trips."""
    _, text = source_text()
    pre = pre_tokenizers.Whitespace()
    words = sorted({word for word, _ in pre.pre_tokenize_str(text)})
    tokenizer = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    word_tokenizer().save(str(path))
    return path


def test_a_used_up_text_starts_over_with_windows_that_start_unlike_every_earlier_prompt(tokenizer_path: Path) -> None:
    factory = PromptFactory(tokenizer_path)
    text_ids = factory._ids[:200]  # six 32-token windows, then the text is used up
    factory._ids = text_ids
    prompts = [factory.take(32) for _ in range(40)]
    assert all(len(p.ids) == 32 for p in prompts)
    assert len({p.ids[:PREFIX_KEY] for p in prompts}) == 40
    for prompt in prompts:
        starts = [i for i in range(len(text_ids) - 31) if tuple(text_ids[i : i + 32]) == prompt.ids]
        assert starts, "every prompt is a window of the text"


def test_a_text_without_distinct_windows_left_says_to_ask_for_fewer_rounds(tokenizer_path: Path) -> None:
    factory = PromptFactory(tokenizer_path)
    factory._ids = factory._ids[:40]  # windows can start at 0..8 only
    taken = [factory.take(32) for _ in range(9)]
    assert len({p.ids for p in taken}) == 9
    with pytest.raises(PromptsUsedUp, match="no more distinct 32-token windows; ask for fewer rounds"):
        factory.take(32)


def test_a_tokenizer_that_adds_a_bos_gets_it_in_every_prompt_and_in_its_length(tmp_path: Path) -> None:
    """As a server encodes a text prompt (Gemma's <bos>), so in-process systems see the same ids."""
    tokenizer = word_tokenizer()
    tokenizer.add_special_tokens(["<bos>"])
    bos = tokenizer.token_to_id("<bos>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    seen: list[str] = []

    def server_tokenizer(text: str) -> list[int]:
        seen.append(text)
        return tokenizer.encode(text).ids

    prompts = PromptFactory(path, [server_tokenizer]).batch(3, 32)
    assert all(len(p.ids) == 32 and p.ids[0] == bos and bos not in p.ids[1:] for p in prompts)
    assert [list(p.ids) for p in prompts] == [tokenizer.encode(p.text).ids for p in prompts]
    assert seen[-1] == prompts[-1].text  # every window is checked against the other tokenizer too
