"""Resident LoRA adapters: slots of the stacked graph inputs the sessions bind (runtime/adapters/layout.py).

Slots are numbered from 1 (a row's `adapter_index`; 0 is the base model) and stored from position 0 of each
stack. A request's adapter is loaded into a slot when the scheduler admits it, and held there while the request
runs; an adapter no request holds stays resident for the next one until its slot is needed, least recently used
first. The lowest free slot is taken first, so a step binds few slots (`bound_slots`). Loading writes into the
bound buffers between steps (the engine thread both loads and runs), so no session is rebuilt and no step sees
half an adapter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from runtime.adapters.files import AdapterFile, pack
from runtime.adapters.layout import INDEX_INPUT, AdapterLayout

if TYPE_CHECKING:
    from numpy.typing import NDArray


@dataclass(frozen=True)
class RequestAdapter:
    """The adapter a request runs with, resolved (and read) when it was submitted."""

    name: str
    digest: str  # sha256:… of its file
    weights: AdapterFile

    @property
    def namespace(self) -> bytes:
        """What its prefix-cache entries are keyed under (kv_cache.block_keys)."""
        return self.digest.encode()


@dataclass(frozen=True)
class AdapterLoad:
    digest: str
    seconds: float
    nbytes: int


class AdapterSlots:
    def __init__(self, layout: AdapterLayout, capacity: int, pool_rows: int) -> None:
        if capacity < 1:
            raise ValueError(f"max_adapters must be at least 1 for a bundle with adapters, got {capacity}")
        self.layout = layout
        self.capacity = capacity
        # Slot j takes columns `(j - 1) * C .. j * C` of A `[in, slots * C]` and those rows of B `[slots * C, out]`
        # (C: the projection's columns). A run binds the first k slots: B's first rows are a contiguous view, A's
        # first columns are not, so A is kept at a few widths, `levels` (0, powers of two, all), and a run binds
        # the narrowest that holds its rows' slots: at most twice the columns it needs, 3x A's memory in all.
        self.levels = sorted({0, capacity, *(1 << i for i in range(capacity.bit_length()) if 1 << i <= capacity)})
        self.a_levels: dict[str, dict[int, NDArray[np.float32]]] = {}
        self.b_stacks: dict[str, NDArray[np.float32]] = {}
        self.columns: dict[str, int] = {}
        for layer in range(layout.num_layers):
            for projection in layout.projections:
                a, b = layout.input_names(layer, projection.name)
                columns = self.columns[a] = self.columns[b] = layout.columns(projection)
                self.a_levels[a] = {
                    level: np.zeros((projection.in_features, level * columns), np.float32) for level in self.levels
                }
                self.b_stacks[b] = np.zeros((capacity * columns, projection.out_features), np.float32)
        # The adapter slot of each KV pool row, bound as the graph's `adapter_index` (a view per row range).
        self.rows = np.zeros(pool_rows, np.int64)
        self._digests: list[str | None] = [None] * (capacity + 1)
        self._holders = [0] * (capacity + 1)
        self._used_at = [0.0] * (capacity + 1)
        self.loads: list[AdapterLoad] = []  # the most recent loads, for stats (bounded)

    @property
    def bytes_per_slot(self) -> int:
        """What one resident adapter's weights take in the stacks (A and B once; A's wider copies aside)."""
        return (
            sum(stack.nbytes for stack in self.b_stacks.values()) // self.capacity
            + sum(levels[self.capacity].nbytes for levels in self.a_levels.values()) // self.capacity
        )

    @property
    def index_input(self) -> str:
        return INDEX_INPUT

    def views(self, slots: int) -> dict[str, NDArray[np.float32]]:
        """Every input holding the first `slots` slots (one of `levels`)."""
        views = {name: levels[slots] for name, levels in self.a_levels.items()}
        return views | {name: stack[: slots * self.columns[name]] for name, stack in self.b_stacks.items()}

    def bound_slots(self, start: int, stop: int) -> int:
        """How many slots a run over pool rows `start:stop` binds: the narrowest level holding every slot its rows
        use; 0 for base rows alone (zero columns: the graph adds zeros and multiplies nothing)."""
        highest = int(self.rows[start:stop].max())
        return next(level for level in self.levels if level >= highest)

    def resident(self) -> dict[str, int]:
        return {d: s for s, d in enumerate(self._digests) if d is not None}

    def acquire(self, adapter: RequestAdapter) -> int | None:
        """The slot holding `adapter`, loading it into a free or idle slot first; None while every slot is held
        by running requests. The caller releases the slot when its request is done."""
        slot = next((s for s, d in enumerate(self._digests) if d == adapter.digest), None)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._load(slot, adapter.digest, adapter.weights)
        self._holders[slot] += 1
        self._used_at[slot] = time.monotonic()
        return slot

    def release(self, slot: int) -> None:
        if slot > 0:
            self._holders[slot] -= 1

    def forget(self, digest: str) -> None:
        """Drop a removed adapter: its slot is free for others once no request holds it."""
        for slot, held in enumerate(self._digests):
            if held == digest:
                self._digests[slot] = None if self._holders[slot] == 0 else f"removed:{digest}"

    def reset_holders(self) -> None:
        """Every request was dropped (a failed step): no slot is held any more."""
        self._holders = [0] * (self.capacity + 1)

    def _free_slot(self) -> int | None:
        idle = [s for s in range(1, self.capacity + 1) if self._holders[s] == 0]
        if not idle:
            return None
        empty = [s for s in idle if self._digests[s] is None]
        return empty[0] if empty else min(idle, key=lambda s: self._used_at[s])

    def _load(self, slot: int, digest: str, adapter: AdapterFile) -> None:
        started = time.perf_counter()
        self._digests[slot] = None  # until written in full
        packed = pack(adapter, self.layout)
        for a_name, (a, b) in packed.items():
            own = slice((slot - 1) * self.columns[a_name], slot * self.columns[a_name])
            for level, stack in self.a_levels[a_name].items():
                if level >= slot:
                    stack[:, own] = a
            self.b_stacks[a_name[: -len(".A")] + ".B"][own] = b
        self._digests[slot] = digest
        self.loads = [*self.loads[-15:], AdapterLoad(digest, time.perf_counter() - started, adapter.nbytes)]
