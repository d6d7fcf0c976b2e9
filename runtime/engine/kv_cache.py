"""KV memory: the slot pool every sequence decodes in, and the prefix cache of reusable KV blocks.

The pool holds, per cache tensor, `[slots, kv_heads, max_context, head_dim]`. Occupied slots are
always `0 .. active-1`: releasing a slot moves the last occupied slot into the hole, so a decode
step binds the single contiguous view `pool[:active]`. Pool memory is mapped by the OS as it is first
written, 4 KiB at a time (`lazy_zeros`): resident memory grows with the tokens actually written.
"""

from __future__ import annotations

import hashlib
import mmap
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from runtime.bundle import ModelFacts

if TYPE_CHECKING:  # numpy.typing costs the server's start-up an import it never uses at run time
    from numpy.typing import NDArray

    # A pool tensor `[slots, kv_heads, max_context, head_dim]`, or blocks of positions `[tensors, kv_heads, length,
    # head_dim]`; float32 or float16, as the model's `kv_dtype` says.
    KVArray: TypeAlias = NDArray[np.floating[Any]]


def context_for_budget(facts: ModelFacts, slots: int, kv_memory_bytes: int, requested: int | None) -> int:
    """The longest context every slot can hold inside the KV budget (and the model's own limit)."""
    wanted = min(requested or facts.context_length, facts.context_length)
    fits = kv_memory_bytes // (slots * facts.kv_bytes_per_token())
    if fits < 1:
        raise ValueError(
            f"kv_memory_bytes={kv_memory_bytes} cannot hold one token per slot for {slots} slots "
            f"({facts.kv_bytes_per_token()} bytes per token)"
        )
    return min(wanted, fits)


def context_reason(facts: ModelFacts, slots: int, kv_memory_bytes: int, requested: int | None) -> str:
    """What sets `context_for_budget`'s answer, in the settings' own words (function.toml and the flags)."""
    context = context_for_budget(facts, slots, kv_memory_bytes, requested)
    wanted = min(requested or facts.context_length, facts.context_length)
    if context < wanted:
        needed_mb = -(-slots * facts.kv_bytes_per_token() * wanted // (1 << 20))
        return (
            f"the context is {context} tokens: [runtime] kv_memory_mb (--kv-memory-mb, {kv_memory_bytes >> 20}) holds "
            f"no more for each of the {slots} slots ([runtime] max_batch); {needed_mb} would hold {wanted}"
        )
    if requested is not None and requested < facts.context_length:
        return f"the context is {context} tokens: [export] max_context (--max-context)"
    return f"the context is {context} tokens, the model's own"


def lazy_zeros(shape: tuple[int, ...], dtype: np.dtype[np.floating[Any]]) -> KVArray:
    """Zeros whose memory the OS maps 4 KiB at a time, as it is first written.

    NumPy asks for transparent huge pages on large arrays (`MADV_HUGEPAGE`), so the first token written
    into a slot's rows made 2 MiB resident: the demo's server grew from 300 to 573 MB resident for 8 streams
    of ~100 tokens, and to 765 MB for 16. A private anonymous mapping advised `MADV_NOHUGEPAGE` grows by the
    tokens written.
    """
    count = int(np.prod(shape))
    buffer = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buffer, dtype=dtype, count=count).reshape(shape)


