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

_M_ARENA_MAX = -8  # glibc's malloc.h


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


def limit_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas for the rest of this process, as `MALLOC_ARENA_MAX` would; call it before any
    thread starts (arenas made earlier stay).

    glibc gives each thread that contends for the heap an arena of its own (up to 8 per core) and returns
    little of them to the system. PyTorch's layer-by-layer reference pass on the 8B shape, alone in a process:
    peak RSS 3.53 GB and 2.65 GB left resident after it with the default, 2.27 GB and 0.99 GB with two arenas;
    capped at the start of that pass instead of the process's, 3.35 GB. A user's own `MALLOC_ARENA_MAX` wins.
    """
    libc = _libc()
    if libc is not None and not os.environ.get("MALLOC_ARENA_MAX"):
        libc.mallopt(_M_ARENA_MAX, arenas)


def release_free_memory() -> None:
    """Return free heap pages to the kernel, so memory a big structure held shows as free in RSS again.

    glibc gives back only the top of each arena on its own; pages freed in the middle stay resident
    until reused. Costs a walk of the free lists (milliseconds), so call it after large frees only.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
