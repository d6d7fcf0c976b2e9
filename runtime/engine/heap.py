"""The C heap as glibc's allocator sees it: bytes in use, and handing freed pages back to the kernel.

Native libraries (llguidance's compiled grammars) allocate through malloc, out of Python's sight, so the
bytes a piece of native work keeps are measured as the change in malloc's in-use count around it
(`mallinfo2`, glibc 2.33+: every arena, small chunks and mmapped ones alike). That count is
process-wide, so a measurement includes whatever other threads allocated or freed meanwhile; callers
serialise their own measurements and treat the result as an estimate with a floor.

Elsewhere (musl, macOS) `allocated_bytes` is None and callers fall back on their floor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # glibc's malloc.h


class _MallInfo2(ctypes.Structure):  # glibc's `struct mallinfo2`, every field a size_t
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
        )
    ]  # fmt: skip


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):  # not glibc, or a glibc older than 2.33
        return None
    return libc


def allocated_bytes() -> int | None:
    """Bytes malloc has handed out and not had back (heap chunks plus mmapped blocks); None off glibc."""
    libc = _libc()
    if libc is None:
        return None
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def bound_heap(arenas: int = 2, mmap_threshold: int = 1 << 20) -> None:
    """Keep glibc's heap near what a process holds, for a process whose steps allocate and free gigabytes (a build):
    call it first thing, before any thread starts. A user's own `MALLOC_ARENA_MAX` / `MALLOC_MMAP_THRESHOLD_` wins.

    - Two malloc arenas, as `MALLOC_ARENA_MAX=2` would: glibc gives each thread that contends for the heap an arena
      of its own (up to 8 per core) and returns little of them. Arenas made before the cap stay.
    - Blocks from 1 MB up mapped and unmapped on their own: glibc raises its mmap threshold to 32 MB as large blocks
      are freed, after which PyTorch's activations (a few MB to 32 MB each) come from the arenas and stay resident
      in fragments when freed.

    PyTorch's reference pass on the 8B shape, alone in a process: default glibc, peak RSS 3.53 GB and 2.65 GB kept
    after it; two arenas, 3.00 GB and 2.11 GB (and a pass after other steps in `pkg build` peaked at 3.4-4.9 GB);
    both settings, 1.44 GB and 0.50 GB, in 183 s instead of 175 s.
    """
    libc = _libc()
    if libc is None:
        return
    if not os.environ.get("MALLOC_ARENA_MAX"):
        libc.mallopt(_M_ARENA_MAX, arenas)
    if not os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)


def release_free_memory() -> None:
    """Return free heap pages to the kernel, so memory a big structure held shows as free in RSS again.

    glibc gives back only the top of each arena on its own; pages freed in the middle stay resident
    until reused. Costs a walk of the free lists (milliseconds), so call it after large frees only.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
