"""Incremental detokenization, stop strings and the chat template with the bundle's tokenizer."""

from __future__ import annotations

import pytest

from runtime.engine.request import InvalidRequestError
from runtime.engine.tokenizer import IncrementalDetokenizer, StopStringFilter, Tokenizer

TEXTS = [
    "Emoji: 🎉🚀 and a family 👨‍👩‍👧‍👦 done.",
    "中文测试：你好，世界！日本語もテストします。",  # noqa: RUF001 -- full-width punctuation on purpose
    "Mixed ünïcödé, Ελληνικά, русский, 한국어 and math ∀x∈ℝ.",  # noqa: RUF001
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    # Multi-byte characters span several byte-level tokens: some pushes must have held text back.
    assert deltas.count("") > 1


def test_flush_emits_an_unfinished_character_as_replacement(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush() == tokenizer.decode(ids[:-1])


def feed(stops: tuple[str, ...], pieces: list[str]) -> tuple[list[str], bool]:
    f = StopStringFilter(stops)
    out = []
    for piece in pieces:
        out.append(f.push(piece))
        if f.stopped:
            return out, True
    out.append(f.flush())
    return out, False


def test_stop_string_split_across_deltas_is_held_back_and_never_emitted() -> None:
    out, stopped = feed(("###",), ["Hello #", "#", "# world"])
    assert stopped
    assert out == ["Hello ", "", ""]


def test_text_that_only_looked_like_a_stop_string_is_released() -> None:
    out, stopped = feed(("STOP",), ["a ST", "OR", "e"])
    assert not stopped
    assert out == ["a ", "STOR", "e", ""]
    out, stopped = feed(("STOP",), ["end S"])
    assert out == ["end ", "S"]  # flushed at the end of the sequence


def test_earliest_of_several_stop_strings_wins() -> None:
    out, stopped = feed(("world", "lo w"), ["Hello world"])
    assert stopped and out == ["Hel"]


def test_stop_strings_with_real_tokens(tokenizer: Tokenizer) -> None:
    text = "The answer is 42.\nUser: next question"
    detok = IncrementalDetokenizer(tokenizer)
    f = StopStringFilter(("\nUser:",))
    emitted = ""
    for token in tokenizer.encode(text):
        emitted += f.push(detok.push(token))
        if f.stopped:
            break
    assert f.stopped
    assert emitted == "The answer is 42."


def test_chat_template_renders_chatml(tokenizer: Tokenizer) -> None:
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    )
    assert (
        rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(rendered)
    assert ids[0] == 1 and 2 in ids  # the markers are single special tokens


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "ok"}, "text"], "messages[1]"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
    ],
)
def test_bad_messages_raise_invalid_request(tokenizer: Tokenizer, messages: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        tokenizer.apply_chat_template(messages)
    assert excinfo.value.param == param


def test_template_errors_become_invalid_request(bundle_path: object) -> None:
    from pathlib import Path

    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    )
    tok = Tokenizer(Path(str(bundle_path)) / "tokenizer.json", template)
    with pytest.raises(InvalidRequestError, match="first message must be from the user") as excinfo:
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])
    assert excinfo.value.param == "messages"
    sandboxed = Tokenizer(Path(str(bundle_path)) / "tokenizer.json", "{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        sandboxed.apply_chat_template([{"role": "user", "content": "x"}])
