"""The graphs' weights moved onto huge pages after start-up (runtime/engine/huge_pages.py)."""

from __future__ import annotations

import ctypes
import json
import mmap
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runtime.bundle import Bundle
from runtime.engine.graphs import PREFILL_MODEL_FILE
from runtime.engine.huge_pages import CHUNK, collapse, memory_map, merged, subtract, writable_anonymous
from runtime.engine.tokenizer import Tokenizer
from tests.engine.conftest import chat_ids

MAPS = """\
55d0c0000000-55d0c0021000 r--p 00000000 fe:01 1234    /usr/bin/python3.11
55d0c2000000-55d0c4000000 rw-p 00000000 00:00 0       [heap]
7f0000000000-7f0004000000 rw-p 00000000 00:00 0
7f0004000000-7f0008000000 ---p 00000000 00:00 0
7f0008000000-7f000a000000 rw-s 00000000 00:01 77      /dev/zero (deleted)
7f000a000000-7f000b000000 rw-p 00001000 fe:01 99      /usr/lib/libfoo.so
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0       [stack]
"""


def test_only_private_writable_anonymous_memory_is_considered() -> None:
    assert writable_anonymous(MAPS) == [(0x55D0C2000000, 0x55D0C4000000), (0x7F0000000000, 0x7F0004000000)]


def test_the_memory_a_build_added_is_what_was_not_there_before() -> None:
    before = [(10, 20), (30, 40), (50, 60)]
    after = [(0, 25), (30, 40), (45, 70), (80, 90)]
    assert subtract(after, before) == [(0, 10), (20, 25), (45, 50), (60, 70), (80, 90)]
    assert subtract(before, before) == []


def test_two_builds_memory_is_joined_where_it_overlaps() -> None:
    # Two sessions built at once each see some of the other's memory appear.
    assert merged([(50, 60), (0, 10), (5, 20), (20, 25), (40, 45)]) == [(0, 25), (40, 45), (50, 60)]


def _mapping_of(address: int) -> dict[str, int]:
    """`/proc/self/smaps` fields (bytes) of the mapping holding `address`."""
    fields: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            inside = start <= address < end
        elif inside and line.split(":")[0] in ("Anonymous", "AnonHugePages"):
            fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    return fields


def test_dense_memory_moves_onto_huge_pages_with_its_contents_and_sparse_memory_stays_small() -> None:
    size = 64 << 20
    pattern = bytes(range(256)) * (size // 256)
    before = memory_map()
    dense = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    sparse = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dense.write(pattern)
    sparse[0] = 1  # one page touched: collapsing it would commit the other 63.99 MiB
    added = subtract(memory_map(), before)
    assert sum(end - start for start, end in added) >= 2 * size

    chunks: list[None] = []
    report = collapse(added, before_each=lambda: chunks.append(None))  # the engine blocks here while busy
    if report.unsupported:
        pytest.skip(report.describe())
    assert report.collapsed_bytes >= size - (4 << 20)  # the dense map, less partial huge pages at its ends
    assert report.collapsed_bytes < 2 * size - (8 << 20)  # not the sparse one
    assert len(chunks) >= report.collapsed_bytes // CHUNK >= 7  # asked before every 8 MiB moved
    address = _address_of(dense)
    assert _mapping_of(address)["AnonHugePages"] >= size - (4 << 20)
    assert dense[:] == pattern
    assert _mapping_of(_address_of(sparse))["Anonymous"] < 2 * size - (32 << 20)
    assert report.describe().startswith(f"graph weights on huge pages: {report.collapsed_bytes >> 20} MiB")


def _address_of(region: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


# Each engine runs in a fresh interpreter, as a server builds its session: in a process where earlier engines
# freed their weights, malloc reuses that memory and a new build adds fewer new mappings (seen in CI: 74 MiB).
_ENGINE_RUN = """
import json, sys
from pathlib import Path
from typing import Any
from runtime.bundle import open_bundle
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.request import GenerationRequest, SamplingParams
bundle_dir, prompt = sys.argv[1], json.loads(sys.argv[2])
huge_pages, defer, matmuls = sys.argv[3] == "on", sys.argv[4] == "defer", sys.argv[5]
config = EngineConfig(
    max_batch=2, max_context=256, huge_pages=huge_pages, defer_prefill_graph=defer, prefill_matmuls=matmuls
)
engine = Engine(open_bundle(Path(bundle_dir), verify=False), config)
report = engine.wait_until_warm()
sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
tokens = engine.generate(GenerationRequest("hp", tuple(prompt), sampling))[0].token_ids
engine.shutdown()
moved = None if report is None else {"collapsed": report.collapsed_bytes, "unsupported": report.unsupported}
print(json.dumps({"report": moved, "tokens": list(tokens)}))
"""


def _run_engine(
    bundle: Bundle, prompt: tuple[int, ...], huge_pages: bool, defer: bool = False, prefill_matmuls: str = "auto"
) -> dict[str, Any]:
    command = [
        sys.executable,
        "-c",
        _ENGINE_RUN,
        str(bundle.path),
        json.dumps(list(prompt)),
        "on" if huge_pages else "off",
        "defer" if defer else "at once",
        prefill_matmuls,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.real_model
def test_an_engine_moves_its_decode_weights_and_decodes_the_same_tokens(bundle: Bundle, tokenizer: Tokenizer) -> None:
    prompt = chat_ids(tokenizer, "Name three colours of the rainbow.")
    off, on = (_run_engine(bundle, prompt, huge_pages) for huge_pages in (False, True))
    assert off["report"] is None
    report = on["report"]
    assert report is not None and not report["unsupported"], report
    # The int8 decode graph's prepacked matmul weights alone are ~140 MiB.
    assert report["collapsed"] >= 100 << 20
    assert on["tokens"] == off["tokens"]


@pytest.mark.real_model
def test_a_prefill_graph_loaded_later_has_its_weights_moved_too(bundle: Bundle, tokenizer: Tokenizer) -> None:
    # As a server starts: the prefill graph builds once the engine serves. Its fp32 weights are what a
    # prompt reads; on 4 KiB pages a 32-token prompt's first token took 55 ms here, 44 ms on huge pages.
    assert PREFILL_MODEL_FILE in bundle.manifest.files
    prompt = chat_ids(tokenizer, "Hi")
    report = _run_engine(bundle, prompt, huge_pages=True, defer=True, prefill_matmuls="fp32")["report"]
    assert report is not None and not report["unsupported"], report
    # The decode graph's ~140 MiB and the prefill graph's fp32 matmul weights (~107M parameters, ~410 MiB).
    assert report["collapsed"] >= 450 << 20
