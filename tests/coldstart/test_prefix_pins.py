"""Pinned prefixes in the prefix cache: any length, preferred when longer than the cached blocks, never evicted."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.bundle import DecoderIO, ModelFacts
from runtime.engine.kv_cache import KVPool, PrefixCache

IO = DecoderIO("input_ids", "attention_mask", "pk.%d", "pv.%d", "logits", "prk.%d", "prv.%d")
FACTS = ModelFacts(
    task="chat", architecture="llama", precision="fp32", num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
    hidden_size=8, vocab_size=50, context_length=64, kv_dtype="float32", bos_token_id=None, eos_token_ids=(2,),
    pad_token_id=None, chat_template=None, io=IO,
)  # fmt: skip


def kv_for(tokens: list[int]) -> np.ndarray:
    """KV whose every value names its token, so a copy into the pool can be checked position by position."""
    values = np.asarray(tokens, np.float32)[None, None, :, None]
    return np.broadcast_to(values, (4, 1, len(tokens), 4)).copy()


def test_a_pin_shorter_than_a_block_is_matched_and_loaded() -> None:
    cache = PrefixCache(block_size=8, capacity_bytes=1 << 20)
    pool = KVPool(FACTS, slots=2, max_context=64)
    system = [5, 6, 7, 8, 9]
    cache.pin(system, kv_for(system))
    blocks = cache.match([*system, 11, 12])
    assert [b.shape[2] for b in blocks] == [5] and cache.hits == 1
    assert cache.load(blocks, pool, 1) == 5
    assert pool.tensors[0][1, 0, :6, 0].tolist() == [5, 6, 7, 8, 9, 0]
    assert cache.match(system) == []  # at least one token must be left to compute
    assert cache.match([5, 6, 7, 1, 9, 11]) == []  # differs inside the prefix


def test_the_longer_of_pin_and_block_chain_wins() -> None:
    cache = PrefixCache(block_size=4, capacity_bytes=1 << 20)
    pool = KVPool(FACTS, slots=1, max_context=64)
    tokens = list(range(10, 30))
    pool.write(0, 0, kv_for(tokens))
    cache.store(tokens, pool, 0)  # 5 whole blocks
    cache.pin(tokens[:6], kv_for(tokens[:6]))
    assert sum(b.shape[2] for b in cache.match([*tokens[:7], 99])) == 6  # blocks cover 4, the pin 6
    assert sum(b.shape[2] for b in cache.match([*tokens, 99])) == 20  # blocks cover all 20


def test_pins_count_in_the_budget_and_are_never_evicted() -> None:
    block_bytes = 4 * FACTS.kv_bytes_per_token()
    cache = PrefixCache(block_size=4, capacity_bytes=3 * block_bytes)
    pool = KVPool(FACTS, slots=1, max_context=64)
    pinned = [1, 2, 3]
    cache.pin(pinned, kv_for(pinned))
    assert cache.used_bytes == 3 * FACTS.kv_bytes_per_token() and cache.pinned_tokens == 3
    for start in range(0, 40, 8):  # far more blocks than fit: LRU blocks are evicted, the pin stays
        tokens = list(range(100 + start, 108 + start))
        pool.write(0, 0, kv_for(tokens))
        cache.store(tokens, pool, 0)
    assert cache.used_bytes <= cache.capacity_bytes
    assert [b.shape[2] for b in cache.match([*pinned, 4])] == [3]
    cache.pin(pinned, kv_for(pinned))  # pinning again replaces, never double counts
    assert cache.pinned_tokens == 3


def test_pin_rejects_kv_that_does_not_match_its_tokens() -> None:
    cache = PrefixCache(block_size=4, capacity_bytes=1 << 20)
    with pytest.raises(ValueError, match="needs KV"):
        cache.pin([1, 2, 3], kv_for([1, 2]))
