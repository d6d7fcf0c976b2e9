"""The zip package's bundle: fetched from the function's bucket into `/tmp` during the init phase, and verified.

`pkg deploy` uploads the bundle content-addressed (`s3://BUCKET/bundles/HEX/`, `HEX` the manifest digest) and
sets `ONNXFN_BUNDLE_S3` to that prefix and `ONNXFN_BUNDLE_DIGEST` to the digest. The manifest is fetched first
and must have that digest; every file it lists is then streamed to disk and hashed on the way, and must match
its size and sha256. Only then is the folder renamed into place, so a folder under its final name is complete
and verified: the engine opens it without hashing again, and a later init in the same sandbox reuses it.

Why `/tmp` rather than memory: the graphs' weights are external data that ONNX Runtime reads by path, and
SnapStart's 512 MB `/tmp` cap holds the demo's bundle (~122 MB at `gguf` precision, ~271 MB at int8). The
snapshot keeps the loaded session's memory either way; `/tmp` is part of the snapshot too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from runtime.bundle import MANIFEST_NAME, BundleError, Manifest

log = logging.getLogger("runtime.aws_lambda")
BUNDLE_S3_ENV = "ONNXFN_BUNDLE_S3"  # s3://BUCKET/bundles/HEX/
BUNDLE_DIGEST_ENV = "ONNXFN_BUNDLE_DIGEST"  # sha256:HEX, the manifest digest the fetched bundle must have
CACHE_ENV = "ONNXFN_BUNDLE_CACHE"  # where fetched bundles go (default /tmp/onnxfn)
DEFAULT_CACHE = "/tmp/onnxfn"
_CHUNK = 8 << 20


def split_s3_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://") or "/" not in uri[5:]:
        raise BundleError(f"${BUNDLE_S3_ENV} must be s3://BUCKET/PREFIX/, got {uri!r}")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.rstrip("/") + "/"


def fetch_bundle(uri: str, digest: str, *, s3: Any = None, cache: Path | None = None) -> Path:
    """The verified bundle at `uri` in the local cache; raises `BundleError` naming what does not match."""
    if not digest.startswith("sha256:"):
        raise BundleError(f"${BUNDLE_DIGEST_ENV} must be sha256:HEX, got {digest!r}")
    root = Path(cache or os.environ.get(CACHE_ENV, DEFAULT_CACHE))
    final = root / f"bundle-{digest.removeprefix('sha256:')[:32]}"
    if (final / MANIFEST_NAME).is_file():
        log.info("bundle %s: already fetched and verified in this sandbox", digest)
        return final
    if s3 is None:
        import boto3

        s3 = boto3.client("s3")
    bucket, prefix = split_s3_uri(uri)
    started = time.monotonic()
    partial = root / f"{final.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        raw = s3.get_object(Bucket=bucket, Key=prefix + MANIFEST_NAME)["Body"].read()
        try:
            manifest = Manifest.from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise BundleError(f"{uri}{MANIFEST_NAME} is not a bundle manifest: {exc}") from exc
        if manifest.digest != digest:
            raise BundleError(f"the bundle at {uri} has digest {manifest.digest}, not the {digest} deployed")
        total = 0
        for name, entry in sorted(manifest.files.items()):
            target = partial / name
            target.parent.mkdir(parents=True, exist_ok=True)
            body = s3.get_object(Bucket=bucket, Key=prefix + name)["Body"]
            h, size = hashlib.sha256(), 0
            with target.open("wb") as out:
                while size <= entry.size and (chunk := body.read(_CHUNK)):  # a longer object stops one chunk past
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            if (size, h.hexdigest()) != (entry.size, entry.sha256):
                raise BundleError(
                    f"bundle file {name} from {uri} does not match the manifest: {size} bytes, sha256 "
                    f"{h.hexdigest()[:16]}…, expected {entry.size} bytes, {entry.sha256[:16]}…"
                )
            total += size
        (partial / MANIFEST_NAME).write_bytes(raw)
        partial.replace(final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log.info("bundle %s: fetched %.1f MB from %s and verified in %.2f s", digest, total / 1e6, uri,
             time.monotonic() - started)  # fmt: skip
    return final