class KVPool:
    def __init__(self, facts: ModelFacts, slots: int, max_context: int) -> None:
        dtype = np.dtype(facts.kv_dtype)
        shape = (slots, facts.num_kv_heads, max_context, facts.head_dim)
        # Graph order: all keys, then all values.
        self.tensors: list[KVArray] = [lazy_zeros(shape, dtype) for _ in range(2 * facts.num_layers)]
        self.slots = slots
        self.max_context = max_context
        self.bytes_per_token = facts.kv_bytes_per_token()
        self.active = 0

    @property
    def free(self) -> int:
        return self.slots - self.active

    @property
    def capacity_bytes(self) -> int:
        return self.slots * self.max_context * self.bytes_per_token

    def acquire(self) -> int:
        if self.active == self.slots:
            raise RuntimeError("no free KV slot")
        self.active += 1
        return self.active - 1

    def release(self, slot: int, last_length: int) -> int | None:
        """Free `slot`; the last occupied slot (holding `last_length` tokens) moves into it.

        Returns the index the moved slot had, or None when `slot` was already the last one.
        """
        last = self.active - 1
        self.active = last
        if slot == last:
            return None
        self.copy(last, slot, last_length)
        return last

    def copy(self, src: int, dst: int, length: int) -> None:
        for tensor in self.tensors:
            tensor[dst, :, :length] = tensor[src, :, :length]

    def read(self, slot: int, start: int, stop: int) -> KVArray:
        """A copy of positions `start:stop` of `slot`: `[tensors, kv_heads, stop-start, head_dim]`."""
        return np.stack([t[slot, :, start:stop] for t in self.tensors])

    def write(self, slot: int, start: int, block: KVArray) -> None:
        stop = start + block.shape[2]
        for tensor, part in zip(self.tensors, block, strict=True):
            tensor[slot, :, start:stop] = part


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every one of `sequences` shares."""
    length = 0
    for column in zip(*sequences, strict=False):  # up to the shortest sequence
        if len(set(column)) != 1:
            break
        length += 1
    return length


def block_keys(token_ids: Sequence[int], block_size: int, namespace: bytes = b"") -> list[bytes]:
    """A hash chain over the full blocks of `token_ids`: each key covers its block and every earlier one.

    `namespace` starts the chain: KV computed with a LoRA adapter is keyed by the adapter's digest, so a
    prompt's blocks under one adapter never serve the same prompt under another, or the base (b"").
    """
    keys: list[bytes] = []
    parent = namespace
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = np.asarray(token_ids[start : start + block_size], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """KV of token-block prefixes, LRU under a byte budget, copied into a slot instead of recomputed.

    A block is reachable only through its parents (the chain of keys), so a lookup refreshes a
    chain from its deepest block up: parents stay more recent than their children and are evicted
    after them. Pinned prefixes (a system prompt, restored from the bundle's snapshot or warmed at
    start) have any length, not just whole blocks, and are never evicted: a 21-token system prompt
    is served from the cache even though it fills no 32-token block.
    """

    def __init__(self, block_size: int, capacity_bytes: int) -> None:
        self.block_size = block_size
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = 0
        self._blocks: OrderedDict[bytes, KVArray] = OrderedDict()
        self._pinned: dict[tuple[int, ...], KVArray] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def pinned_tokens(self) -> int:
        return sum(len(tokens) for tokens in self._pinned)

    def pin(self, token_ids: Sequence[int], kv: KVArray) -> None:
        """Keep `kv` (`[tensors, kv_heads, len(token_ids), head_dim]`) for prompts starting with `token_ids`."""
        if kv.ndim != 4 or kv.shape[2] != len(token_ids) or not token_ids:
            raise ValueError(f"a pinned prefix of {len(token_ids)} tokens needs KV [tensors, heads, tokens, dim]")
        key = tuple(token_ids)
        previous = self._pinned.pop(key, None)
        self.used_bytes += kv.nbytes - (previous.nbytes if previous is not None else 0)
        self._pinned[key] = kv

    def match(self, token_ids: Sequence[int], namespace: bytes = b"") -> list[KVArray]:
        """KV covering the longest cached prefix that leaves at least one token to compute.

        Either a chain of whole blocks or one pinned prefix, whichever is longer. Pinned prefixes are the
        base model's: a `namespace` (an adapter) only finds blocks computed under it.
        """
        limit = len(token_ids) - 1
        usable = limit // self.block_size * self.block_size
        found: list[tuple[bytes, KVArray]] = []
        for key in block_keys(token_ids[:usable], self.block_size, namespace):
            block = self._blocks.get(key)
            if block is None:
                break
            found.append((key, block))
        pinned = None if namespace else self._longest_pin(token_ids, limit)
        if pinned is not None and pinned.shape[2] > len(found) * self.block_size:
            self.hits += 1
            return [pinned]
        for key, _ in reversed(found):
            self._blocks.move_to_end(key)
        if found:
            self.hits += 1
        return [block for _, block in found]

    def _longest_pin(self, token_ids: Sequence[int], limit: int) -> KVArray | None:
        best: KVArray | None = None
        for tokens, kv in self._pinned.items():
            fits = len(tokens) <= limit and (best is None or len(tokens) > best.shape[2])
            if fits and tuple(token_ids[: len(tokens)]) == tokens:
                best = kv
        return best

    def load(self, blocks: list[KVArray], pool: KVPool, slot: int) -> int:
        """Copy `blocks` (in order, each `[tensors, heads, length, dim]`) into positions `0..` of `slot`.

        Returns the number of tokens loaded.
        """
        start = 0
        for block in blocks:
            pool.write(slot, start, block)
            start += block.shape[2]
        return start

    def store(self, token_ids: Sequence[int], pool: KVPool, slot: int, namespace: bytes = b"") -> None:
        """Remember the full blocks of `token_ids`, whose KV is at positions `0..` of `slot` (under `namespace`)."""
        chain = block_keys(token_ids, self.block_size, namespace)
        block_bytes = self.block_size * pool.bytes_per_token
        stored = 0
        for i, key in enumerate(chain):
            if key not in self._blocks:
                if not self._make_room(block_bytes, protected=set(chain[:i])):
                    break
                start = i * self.block_size
                self._blocks[key] = pool.read(slot, start, start + self.block_size)
                self.used_bytes += block_bytes
            stored = i + 1
        for key in reversed(chain[:stored]):
            self._blocks.move_to_end(key)

    def _make_room(self, needed: int, protected: set[bytes]) -> bool:
        """Evict least recently used blocks until `needed` bytes fit, never evicting `protected` ones."""
        while self.used_bytes + needed > self.capacity_bytes:
            if not self._blocks:
                return False
            oldest = next(iter(self._blocks))
            if oldest in protected:
                return False
            self.used_bytes -= self._blocks.pop(oldest).nbytes
        return True
