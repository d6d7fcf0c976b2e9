"""The slot pool's compaction and the prefix cache's matching and eviction, on a tiny synthetic model."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.bundle import DecoderIO, ModelFacts
from runtime.engine.kv_cache import KVPool, PrefixCache, block_keys, context_for_budget

IO = DecoderIO("input_ids", "attention_mask", "pk.%d", "pv.%d", "logits", "ok.%d", "ov.%d")
FACTS = ModelFacts(
    task="chat", architecture="llama", precision="fp32", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
    hidden_size=16, vocab_size=100, context_length=64, kv_dtype="float32", bos_token_id=None, eos_token_ids=(0,),
    pad_token_id=None, chat_template=None, io=IO,
)  # fmt: skip
TOKEN_BYTES = FACTS.kv_bytes_per_token()  # 2 tensors * 2 layers * 2 heads * 4 dims * 4 bytes = 128


def fill(pool: KVPool, slot: int, length: int, value: float) -> None:
    for i, tensor in enumerate(pool.tensors):
        tensor[slot, :, :length] = value + i


def test_context_is_clamped_by_the_kv_budget() -> None:
    assert TOKEN_BYTES == 128
    assert context_for_budget(FACTS, slots=4, kv_memory_bytes=4 * 128 * 10, requested=None) == 10
    assert context_for_budget(FACTS, slots=4, kv_memory_bytes=1 << 30, requested=None) == 64
    assert context_for_budget(FACTS, slots=4, kv_memory_bytes=1 << 30, requested=32) == 32
    with pytest.raises(ValueError, match="cannot hold one token"):
        context_for_budget(FACTS, slots=4, kv_memory_bytes=100, requested=None)


def test_release_moves_the_last_slot_into_the_hole() -> None:
    pool = KVPool(FACTS, slots=3, max_context=8)
    slots = [pool.acquire() for _ in range(3)]
    assert slots == [0, 1, 2] and pool.free == 0
    for slot in slots:
        fill(pool, slot, 5, value=10.0 * slot)
    assert pool.release(0, last_length=5) == 2
    assert pool.active == 2
    for i, tensor in enumerate(pool.tensors):
        np.testing.assert_array_equal(tensor[0, :, :5], 20.0 + i)  # slot 2's data now lives in slot 0
        np.testing.assert_array_equal(tensor[1, :, :5], 10.0 + i)
    assert pool.release(1, last_length=5) is None  # the last slot leaves no hole
    assert pool.acquire() == 1


def test_block_keys_chain_the_whole_prefix() -> None:
    a = block_keys([1, 2, 3, 4, 5, 6, 7], block_size=3)
    b = block_keys([9, 2, 3, 4, 5, 6], block_size=3)
    assert len(a) == 2 and len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different history
    assert block_keys([1, 2, 3, 4, 5, 6], 3) == a


def test_prefix_cache_round_trip_and_match_leaves_a_token_to_compute() -> None:
    pool = KVPool(FACTS, slots=2, max_context=16)
    cache = PrefixCache(block_size=4, capacity_bytes=1 << 20)
    src = pool.acquire()
    dst = pool.acquire()
    for tensor in pool.tensors:
        tensor[src] = np.random.default_rng(0).normal(size=tensor[src].shape)
    tokens = list(range(10, 22))  # 12 tokens: 3 blocks
    cache.store(tokens, pool, src)
    assert len(cache) == 3 and cache.used_bytes == 12 * TOKEN_BYTES
    blocks = cache.match(tokens)  # all 12 are cached but one must stay to produce logits
    assert len(blocks) == 2 and cache.hits == 1
    assert cache.load(blocks, pool, dst) == 8
    for tensor in pool.tensors:
        np.testing.assert_array_equal(tensor[dst, :, :8], tensor[src, :, :8])
    assert len(cache.match([*tokens, 99])) == 3
    assert cache.match([10, 11, 12, 99, 14]) == []  # first block differs in its last token
    assert cache.hits == 2


def test_prefix_cache_evicts_least_recently_used_children_first() -> None:
    pool = KVPool(FACTS, slots=1, max_context=16)
    slot = pool.acquire()
    cache = PrefixCache(block_size=2, capacity_bytes=4 * 2 * TOKEN_BYTES)  # room for 4 blocks
    cache.store([1, 2, 3, 4, 5, 6], pool, slot)  # chain A: 3 blocks
    cache.store([7, 8], pool, slot)  # chain B: 1 block, full now
    cache.match([1, 2, 3, 4, 5, 6, 0])  # refresh A
    cache.store([9, 9], pool, slot)  # evicts B, the least recently used
    assert len(cache.match([7, 8, 0])) == 0
    assert len(cache.match([1, 2, 3, 4, 5, 6, 0])) == 3
    cache.store([5, 5, 6, 6], pool, slot)  # needs two blocks: evicts C, then A's deepest block, not its root
    assert len(cache.match([1, 2, 3, 4, 5, 6, 0])) == 2
    assert cache.used_bytes <= cache.capacity_bytes


def test_a_chain_longer_than_the_budget_keeps_its_head() -> None:
    pool = KVPool(FACTS, slots=1, max_context=16)
    slot = pool.acquire()
    cache = PrefixCache(block_size=2, capacity_bytes=2 * 2 * TOKEN_BYTES)
    cache.store(list(range(1, 9)), pool, slot)
    assert len(cache.match([*range(1, 9), 0])) == 2
