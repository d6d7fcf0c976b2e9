"""Streaming clients for the load scripts: one request, read as the server frames it, checked on the way.

`stream_once` returns what happened (`Outcome`): completed (and well-formed or not), refused with 429,
disconnected on purpose after some chunks, or failed. A cancellation is the caller cancelling the task.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
import msgpack

MSGPACK = "application/msgpack"
PROMPTS = (
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "What is the capital of France? Answer in one sentence.",
    "Tell me a short story about a robot learning to paint.",
    "Explain what a hash function is to a child.",
)


@dataclass(frozen=True)
class Outcome:
    kind: str  # "completed", "rejected" (429), "disconnected", "error"
    detail: str = ""
    ttft: float | None = None  # seconds from sending to the first content chunk
    retry_after: str | None = None


def random_body(rng: random.Random, model: str, *, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """A chat or completion streaming request with a random prompt and length."""
    prompt = rng.choice(PROMPTS)
    common = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.7, "seed": rng.randrange(1000)}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**common, "prompt": prompt}


async def stream_once(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], *, msgpack_wire: bool, disconnect_after: int | None
) -> Outcome:
    """Send one streaming request; with `disconnect_after`, drop the connection after that many chunks."""
    headers = {"Content-Type": MSGPACK, "Accept": MSGPACK} if msgpack_wire else {}
    content = msgpack.packb(body) if msgpack_wire else json.dumps(body).encode()
    sent = time.perf_counter()
    async with client.stream("POST", path, content=content, headers=headers) as response:
        if response.status_code == 429:
            await response.aread()
            return Outcome("rejected", retry_after=response.headers.get("retry-after"))
        if response.status_code != 200:
            return Outcome("error", f"status {response.status_code}: {(await response.aread())[:300]!r}")
        chunks: list[dict[str, Any]] = []
        ttft: float | None = None
        reader = _msgpack_chunks(response) if msgpack_wire else _sse_chunks(response)
        async for chunk in reader:
            if isinstance(chunk, str):  # the SSE end marker
                problem = _final_problem(chunks)
                return Outcome("error", problem, ttft) if problem else Outcome("completed", ttft=ttft)
            if "error" in chunk:
                return Outcome("error", f"error frame: {chunk['error']}", ttft)
            if ttft is None and _has_text(chunk):
                ttft = time.perf_counter() - sent
            chunks.append(chunk)
            if disconnect_after is not None and len(chunks) >= disconnect_after:
                return Outcome("disconnected", ttft=ttft)
        if msgpack_wire:
            problem = _final_problem(chunks)
            return Outcome("error", problem, ttft) if problem else Outcome("completed", ttft=ttft)
        return Outcome("error", "the SSE stream ended without data: [DONE]", ttft)


async def _sse_chunks(response: httpx.Response) -> Any:
    buffer = b""
    async for data in response.aiter_bytes():
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if not event.startswith(b"data: ") or b"\n" in event:
                raise ValueError(f"malformed SSE event {event[:100]!r}")
            payload = event.removeprefix(b"data: ")
            yield "[DONE]" if payload == b"[DONE]" else json.loads(payload)
    if buffer:
        raise ValueError(f"the SSE stream ended inside an event: {buffer[:100]!r}")


async def _msgpack_chunks(response: httpx.Response) -> Any:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    async for data in response.aiter_bytes():
        unpacker.feed(data)
        for item in unpacker:
            yield item


def _has_text(chunk: dict[str, Any]) -> bool:
    return any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk.get("choices", []))


def _final_problem(chunks: list[dict[str, Any]]) -> str | None:
    if not chunks:
        return "the stream held no chunks"
    finishes = [c.get("finish_reason") for chunk in chunks for c in chunk.get("choices", [])]
    if not finishes or finishes[-1] not in ("stop", "length"):
        return f"the last choice chunk has finish_reason {finishes[-1] if finishes else None!r}"
    return None
