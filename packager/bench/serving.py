"""OpenAI-compatible servers under test: launch one, wait until it serves, stream completions from it."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx

from packager.bench.systems.base import StreamTiming, now

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ServerSpec:
    """How to start a server and how to ask it for a completion."""

    command: list[str]
    ready_path: str
    extra_body: dict[str, object]
    env: dict[str, str]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(spec: ServerSpec, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """Start the server with its output in `log_path` (a pipe nobody drains would stall a chatty server)."""
    command = [part.replace("{port}", str(port)) for part in spec.command]
    with log_path.open("ab") as log:
        return subprocess.Popen(
            command, env={**os.environ, **spec.env}, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )


def _die_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the launching process dies, so no server outlives
    a killed bench (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_ready(
    process: subprocess.Popen[bytes],
    base_url: str,
    path: str,
    log_path: Path,
    timeout: float = 120.0,
    interval: float = 0.01,
) -> float:
    """Poll until the server answers `path` with 200 (every `interval` s); returns the monotonic time it did."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"server exited with {process.returncode} before it was ready:\n{tail}")
            try:
                if client.get(path).status_code == 200:
                    return now()
            except httpx.TransportError:
                pass
            time.sleep(interval)
    raise TimeoutError(f"server at {base_url} was not ready after {timeout} s")


async def stream_completion(
    session: aiohttp.ClientSession, base_url: str, prompt: str, max_tokens: int, extra_body: dict[str, object]
) -> tuple[float, list[tuple[float, bytes]]]:
    """One streamed completion: when it was sent, and its events, each stamped with the time it arrived."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **extra_body,
    }
    start = now()
    frames: list[tuple[float, bytes]] = []
    pending = b""
    async with session.post(f"{base_url}/v1/completions", json=body) as response:
        if response.status != 200:
            detail = (await response.read()).decode(errors="replace")
            raise RuntimeError(f"completion failed with HTTP {response.status}: {detail[:500]}")
        async for data in response.content.iter_any():
            arrived = now()
            # SSE lines may end in CRLF (sse-starlette, llama.cpp's server) or LF (onnxfn).
            *events, pending = (pending + data).replace(b"\r\n", b"\n").split(b"\n\n")
            frames.extend((arrived, event) for event in events)
    return start, frames


def stream_timing(start: float, frames: list[tuple[float, bytes]]) -> StreamTiming:
    """The timeline of one stream from its server-sent events, each with the time it arrived."""
    marks: list[float] = []
    usage_tokens = None
    lines = ((arrived, line) for arrived, event in frames for line in event.split(b"\n"))
    payloads = ((arrived, line[5:].strip()) for arrived, line in lines if line.startswith(b"data:"))
    for arrived, payload in payloads:
        if payload == b"[DONE]":
            break
        chunk = json.loads(payload)
        if any(carries_token(choice) for choice in chunk.get("choices") or ()):
            marks.append(arrived)
        if chunk.get("usage"):
            usage_tokens = chunk["usage"].get("completion_tokens")
    if not marks:
        raise RuntimeError("the stream carried no tokens")
    return StreamTiming(first=marks[0] - start, last=marks[-1] - start, tokens=usage_tokens or len(marks))


def carries_token(choice: dict[str, object]) -> bool:
    """A streamed choice holds a token unless it is the closing chunk (finish_reason set, no text).
    A token that ends inside a UTF-8 character arrives as an empty text without a finish_reason."""
    return bool(choice.get("text")) or choice.get("finish_reason") is None


async def run_streams(
    base_url: str, prompts: list[str], max_tokens: int, extra_body: dict[str, object]
) -> list[StreamTiming]:
    """All `prompts` streamed at once, each on its own connection; events are parsed once all have ended.

    The client shares the server's cores, so the less it does while the server works the less it skews the
    figure: aiohttp (as vLLM's serving benchmark uses) with its C parser, and no JSON until the end, cost a
    third of the client CPU that httpx parsing as it went did (measured here at 8 streams: 0.07 s against
    0.22 s per round).
    """
    connector = aiohttp.TCPConnector(limit=len(prompts) + 4)
    timeout = aiohttp.ClientTimeout(total=600.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        streams = (stream_completion(session, base_url, p, max_tokens, extra_body) for p in prompts)
        records = await asyncio.gather(*streams)
    return [stream_timing(start, frames) for start, frames in records]
