"""A bundle fetched by its digest into a machine-local cache, verified on the way: Lambda's init phase and each
node of a Ray cluster start from one of these.

The bundle lies content-addressed in a store: `s3://BUCKET/PREFIX/` (the Lambda bucket's `bundles/HEX/`, a Ray
target's `bundle_store`) or a folder every machine mounts. The manifest is read first and must have the digest
the deploy asked for; every file it lists is then streamed to disk and hashed on the way, and must match its
size and sha256. Only then is the folder renamed into place, so a folder under its final name is complete and
verified: the engine opens it without hashing again, and a later start on the same machine reuses it.

Fetches into one cache take turns (an advisory lock on the cache folder), so replicas starting together on one
machine fetch the bundle once: the second finds the first's folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from runtime.bundle import MANIFEST_NAME, BundleError, Manifest

log = logging.getLogger("runtime.bundle")
_CHUNK = 8 << 20

Opener = Callable[[str], Any]  # a file's name in the bundle → a readable binary stream (`read(n)`)


def split_s3_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://") or "/" not in uri[5:]:
        raise BundleError(f"a bundle store must be s3://BUCKET/PREFIX/, got {uri!r}")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.rstrip("/") + "/"


def s3_opener(uri: str, s3: Any = None) -> Opener:
    """The files under `s3://BUCKET/PREFIX/`, read with `s3` (default: a boto3 client from the environment)."""
    bucket, prefix = split_s3_uri(uri)
    if s3 is None:
        import boto3

        s3 = boto3.client("s3")
    return lambda name: s3.get_object(Bucket=bucket, Key=prefix + name)["Body"]


def folder_opener(folder: Path) -> Opener:
    """The files of a bundle folder on a file system this machine mounts (a shared store)."""
    return lambda name: (folder / name).open("rb")


def cached_name(digest: str) -> str:
    return f"bundle-{digest.removeprefix('sha256:')[:32]}"


def fetch_bundle(where: str, open_file: Opener, digest: str, cache: Path) -> Path:
    """The verified bundle `where` names, in `cache`; raises `BundleError` naming what does not match."""
    if not digest.startswith("sha256:"):
        raise BundleError(f"a bundle digest must be sha256:HEX, got {digest!r}")
    final = cache / cached_name(digest)
    if (final / MANIFEST_NAME).is_file():
        log.info("bundle %s: already fetched and verified on this machine", digest)
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with _turn(cache):
        if (final / MANIFEST_NAME).is_file():  # another process fetched it while this one waited
            log.info("bundle %s: fetched and verified by another process on this machine", digest)
            return final
        started = time.monotonic()
        total = _fetch_into(final, where, open_file, digest)
    log.info("bundle %s: fetched %.1f MB from %s and verified in %.2f s", digest, total / 1e6, where,
             time.monotonic() - started)  # fmt: skip
    return final


@contextmanager
def _turn(cache: Path) -> Iterator[None]:
    """Hold the cache folder's lock: one fetch at a time per cache, whichever process runs it."""
    descriptor = os.open(cache, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing releases the lock


def _fetch_into(final: Path, where: str, open_file: Opener, digest: str) -> int:
    partial = final.parent / f"{final.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        raw = _read_all(open_file(MANIFEST_NAME))
        try:
            manifest = Manifest.from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise BundleError(f"{where}{MANIFEST_NAME} is not a bundle manifest: {exc}") from exc
        if manifest.digest != digest:
            raise BundleError(f"the bundle at {where} has digest {manifest.digest}, not the {digest} deployed")
        total = 0
        for name, entry in sorted(manifest.files.items()):
            target = partial / name
            target.parent.mkdir(parents=True, exist_ok=True)
            body = open_file(name)
            h, size = hashlib.sha256(), 0
            with target.open("wb") as out:
                while size <= entry.size and (chunk := body.read(_CHUNK)):  # a longer object stops one chunk past
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            _close(body)
            if (size, h.hexdigest()) != (entry.size, entry.sha256):
                raise BundleError(
                    f"bundle file {name} from {where} does not match the manifest: {size} bytes, sha256 "
                    f"{h.hexdigest()[:16]}…, expected {entry.size} bytes, {entry.sha256[:16]}…"
                )
            total += size
        (partial / MANIFEST_NAME).write_bytes(raw)
        partial.replace(final)
    except FileNotFoundError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise BundleError(f"the bundle at {where} is incomplete: {exc.filename} is missing") from exc
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return total


def _read_all(stream: BinaryIO) -> bytes:
    try:
        return stream.read()
    finally:
        _close(stream)


def _close(stream: Any) -> None:
    close = getattr(stream, "close", None)
    if close is not None:
        close()
