"""Moving the graphs' weights onto huge pages (Linux), off the start-up path.

Decoding one token at batch 1 streams every weight from memory, so with 4 KiB pages it walks about
45,000 page translations per token. ONNX Runtime allocates the prepacked weights with malloc on its
pool threads, and with transparent huge pages in `madvise` mode (the default of Debian, Ubuntu and
Amazon Linux) that memory stays on 4 KiB pages. `MADV_COLLAPSE` (Linux 6.1+) asks the kernel to copy
a range onto 2 MiB pages in place, whatever the THP mode short of `never`.

Measured (int8 demo, 2 threads): on an AVX2 host, a plain decode step 16.8 -> 14.8 ms and the engine's
batch-1 decode 58.6 -> 65.7 tok/s. On an AVX-512 VNNI host, where the prefill graph's fp32 matmuls run
fast enough for page walks to show, a 32-token prompt's time to first token 55 -> 44 ms and a 128-token
one's 166 -> 156 ms once that graph's weights moved too. So what the sessions' builds added is moved
(~600 MB for the demo's two graphs, ~1 s of one background thread), in chunks moved preferably while the
engine is idle (moving pages stalls page faults).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MADV_COLLAPSE = 25  # include/uapi/asm-generic/mman-common.h, the same on every Linux architecture
# Only ranges this full of touched pages are moved: collapsing commits the untouched ones too (a KV pool
# allocated by then is mostly untouched, and would otherwise grow the resident memory by its size).
MIN_DENSITY = 0.9
# Moved at a time: the kernel holds the process's memory-map lock while it copies, so other threads'
# page faults wait; 8 MiB is ~10 ms of copying.
CHUNK = 8 << 20

Interval = tuple[int, int]  # [start, end) of an address range


def writable_anonymous(maps: str) -> list[Interval]:
    """The private, writable, anonymous mappings (heap included) of a `/proc/PID/maps` text."""
    intervals = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3] != "p" or fields[4] != "0":
            continue
        name = fields[5].strip() if len(fields) == 6 else ""
        if name in ("", "[heap]"):
            start, end = fields[0].split("-")
            intervals.append((int(start, 16), int(end, 16)))
    return intervals


def subtract(after: Sequence[Interval], before: Sequence[Interval]) -> list[Interval]:
    """The parts of `after` not covered by `before` (both lists sorted and non-overlapping, as maps are)."""
    added = []
    for start, end in after:
        for b_start, b_end in before:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                added.append((start, b_start))
            start = max(start, b_end)
            if start >= end:
                break
        if start < end:
            added.append((start, end))
    return added


def merged(intervals: Sequence[Interval]) -> list[Interval]:
    """`intervals` sorted, with overlapping or touching ones joined (what `subtract` and `collapse` take)."""
    joined: list[Interval] = []
    for start, end in sorted(intervals):
        if joined and start <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(end, joined[-1][1]))
        else:
            joined.append((start, end))
    return joined


def memory_map() -> list[Interval]:
    """This process's writable anonymous memory now (empty where there is no `/proc`)."""
    try:
        return writable_anonymous(Path("/proc/self/maps").read_text())
    except OSError:
        return []


def dense_huge_pages(
    added: Sequence[Interval], page: int, pagemap: Path = Path("/proc/self/pagemap")
) -> list[Interval]:
    """The whole huge pages inside `added` whose small pages are mostly touched, merged into ranges.

    `/proc/self/pagemap` holds one 64-bit entry per small page; bit 63 says it is present.
    """
    small = os.sysconf("SC_PAGE_SIZE")
    per_page = page // small
    ranges: list[Interval] = []
    with pagemap.open("rb", buffering=0) as entries:
        for start, end in added:
            for low in range(-(-start // page) * page, end // page * page, page):
                entries.seek(low // small * 8)
                present = np.frombuffer(entries.read(per_page * 8), dtype=np.uint64) >> np.uint64(63)
                if present.sum() < MIN_DENSITY * per_page:
                    continue
                if ranges and ranges[-1][1] == low:
                    ranges[-1] = (ranges[-1][0], low + page)
                else:
                    ranges.append((low, low + page))
    return ranges


@dataclass(frozen=True)
class CollapseReport:
    collapsed_bytes: int
    failed_bytes: int  # ranges the kernel could not move now (no free huge page, pages in flux)
    seconds: float
    unsupported: str = ""  # why nothing was tried: not Linux, kernel before 6.1, THP `never`

    def describe(self) -> str:
        if self.unsupported:
            return f"graph weights stay on 4 KiB pages: {self.unsupported}"
        failed = f", {self.failed_bytes >> 20} MiB could not be moved" if self.failed_bytes else ""
        return f"graph weights on huge pages: {self.collapsed_bytes >> 20} MiB in {self.seconds:.2f} s{failed}"


def huge_page_size() -> int:
    try:
        return int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


def collapse(added: Sequence[Interval], before_each: Callable[[], object] = lambda: None) -> CollapseReport:
    """Move the dense parts of `added` onto huge pages; never raises for what the kernel refuses.

    `before_each` runs before every `CHUNK` moved, and may block: the engine waits there for an idle loop.
    """
    started = time.perf_counter()
    if not sys.platform.startswith("linux"):
        return CollapseReport(0, 0, 0.0, f"MADV_COLLAPSE is Linux-only (this is {sys.platform})")
    page = huge_page_size()
    try:
        ranges = dense_huge_pages(added, page)
    except OSError as exc:  # a sandbox without /proc/self/pagemap
        return CollapseReport(0, 0, time.perf_counter() - started, f"reading the page map: {exc}")
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    collapsed = failed = 0
    step = max(CHUNK, page)
    chunks = [(start, min(start + step, high)) for low, high in ranges for start in range(low, high, step)]
    for low, high in chunks:
        before_each()
        if madvise(low, high - low, MADV_COLLAPSE) == 0:
            collapsed += high - low
            continue
        code = ctypes.get_errno()
        if code == errno.EINVAL and not collapsed:  # the kernel has no MADV_COLLAPSE, or THP is `never`
            return CollapseReport(0, 0, time.perf_counter() - started, f"madvise(MADV_COLLAPSE): {os.strerror(code)}")
        failed += high - low
    return CollapseReport(collapsed, failed, time.perf_counter() - started)
