"""What every system adapter provides to the worker: load, run a batch of streams, report memory.

Times are `time.monotonic()` seconds: CLOCK_MONOTONIC is shared by all processes on Linux, so a cold
start can be measured from the parent's exec to the child's first token.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

now = time.monotonic
MAX_CONTEXT = 2048  # the demo function's max_context: long enough for every prompt + new tokens here


@dataclass(frozen=True)
class SystemConfig:
    system: str
    bundle: str
    gguf: str
    hf_dir: str
    threads: int
    max_batch: int
    python: str
    # Every system's context (KV cache) length; the models at size use less, so their KV pools stay small.
    max_context: int = MAX_CONTEXT


@dataclass
class StreamTiming:
    """One request's timeline, in seconds after it was submitted."""

    first: float
    last: float
    tokens: int
    token_ids: list[int] = field(default_factory=list)  # the first few, to check systems agree

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class PromptSpec:
    ids: list[int]
    text: str


class System(Protocol):
    """A system under test, loaded inside a worker process."""

    max_streams: int  # how many concurrent streams one `run` can serve

    def run(self, prompts: list[PromptSpec], max_tokens: int) -> list[StreamTiming]: ...

    def memory(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class InProcessSystem(System, Protocol):
    """A system that runs in the worker itself, so the worker can cold-start it phase by phase."""

    def first_token(self, text: str) -> dict[str, float]:
        """Tokenize `text` with the system's own tokenizer, then produce one token; monotonic marks of both."""
        ...


def process_memory(pid: int | str = "self") -> dict[str, float]:
    """Current and peak resident set of a process, in MiB (VmRSS, VmHWM)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return {"rss_mib": fields.get("VmRSS", 0.0), "peak_rss_mib": fields.get("VmHWM", 0.0)}


def timings_from_marks(start: float, marks: list[float], token_ids: list[int]) -> StreamTiming:
    return StreamTiming(first=marks[0] - start, last=marks[-1] - start, tokens=len(marks), token_ids=token_ids[:16])
