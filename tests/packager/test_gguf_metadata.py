"""The quick metadata reader agrees with gguf's GGUFReader on every field and tensor (its table and its mapped
values), and refuses a cut file."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from packager.errors import UserError
from packager.sources.gguf import gguf_architecture
from packager.sources.gguf_metadata import StringArray, mapped_tensors, read_metadata
from packager.synthetic.writer import tokenizer_gguf


def test_every_field_and_tensor_is_gguf_readers() -> None:
    path = tokenizer_gguf()  # the demo: 49,152 tokens, 48,900 merges, 272 tensors
    started = time.perf_counter()
    metadata = read_metadata(path)
    quick_s = time.perf_counter() - started
    started = time.perf_counter()
    reader = GGUFReader(path)
    reader_s = time.perf_counter() - started
    fields = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert fields.keys() == metadata.fields.keys()
    for key, value in fields.items():
        mine = metadata.fields[key]
        assert (len(mine) == len(value)) if isinstance(mine, StringArray) else mine == value, key
    assert len(metadata.fields["tokenizer.ggml.tokens"]) == 49152
    assert {
        t.name: (tuple(map(int, t.shape)), int(t.tensor_type), t.data_offset, int(t.n_bytes)) for t in reader.tensors
    } == {name: (info.shape, info.type, info.offset, info.n_bytes) for name, info in metadata.tensors.items()}
    assert metadata.architecture == "llama" and metadata.field("{arch}.block_count") == 30
    # The tensors over one mapping are GGUFReader's: same views (dtype, shape, bytes), shapes, types and sizes.
    _, mapped = mapped_tensors(path)
    for theirs in reader.tensors:
        ours = mapped[theirs.name]
        assert (ours.tensor_type, ours.n_elements, ours.n_bytes) == (
            theirs.tensor_type,
            theirs.n_elements,
            theirs.n_bytes,
        )
        assert ours.shape.tolist() == theirs.shape.tolist() and ours.data.dtype == theirs.data.dtype
        assert ours.data.shape == theirs.data.shape and np.array_equal(ours.data, theirs.data), theirs.name
    assert quick_s < reader_s / 5, (quick_s, reader_s)  # the point of it (measured: 0.1 s against 7-9 s)


def test_f32_tensors_and_a_cut_file(tmp_path: Path) -> None:
    path = tmp_path / "small.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.context_length", 64)
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0])
    writer.add_tensor("rope_freqs.weight", np.arange(8, dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((4, 8), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = read_metadata(path)
    assert metadata.field("{arch}.context_length") == 64 and metadata.fields["tokenizer.ggml.scores"] == [0.5, -1.0]
    assert metadata.float32("rope_freqs.weight").tolist() == list(range(8))
    assert metadata.tensors["blk.0.attn_q.weight"].shape == (8, 4)  # GGUF's order, as GGUFReader's
    with pytest.raises(ValueError, match="is not F32"):
        metadata.float32("blk.0.attn_q.weight")

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:60])
    with pytest.raises(ValueError, match="ends inside its metadata"):
        read_metadata(cut)
    cut.write_bytes(b"GGML" + path.read_bytes()[4:])
    with pytest.raises(ValueError, match="does not start with GGUF's magic"):
        read_metadata(cut)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (struct.pack("<QQ", 0, 1) + struct.pack("<Q", 1 << 62), "ends inside its metadata"),  # a key 2^62 long
        (struct.pack("<QQ", 0, 1 << 60), "ends inside its metadata"),  # 2^60 fields
        (struct.pack("<QQ", 1 << 60, 0), "ends inside its metadata"),  # 2^60 tensors
        (struct.pack("<QQ", 0, 1) + _key("a") + struct.pack("<IIQ", 9, 8, 1 << 59), "ends inside its metadata"),
        (struct.pack("<QQ", 0, 1) + _key("a") + struct.pack("<IIQ", 9, 8, 2) + struct.pack("<Q", 1 << 40), "ends"),
        (struct.pack("<QQ", 0, 1) + _key("a") + struct.pack("<IIQ", 9, 6, 1 << 61), "ends inside its metadata"),
        (struct.pack("<QQ", 1, 0) + _key("t") + struct.pack("<I", 1 << 30), "has 1073741824 dimensions"),
    ],
    ids=["key-length", "fields", "tensors", "strings", "string-length", "floats", "dimensions"],
)
def test_a_hostile_header_is_refused_at_once_in_bounded_memory(tmp_path: Path, body: bytes, problem: str) -> None:
    """Counts and lengths beyond the file: one ValueError (gguf_architecture's 'not a readable GGUF file'), with no
    huge read and no loop over the count."""
    path = tmp_path / "hostile.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + body + b"\0" * 64)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=problem):
        read_metadata(path)
    assert time.perf_counter() - started < 1.0
    with pytest.raises(UserError, match="is not a readable GGUF file"):
        gguf_architecture(path)
