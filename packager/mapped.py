"""Give back the pages of a memory-mapped file once they are read, so a mapping never counts as the file's size.

A page of a mapped file that was read stays in the process's resident set until the kernel needs it back, so
reading a 5 GB file through one mapping would show 5 GB of RSS however little of it is in use. After each
tensor, `release` tells the kernel (`MADV_DONTNEED`) that the mapping's pages are not needed: they leave this
process's resident set and stay in the page cache, where the next read finds them.
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Any

import numpy as np


def release(array: Any) -> None:
    """Drop `array`'s mapped pages (a `np.memmap`, or an array viewing one) from the resident set; else nothing."""
    base = array
    while isinstance(base, np.ndarray) and not isinstance(base, np.memmap) and base.base is not None:
        base = base.base
    mapping = getattr(base, "_mmap", None)
    if isinstance(mapping, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        # A closed mapping, or a kernel without madvise: nothing to give back.
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(mmap.MADV_DONTNEED)
