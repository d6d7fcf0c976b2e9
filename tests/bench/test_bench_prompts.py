"""The bench's prompt source: distinct prompts of an exact length, however many rounds a run asks for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from benchlib.prompts import PREFIX_KEY, PromptFactory, PromptsUsedUp, source_text


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer over the prompt text's own words: every window round-trips."""
    _, text = source_text()
    pre = pre_tokenizers.Whitespace()
    words = sorted({word for word, _ in pre.pre_tokenize_str(text)})
    tokenizer = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
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
