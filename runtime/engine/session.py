"""The decoder's ONNX Runtime session, driven through IO binding over caller-owned buffers.

The KV cache is never copied in or out: each cache tensor is bound as both `past` and `present`
(GroupQueryAttention writes the new positions into the same buffer), and logits land in a
preallocated array. A binding per row range of the KV pool is built once and reused, so a step only
rebinds the two small integer inputs and the logits view.

Prompts may run through a second session, the bundle's prefill graph (graphs.py). Both sessions bind the
same KV buffers, so a prompt prefilled by one is decoded by the other without a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import onnxruntime as ort

from runtime.bundle import DecoderIO
from runtime.engine.adapter_slots import AdapterSlots
from runtime.engine.graphs import ROW_LAST_POSITIONS

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from runtime.engine.kv_cache import KVArray


class _Addresses(NamedTuple):
    """Where `DecoderSession`'s staging buffers live: they never move, so a binding can point at them."""

    logits: int
    ids: int
    ones: int  # the mask of a prompt or a verify: a prefix of ones
    staged: int  # the masks of several decoding rows
    row: int  # the mask of one decoding row, as wide as the KV buffer


class DecoderSession:
    """Runs forward passes of the decoder over row ranges of a KV pool.

    `cache` holds the pool tensors in graph order (every layer's key, then every layer's value),
    each shaped `[slots, kv_heads, max_context, head_dim]`. Inputs are staged in preallocated
    buffers whose addresses are bound directly, so a step allocates nothing but small index arrays.
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        io: DecoderIO,
        num_layers: int,
        cache: Sequence[KVArray],
        vocab_size: int,
        max_rows: int,
        max_chunk: int,
        prefill_session: ort.InferenceSession | None = None,
        max_width: int = 1,
        adapters: AdapterSlots | None = None,
    ) -> None:
        """`prefill_session`: the graph prompts run through (default `session`), with the same inputs and outputs.

        `max_width`: the most positions one `verify` computes (1 without speculative decoding).
        `adapters`: the LoRA slots of a graph that takes adapters: a binding holds the first slots of each stack (as
        many as its rows use: `AdapterSlots.bound_slots`) and the binding's rows of `adapters.rows` as the per-row
        adapter index (the runner writes it before each step).
        """
        self._session = session
        self._adapters = adapters
        self._io = io
        self.attach_prefill(prefill_session or session)
        self._cache = list(cache)
        self._cache_names = io.cache_names(num_layers)
        self._bindings: dict[tuple[int, int, int, int], tuple[ort.IOBinding, dict[str, tuple[int, ...]]]] = {}
        max_context = self._cache[0].shape[2]
        self._vocab_size = vocab_size
        # Decode writes `[rows, 1, V]`, verify `[1, width, V]`, prefill `[1, chunk, V]`: one buffer covers all.
        positions = max(max_rows, max_width, max_chunk)
        self._logits = np.empty(positions * vocab_size, dtype=np.float32)
        self._ids = np.zeros(max(positions, max_rows * max_chunk), dtype=np.int64)
        # A prompt or a verify attends to every position up to its length: its mask is a prefix of `_ones`,
        # nothing to stage. Several decoding rows of different lengths get theirs staged in `_mask`. One
        # decoding row has `_row_mask`, as wide as the KV buffer (see `decode`).
        self._ones = np.ones(max_context + 1, dtype=np.int64)
        self._mask = np.zeros(max_rows * (max_context + 1), dtype=np.int64)
        self._row_mask = np.zeros(max_context, dtype=np.int64)
        self._row_length = 0  # the ones at the start of `_row_mask`
        self._pads_row_mask = session.get_providers()[0] == "CPUExecutionProvider"
        self._positions = np.arange(max_context + 1, dtype=np.int64)
        self._addresses = _Addresses(
            self._logits.ctypes.data,
            self._ids.ctypes.data,
            self._ones.ctypes.data,
            self._mask.ctypes.data,
            self._row_mask.ctypes.data,
        )

    def attach_prefill(self, session: ort.InferenceSession) -> None:
        """Run prompts through `session` from now on (a prefill graph whose build finished after start-up)."""
        self._prefill_session = session
        self._prefill_rows = _logits_rows(session, self._io.logits)
        key, value = ROW_LAST_POSITIONS
        self.prefills_prompts_together = (
            self._prefill_rows == 1 and session.get_modelmeta().custom_metadata_map.get(key) == value
        )

    def warm_up(self) -> None:
        """One token through each graph in pool row 0 (free at start-up; later prompts overwrite it).

        The first bound run of a graph sets up what every later one reuses: measured +85 ms on the first
        prompt, spent here rather than in a request's time to first token.
        """
        self.decode(1, np.zeros(1, np.int64), np.ones(1, np.int64))
        if self.has_prefill_graph:
            self.prefill(0, [0], 0)

    @property
    def has_prefill_graph(self) -> bool:
        return self._prefill_session is not self._session

    def prefill(self, slot: int, token_ids: Sequence[int], past: int) -> NDArray[np.float32]:
        """Compute `token_ids` at positions `past..` of `slot`; returns logits `[rows, vocab]`.

        The rows are the last ones of the chunk: all of them from a graph that computes every position,
        only the last from a prefill graph.
        """
        count = len(token_ids)
        self._ids[:count] = token_ids
        rows = self._prefill_rows or count
        mask = (1, past + count, self._addresses.ones)
        logits = self._run(self._prefill_session, slot, slot + 1, (1, count), mask, rows)
        return logits.reshape(rows, self._vocab_size)

    def prefill_prompts(self, first_slot: int, prompts: Sequence[Sequence[int]]) -> NDArray[np.float32]:
        """The first chunks of several prompts, in pool rows `first_slot..`, right-padded into one run.

        Returns each row's logits at its own last position, `[rows, vocab]`. Needs `prefills_prompts_together`.
        A row's KV and logits are those it gets alone (one GEMM over more rows); the padding positions
        write KV past the row's length, which its mask hides until later tokens overwrite it.
        """
        rows, width = len(prompts), max(len(p) for p in prompts)
        ids = self._ids[: rows * width].reshape(rows, width)
        ids[:] = 0
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = prompt
        self._stage_mask(np.array([len(p) for p in prompts], dtype=np.int64), width)
        mask = (rows, width, self._addresses.staged)
        logits = self._run(self._prefill_session, first_slot, first_slot + rows, (rows, width), mask, 1)
        return logits.reshape(rows, self._vocab_size)

    def decode(self, rows: int, token_ids: NDArray[np.int64], lengths: NDArray[np.int64]) -> NDArray[np.float32]:
        """One token per pool row `0..rows-1`; row i attends to its first `lengths[i]` positions.

        The mask is right-padded to the longest row, each row holding ones up to its own length. On the CPU
        a lone row's mask is padded the same way, to the whole KV buffer: the attention reads each row's
        length from its ones and never looks past it, so the logits are bit for bit those of a mask as wide
        as the row (tests/engine/test_session.py), and a shape that never changes stays bound from step to
        step (rebinding the mask cost ~37 us a step, right after a forward pass flushed the caches). Other
        providers' attention kernels may size their work by the mask's width, so there the mask is the row's.
        Returns logits `[rows, vocab]`.
        """
        addresses = self._addresses
        self._ids[:rows] = token_ids
        if rows > 1:
            width = int(lengths.max())
            self._stage_mask(lengths, width)
            mask = (rows, width, addresses.staged)
        elif self._pads_row_mask:
            self._extend_row_mask(int(lengths[0]))
            mask = (1, self._row_mask.size, addresses.row)
        else:
            mask = (1, int(lengths[0]), addresses.ones)
        return self._run(self._session, 0, rows, (rows, 1), mask, 1).reshape(rows, self._vocab_size)

    def _extend_row_mask(self, length: int) -> None:
        """`_row_mask` holds ones up to `length`: one more element as a row decodes, a rewrite after any other move."""
        if length == self._row_length + 1:
            self._row_mask[self._row_length] = 1
        elif length != self._row_length:
            self._row_mask[:length] = 1
            self._row_mask[length:] = 0
        self._row_length = length

    def _stage_mask(self, lengths: NDArray[np.int64], width: int) -> None:
        """The attention mask `[rows, width]`, right-padded: row i holds ones up to `lengths[i]`."""
        mask = self._mask[: len(lengths) * width].reshape(len(lengths), width)
        np.less(self._positions[:width], lengths[:, None], out=mask, casting="unsafe")

    def verify(self, token_ids: Sequence[int], past: int) -> NDArray[np.float32]:
        """The decode graph on `token_ids` at positions `past..` of pool row 0; returns logits `[len, vocab]`.

        Attention is causal among the new positions, so each one's logits are what a decode step would
        compute there, up to float rounding: ONNX Runtime's attention takes another kernel path for
        several new tokens than for one. Only row 0 of a one-row batch: the CPU GroupQueryAttention
        rejects several new tokens per row with past context in a larger batch.
        """
        count = len(token_ids)
        self._ids[:count] = token_ids
        mask = (1, past + count, self._addresses.ones)
        return self._run(self._session, 0, 1, (1, count), mask, count).reshape(count, self._vocab_size)

    def _run(
        self,
        session: ort.InferenceSession,
        start: int,
        stop: int,
        ids_shape: tuple[int, int],
        mask: tuple[int, int, int],
        positions: int,
    ) -> NDArray[np.float32]:
        """Run `session` on pool rows `start:stop`; logits come back for the last `positions` of each row.

        `mask`: the attention mask's rows, width and the address of the buffer holding it.
        """
        addresses = self._addresses
        io = self._io
        slots = self._adapters.bound_slots(start, stop) if self._adapters is not None else 0
        binding, bound = self._binding(session, start, stop, slots)
        # The buffers never move, so an input whose shape (and, for the mask, buffer) is unchanged stays
        # bound: each bind call costs ~15-40 us right after a forward pass flushed the caches.
        if bound.get(io.input_ids) != ids_shape:
            binding.bind_input(io.input_ids, "cpu", 0, np.int64, ids_shape, addresses.ids)
            bound[io.input_ids] = ids_shape
        if bound.get(io.attention_mask) != mask:
            rows, width, address = mask
            binding.bind_input(io.attention_mask, "cpu", 0, np.int64, (rows, width), address)
            bound[io.attention_mask] = mask
        logits_shape = (ids_shape[0], positions, self._vocab_size)
        if bound.get(io.logits) != logits_shape:
            binding.bind_output(io.logits, "cpu", 0, np.float32, logits_shape, addresses.logits)
            bound[io.logits] = logits_shape
        session.run_with_iobinding(binding)
        return self._logits[: ids_shape[0] * positions * self._vocab_size]

    def _binding(
        self, session: ort.InferenceSession, start: int, stop: int, slots: int
    ) -> tuple[ort.IOBinding, dict[str, tuple[int, ...]]]:
        """The binding over pool rows `start:stop` (and the first `slots` adapter slots), with the shape each of its
        inputs and outputs is bound at."""
        key = (0 if session is self._session else 1, start, stop, slots)
        entry = self._bindings.get(key)
        if entry is None:
            binding = session.io_binding()
            for (past, present), tensor in zip(self._cache_names, self._cache, strict=True):
                view = ort.OrtValue.ortvalue_from_numpy(tensor[start:stop])
                binding.bind_ortvalue_input(past, view)
                binding.bind_ortvalue_output(present, view)
            if self._adapters is not None:
                for name, view in self._adapters.views(slots).items():
                    binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(view))
                rows = ort.OrtValue.ortvalue_from_numpy(self._adapters.rows[start:stop])
                binding.bind_ortvalue_input(self._adapters.index_input, rows)
            entry = self._bindings[key] = (binding, {})
        return entry


def _logits_rows(session: ort.InferenceSession, logits_name: str) -> int | None:
    """How many positions the graph returns logits for: a fixed count declared in its output shape, or None (all)."""
    (logits,) = [o for o in session.get_outputs() if o.name == logits_name]
    positions = logits.shape[1] if len(logits.shape) == 3 else None
    return positions if isinstance(positions, int) else None
