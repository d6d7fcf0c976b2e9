"""Bundles derived from the demo bundle: hard-linked copies, with the manifest re-written when asked.

A variant changes the function name and `quality.json`, re-hashed with the same `file_digest` and
`manifest_bytes` the packager's bundle writer uses, so it is a valid bundle with a digest of its own.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import tarfile
from pathlib import Path

from runtime.bundle import MANIFEST_NAME, file_digest, manifest_bytes, read_manifest


def derive_bundle(source: Path, target: Path, *, function: str | None = None) -> Path:
    for path in sorted(source.rglob("*")):
        destination = target / path.relative_to(source)
        if path.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
        else:
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, destination)  # the demo bundle is read-only to us: links share, never modify
    if function is None:
        return target
    manifest = read_manifest(target)
    quality = target / "quality.json"
    data = json.loads(quality.read_text())
    quality.unlink()  # a link to the demo's file: replace it rather than write through it
    quality.write_text(json.dumps({**data, "variant": function}, indent=2))
    files = {**manifest.files, "quality.json": file_digest(quality)}
    variant = dataclasses.replace(manifest, function=function, files=files)
    (target / MANIFEST_NAME).unlink()
    (target / MANIFEST_NAME).write_bytes(manifest_bytes(variant.to_json()))
    return target


def tar_bytes(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()
