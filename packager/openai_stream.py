"""Reading an OpenAI endpoint's replies: the events of a streamed one (server-sent events), a choice's text and
an error's message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


def events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Each `data:` event's JSON, until `[DONE]`."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        yield json.loads(data)


def choice_text(choice: dict[str, Any]) -> str:
    """The text of one choice: a completion's `text`, a chat message's or a streamed delta's `content`."""
    if "text" in choice:
        return str(choice["text"] or "")
    return str((choice.get("message") or choice.get("delta") or {}).get("content") or "")


def error_message(response: httpx.Response) -> str:
    """The `error.message` of an OpenAI error body, else the start of whatever came back."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]
