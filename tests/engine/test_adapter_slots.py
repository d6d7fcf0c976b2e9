"""LoRA adapter slots (bounded, least recently used idle one evicted) and the prefix cache keyed by adapter."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from runtime.adapters.catalog import AdapterCatalog
from runtime.adapters.files import FORMAT, AdapterFile, AdapterFileError
from runtime.adapters.layout import AdapterLayout, ModuleRange, Projection
from runtime.engine.adapter_slots import AdapterSlots, RequestAdapter
from runtime.engine.kv_cache import KVPool, PrefixCache
from tests.engine.test_kv_cache import FACTS, fill

LAYOUT = AdapterLayout(rank=2, num_layers=1, projections=(Projection("o_proj", 3, 4, (ModuleRange("o_proj", 0, 4),)),))


def adapter(name: str, value: float) -> RequestAdapter:
    a, b = np.full((3, 2), value, np.float32), np.ones((2, 4), np.float32)
    tensors = {"layers.0.o_proj.a": a, "layers.0.o_proj.b": b}
    return RequestAdapter(name, f"sha256:{name}", AdapterFile(rank=2, scale=0.5, base={}, tensors=tensors))


def test_slots_are_bounded_and_evict_the_least_recently_used_idle_adapter() -> None:
    slots = AdapterSlots(LAYOUT, capacity=2, pool_rows=4)
    a, b, c = adapter("a", 1.0), adapter("b", 2.0), adapter("c", 3.0)
    assert (slots.acquire(a), slots.acquire(b)) == (1, 2)
    assert slots.acquire(c) is None  # both held by running requests: c waits
    stack_a, stack_b = slots.a_levels["adapters.0.o_proj.A"][2], slots.b_stacks["adapters.0.o_proj.B"]
    np.testing.assert_array_equal(stack_a[:, 0:2], np.full((3, 2), 1.0))  # slot 1: columns 0..C of A
    np.testing.assert_array_equal(slots.a_levels["adapters.0.o_proj.A"][1], np.full((3, 2), 1.0))  # narrower copy
    np.testing.assert_array_equal(stack_b[2:4], np.full((2, 4), 0.5))  # slot 2: rows C..2C of B, b * scale
    slots.release(2)
    slots.release(1)
    assert slots.acquire(a) == 1  # resident: no load, and now the more recently used
    slots.release(1)
    assert slots.acquire(c) == 2  # evicts b, the least recently used idle adapter
    np.testing.assert_array_equal(stack_a[:, 2:4], np.full((3, 2), 3.0))
    assert slots.resident() == {"sha256:a": 1, "sha256:c": 2}
    assert [load.digest for load in slots.loads] == ["sha256:a", "sha256:b", "sha256:c"]


def test_a_step_binds_only_the_slots_its_rows_use() -> None:
    slots = AdapterSlots(LAYOUT, capacity=4, pool_rows=4)
    assert slots.levels == [0, 1, 2, 4]
    assert slots.bound_slots(0, 4) == 0  # base rows only: nothing bound
    slots.rows[:] = [0, 3, 1, 0]
    assert (slots.bound_slots(0, 4), slots.bound_slots(2, 4), slots.bound_slots(3, 4)) == (4, 1, 0)
    assert {name: view.shape for name, view in slots.views(2).items()} == {
        "adapters.0.o_proj.A": (3, 4), "adapters.0.o_proj.B": (4, 4)
    }  # fmt: skip
    assert slots.bytes_per_slot == (3 * 2 + 2 * 4) * 4


def test_a_removed_adapter_frees_its_slot_once_no_request_holds_it() -> None:
    slots = AdapterSlots(LAYOUT, capacity=1, pool_rows=1)
    assert slots.acquire(adapter("a", 1.0)) == 1
    slots.forget("sha256:a")
    assert slots.acquire(adapter("b", 2.0)) is None  # still held
    slots.release(1)
    assert slots.acquire(adapter("b", 2.0)) == 1


def test_prefix_blocks_are_keyed_by_adapter_and_pins_serve_the_base_only() -> None:
    pool = KVPool(FACTS, slots=2, max_context=16)
    cache = PrefixCache(block_size=4, capacity_bytes=1 << 20)
    tokens = list(range(1, 10))
    fill(pool, 0, 9, value=1.0)
    cache.store(tokens, pool, 0, namespace=b"sha256:a")
    assert cache.match(tokens, namespace=b"sha256:b") == [] and cache.match(tokens) == []
    assert len(cache.match(tokens, namespace=b"sha256:a")) == 2  # two whole blocks of 4
    cache.pin(tokens[:5], pool.read(0, 0, 5))
    assert cache.match(tokens)[0].shape[2] == 5  # the base finds the pinned prefix
    assert len(cache.match(tokens, namespace=b"sha256:b")) == 0  # an adapter never does


@pytest.mark.parametrize(
    ("tensors", "rank", "expected"),
    [
        ({"bad": np.ones((3, 2), np.float32)}, 2, "expected layers.N.MODULE.a or .b"),
        ({"layers.0.o_proj.a": np.ones((3, 2), np.float32)}, 2, "has no 'layers.0.o_proj.b'"),
        ({"layers.0.o_proj.a": np.ones((3, 2), np.int32), "layers.0.o_proj.b": np.ones((2, 4), np.int32)}, 2, "int32"),
        ({"layers.x.o_proj.a": np.ones((3, 2), np.float32)}, 2, "expected layers.N.MODULE.a or .b"),
        (
            {"layers.0.o_proj.a": np.ones((3, 2), np.float32), "layers.0.o_proj.b": np.ones((2, 4), np.float32)},
            0,
            "rank",
        ),
        ({}, 2, "no tensors"),
    ],
)
def test_a_malformed_adapter_file_is_refused_and_nothing_is_stored(
    tmp_path: Path, tensors: dict[str, np.ndarray], rank: int, expected: str
) -> None:
    """The HTTP and agent routes hand any bytes to the catalog: a file that parses but is unusable is a clear
    `AdapterFileError` (the routes' 400), never a crash in the engine later."""
    from safetensors.numpy import save_file

    path = tmp_path / "crafted.safetensors"
    meta = {"format": FORMAT, "rank": str(rank), "scale": "1.0", "base": "{}"}
    save_file(tensors, str(path), metadata=meta)
    catalog = AdapterCatalog(LAYOUT, [], tmp_path / "adapters")
    with pytest.raises(AdapterFileError, match=re.escape(expected)):
        catalog.add("crafted", path.read_bytes())
    assert catalog.names() == [] and not list((tmp_path / "adapters").iterdir())
