"""The zip package's bundle: fetched from the function's bucket into `/tmp` during the init phase, and verified.

`pkg deploy` uploads the bundle content-addressed (`s3://BUCKET/bundles/HEX/`, `HEX` the manifest digest) and
sets `ONNXFN_BUNDLE_S3` to that prefix and `ONNXFN_BUNDLE_DIGEST` to the digest. `runtime.bundle_fetch` fetches
it (the manifest first, which must have that digest, then every file hashed on the way) and renames the folder
into place only once it is complete and verified: the engine opens it without hashing again, and a later init
in the same sandbox reuses it.

Why `/tmp` rather than memory: the graphs' weights are external data that ONNX Runtime reads by path, and
SnapStart's 512 MB `/tmp` cap holds the demo's bundle (~122 MB at `gguf` precision, ~271 MB at int8). The
snapshot keeps the loaded session's memory either way; `/tmp` is part of the snapshot too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runtime.bundle_fetch import fetch_bundle as fetch_from_store
from runtime.bundle_fetch import s3_opener

BUNDLE_S3_ENV = "ONNXFN_BUNDLE_S3"  # s3://BUCKET/bundles/HEX/
BUNDLE_DIGEST_ENV = "ONNXFN_BUNDLE_DIGEST"  # sha256:HEX, the manifest digest the fetched bundle must have
CACHE_ENV = "ONNXFN_BUNDLE_CACHE"  # where fetched bundles go (default /tmp/onnxfn)
DEFAULT_CACHE = "/tmp/onnxfn"


def fetch_bundle(uri: str, digest: str, *, s3: Any = None, cache: Path | None = None) -> Path:
    """The verified bundle at `uri` in the local cache; raises `BundleError` naming what does not match."""
    root = Path(cache or os.environ.get(CACHE_ENV, DEFAULT_CACHE))
    return fetch_from_store(uri, s3_opener(uri, s3), digest, root)
