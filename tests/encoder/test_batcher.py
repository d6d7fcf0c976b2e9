"""The encoder's batcher under a full queue: a 429 the client can retry, never a crash.

mypy found that the full-queue branch called `EngineOverloadedError` with a positional `retry_after`, a
TypeError that reached clients as a 500.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest

from runtime.api.errors import from_engine_error
from runtime.encoder.batcher import LengthBatcher
from runtime.engine.request import EngineOverloadedError


def test_a_full_queue_is_an_overload_with_a_retry_hint() -> None:
    release = threading.Event()

    def slow_embed(rows: Sequence[Sequence[int]]) -> np.ndarray:
        release.wait(10)
        return np.zeros((len(rows), 4), dtype=np.float32)

    batcher = LengthBatcher(slow_embed, max_rows=1, max_queue=2)
    try:
        first, second = batcher.submit([[1, 2]]), batcher.submit([[3]])
        with pytest.raises(EngineOverloadedError) as refused:
            batcher.submit([[4]])
        assert refused.value.retry_after == 1.0
        error = from_engine_error(refused.value)
        assert (error.status, error.headers) == (429, {"Retry-After": "1"})
        release.set()
        assert first.result(10).shape == (1, 4) and second.result(10).shape == (1, 4)
        assert batcher.submit([[5]]).result(10).shape == (1, 4)  # room again once the queue drained
    finally:
        release.set()
        batcher.close()
