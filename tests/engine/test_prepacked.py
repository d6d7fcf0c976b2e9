"""Prepacked graphs (runtime/engine/prepacked.py): weights packed once for this CPU, memory-mapped at every start."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import onnxruntime as ort
import pytest

from runtime.bundle import Bundle
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.graphs import PREFILL_MODEL_FILE, QUANTIZED_PREFILL_FILE, ROW_LAST_POSITIONS, graph_source
from runtime.engine.prepacked import META_FILE, PrepackedGraphs, data_file
from runtime.engine.request import GenerationRequest, SamplingParams
from runtime.engine.tokenizer import Tokenizer
from tests.engine.conftest import chat_ids

pytestmark = pytest.mark.real_model


ALL_GRAPHS = ("model.onnx", PREFILL_MODEL_FILE, QUANTIZED_PREFILL_FILE)


@pytest.fixture(scope="module")
def prepacked(bundle: Bundle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrepackedGraphs]:
    graphs = PrepackedGraphs(tmp_path_factory.mktemp("prepacked") / "prepacked")
    # Every graph of the bundle, whichever prefill graph this CPU runs: both decode modes are tested.
    graphs.write(bundle, [graph_source(bundle, name, EngineConfig()) for name in ALL_GRAPHS], threads=2)
    yield graphs


SESSION_MEMORY = """
import sys
from pathlib import Path
from runtime.engine.session_build import SessionOptions, create_session
session = create_session(Path(sys.argv[1]), SessionOptions(threads=2))
rollup = Path("/proc/self/smaps_rollup").read_text().splitlines()
print(next(int(line.split()[1]) << 10 for line in rollup if line.startswith("Anonymous:")))
"""


def anonymous_bytes_with_session(graph: Path) -> int:
    done = subprocess.run(
        [sys.executable, "-c", SESSION_MEMORY, str(graph)], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


def greedy(engine: Engine, tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (output,) = engine.generate(GenerationRequest(text[:16], chat_ids(tokenizer, text), params))
    return tuple(output.token_ids)


def test_the_graphs_are_written_with_a_record_of_where_they_are_valid(
    bundle: Bundle, prepacked: PrepackedGraphs
) -> None:
    meta = json.loads((prepacked.directory / META_FILE).read_text())
    assert meta["bundle_digest"] == bundle.manifest.digest
    assert set(meta["files"]) == set(ALL_GRAPHS)
    for name in meta["files"]:
        assert prepacked.problem(bundle, name) is None
        assert prepacked.graph_for(bundle, bundle.path / name) == prepacked.directory / name
    assert not prepacked.directory.with_name("prepacked.partial").exists()
    # The copy keeps the graph's metadata, so prompts still share prefill runs (engine/runner.py).
    copy = ort.InferenceSession(str(prepacked.directory / PREFILL_MODEL_FILE), providers=["CPUExecutionProvider"])
    key, value = ROW_LAST_POSITIONS
    assert copy.get_modelmeta().custom_metadata_map.get(key) == value


def test_a_session_on_the_prepacked_graph_maps_its_weights_instead_of_packing_them(
    bundle: Bundle, prepacked: PrepackedGraphs
) -> None:
    # The resident anonymous memory of a process holding the session, each in a fresh process of its own.
    mapped_bytes = anonymous_bytes_with_session(prepacked.directory / PREFILL_MODEL_FILE)
    heap_bytes = anonymous_bytes_with_session(graph_source(bundle, PREFILL_MODEL_FILE, EngineConfig()))
    assert heap_bytes - mapped_bytes > 300 << 20  # the demo's fp32 matmul weights, packed onto the heap
    assert mapped_bytes < heap_bytes / 4, (heap_bytes, mapped_bytes)


@pytest.mark.parametrize("decode", ["latency", "throughput"])
def test_outputs_are_identical_with_and_without_prepacked_graphs(
    bundle: Bundle, tokenizer: Tokenizer, prepacked: PrepackedGraphs, decode: str, caplog: pytest.LogCaptureFixture
) -> None:
    texts = ["Why is the sky blue?", "Write a haiku about the sea. " * 6]
    outputs = []
    caplog.set_level(logging.WARNING, logger="runtime.engine")
    for directory in (None, prepacked.directory):
        engine = Engine(bundle, EngineConfig(max_batch=2, decode=decode, prepacked=directory))  # type: ignore[arg-type]
        try:
            outputs.append([greedy(engine, tokenizer, text) for text in texts])
        finally:
            engine.shutdown()
    assert "prepacked graphs:" not in caplog.text  # no fallback: the second engine ran the prepacked copies
    assert outputs[0] == outputs[1]


def test_a_copy_that_no_longer_matches_is_ignored_with_the_reason(
    bundle: Bundle, prepacked: PrepackedGraphs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    copy = PrepackedGraphs(tmp_path / "copy")
    copy.directory.mkdir()
    for path in prepacked.directory.iterdir():
        os.link(path, copy.directory / path.name)  # same inodes, sizes and mtimes: valid as is
    model = bundle.manifest.model_file
    assert copy.problem(bundle, model) is None
    meta_path = copy.directory / META_FILE
    meta = json.loads(meta_path.read_text())

    def with_meta(**changes: object) -> str | None:
        meta_path.unlink()  # not through the hard link: the module's copy stays intact
        meta_path.write_text(json.dumps({**meta, **changes}))
        return copy.problem(bundle, model)

    assert with_meta(cpu="0" * 64) == "they were written on a CPU with other features"
    assert with_meta(onnxruntime="1.0.0") is not None and "onnxruntime 1.0.0" in str(with_meta(onnxruntime="1.0.0"))
    assert with_meta(bundle_digest="sha256:" + "0" * 64) == "they were written for another bundle"
    assert with_meta() is None
    data = data_file(copy.directory / model)
    stat = data.stat()
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # the module's copy shares the inode: undone below
    try:
        assert copy.problem(bundle, model) == f"{model} or its data changed since they were written"
        with caplog.at_level(logging.WARNING, logger="runtime.engine"):
            assert copy.graph_for(bundle, bundle.model_path) == bundle.model_path
        assert f"using the bundle's {model} ({model} or its data changed" in caplog.text
    finally:
        os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (
        PrepackedGraphs(tmp_path / "absent").problem(bundle, model)
        == f"{tmp_path / 'absent' / META_FILE} does not exist"
    )


def test_a_failed_write_leaves_neither_a_partial_copy_nor_a_broken_one(bundle: Bundle, tmp_path: Path) -> None:
    graphs = PrepackedGraphs(tmp_path / "prepacked")
    graphs.directory.mkdir()
    (graphs.directory / META_FILE).write_text("{}")  # an earlier write's record: kept when this one fails
    with pytest.raises(Exception, match="missing.onnx"):
        graphs.write(bundle, [tmp_path / "missing.onnx"], threads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepacked"]
    assert (graphs.directory / META_FILE).read_text() == "{}"
