"""A GGUF model as users have it, made one file to read: a single file, llama.cpp's split shards, or a download
in parts.

- Split shards (`gguf-split`, or llama.cpp's converters with `--split-max-size`): `NAME-00001-of-00003.gguf`, each
  a GGUF with some of the tensors and the first with the metadata. Naming any shard finds the others beside it;
  they are merged into one GGUF (gguf's own writer) in the build cache.
- Parts of a download (`model.gguf.part00`, `.part01`, … or `.part1of4`): byte ranges of one file. Naming the
  file (which does not exist as such) finds the parts, in the folder or, for a `pypi:` source, across the
  distribution and the distributions it requires; they are joined in order in the build cache, and checked
  against a `SHA256SUMS` file shipped beside them when there is one.
Either way the result is checked to be GGUF (its first bytes), so a mislabelled file is named as such.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from packager.cache import cached_dir
from packager.errors import UserError
from packager.sources.pypi import glob_escape
from runtime.bundle import file_digest

GGUF_MAGIC = b"GGUF"
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")
PART_NAME = re.compile(r"^(?P<name>.+)\.part(?P<number>\d+)(?:of(?P<count>\d+))?$")
_HASH_CHUNK = 1 << 20
ASSEMBLE_VERSION = 1  # bump when the assembly below changes, to invalidate cached files
# What a file that is not GGUF usually is, by its first bytes: named in the error.
_LOOKS_LIKE = {
    b"PK\x03\x04": "a zip archive",
    b"\x89HDF": "an HDF5 file",
    b"<!DO": "an HTML page",
    b"<htm": "an HTML page",
}


@dataclass(frozen=True)
class GgufFiles:
    """The file(s) holding one GGUF model."""

    kind: Literal["file", "split", "parts"]
    paths: tuple[Path, ...]
    checksum: str | None = None  # the expected sha256 of the joined parts, from a SHA256SUMS shipped with them

    @property
    def name(self) -> str:
        first = self.paths[0].name
        if self.kind == "parts":
            return PART_NAME.match(first).group("name")  # type: ignore[union-attr]
        if self.kind == "split":
            return SPLIT_NAME.match(first).group("stem") + ".gguf"  # type: ignore[union-attr]
        return first


def check_gguf_magic(path: Path, source: str) -> None:
    with path.open("rb") as f:
        head = f.read(4)
    if head == GGUF_MAGIC:
        return
    if path.suffix == ".safetensors" or head[:1] == b"{" or not head:
        kind = "empty" if not head else "a safetensors or JSON file"
    else:
        kind = _LOOKS_LIKE.get(head, f"something else (it starts with {head!r})")
    raise UserError(
        f"model.source = {source!r}: {path} is not a GGUF file: it is {kind}, and a GGUF file starts with "
        f"{GGUF_MAGIC!r}. Point gguf: at a .gguf file as llama.cpp writes it, or hf: at a Hugging Face model folder",
        exit_code=2,
    )


def find_gguf_files(path: Path, source: str, search: list[Path] | None = None) -> GgufFiles:
    """The GGUF file `path` names, its fellow split shards, or (when `path` does not exist) its parts, found beside it
    or in the folders of `search`."""
    if path.is_file():
        match = SPLIT_NAME.match(path.name)
        if match is None:
            check_gguf_magic(path, source)
            return GgufFiles("file", (path,))
        return _split_shards(path, match, source)
    parts = _parts(path.name, [path.parent, *(search or [])])
    if not parts:
        raise UserError(f"model.source = {source!r}: {path} does not exist (nor any {path.name}.partNN)", exit_code=2)
    check_gguf_magic(parts[0], source)
    return GgufFiles("parts", tuple(parts), _listed_checksum(path.name, [*(p.parent for p in parts), *(search or [])]))


def _split_shards(path: Path, match: re.Match[str], source: str) -> GgufFiles:
    stem, count = match.group("stem"), int(match.group("count"))
    shards = [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise UserError(
            f"model.source = {source!r}: {path.name} is shard {int(match.group('number'))} of {count}, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing from {path.parent}; "
            "download every shard into one folder",
            exit_code=2,
        )
    for shard in shards:
        check_gguf_magic(shard, source)
    return GgufFiles("split", tuple(shards))


def _parts(name: str, folders: list[Path]) -> list[Path]:
    found: dict[int, Path] = {}
    for folder in folders:
        for candidate in folder.glob(f"{glob_escape(name)}.part*") if folder.is_dir() else ():
            match = PART_NAME.match(candidate.name)
            if match and match.group("name") == name and candidate.is_file():
                found.setdefault(int(match.group("number")), candidate)
    numbers = sorted(found)
    if numbers and numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        gaps = sorted(set(range(numbers[0], numbers[-1] + 1)) - set(numbers))
        raise UserError(f"{name} is in parts, but part(s) {', '.join(map(str, gaps))} are missing", exit_code=2)
    return [found[n] for n in numbers]


def _listed_checksum(name: str, folders: list[Path]) -> str | None:
    """The sha256 a `SHA256SUMS` file beside the parts (or in the distribution shipping them) lists for `name`."""
    for folder in dict.fromkeys(folders):
        for sums in folder.glob("SHA256SUMS"):
            for line in sums.read_text(errors="replace").splitlines():
                digest, _, listed = line.strip().partition(" ")
                if listed.strip().lstrip("*") == name and len(digest) == 64:
                    return digest.lower()
    return None


def assemble(files: GgufFiles, source: str) -> tuple[Path, str]:
    """One GGUF file holding the model, and its sha256 (the key of everything built from it)."""
    if files.kind == "file":
        return files.paths[0], file_digest(files.paths[0]).sha256
    content = files_sha256(files.paths)  # of the parts' bytes in order: for parts, the joined file's sha256
    if files.kind == "parts" and files.checksum is not None and content != files.checksum:
        raise UserError(
            f"model.source = {source!r}: the parts of {files.name} join into a file with sha256 {content}, but "
            f"the SHA256SUMS shipped with them lists {files.checksum}: a part is corrupt or from another version; "
            "download or install the parts again"
        )

    def produce(out: Path) -> None:
        target = out / files.name
        if files.kind == "parts":
            _join(files.paths, target)
        else:
            _merge_shards(files.paths, target)
        (out / "sha256").write_text(file_digest(target).sha256 + "\n")

    directory, _ = cached_dir("gguf", f"{files.kind}-{content}-v{ASSEMBLE_VERSION}", produce)
    return directory / files.name, (directory / "sha256").read_text().strip()


def files_sha256(paths: tuple[Path, ...]) -> str:
    h = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def _join(parts: tuple[Path, ...], target: Path) -> None:
    with target.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                shutil.copyfileobj(f, out, _HASH_CHUNK)


def _merge_shards(shards: tuple[Path, ...], target: Path) -> None:
    """Write the shards' tensors, in order, into one GGUF with the first shard's metadata (less the split keys)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys

    readers = [GGUFReader(str(shard)) for shard in shards]
    first = readers[0]
    architecture = first.fields[Keys.General.ARCHITECTURE].contents()
    writer = GGUFWriter(str(target), architecture)
    for field in first.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith(("GGUF.", "split.")):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    tensors = [(tensor, reader) for reader in readers for tensor in reader.tensors]
    for tensor, _ in tensors:
        writer.add_tensor_info(
            tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor, reader in tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
