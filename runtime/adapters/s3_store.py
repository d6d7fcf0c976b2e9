"""LoRA adapters added with `pkg adapter add --target aws-lambda|aws-sagemaker`: fetched from the function's bucket
when the function starts (Lambda's init phase, the SageMaker container's start), verified, served.

The store is `s3://BUCKET/adapters/FUNCTION/`: one `NAME.safetensors` per adapter (an onnxfn adapter file, already
converted and checked by `pkg adapter add`) and `index.json`, which alone says what the store holds:

    {"format": 1, "adapters": {"NAME": {"key": "adapters/F/NAME.safetensors", "version_id": "…" | null,
                                        "sha256": "HEX", "bytes": N}}}

`pkg adapter add` uploads the file, then rewrites the index (remove: the index first, then the file), so a reader
sees an adapter whole or not at all. The bucket is versioned, and the index names the object version it hashed,
so replacing an adapter never mixes one upload's digest with another's bytes.

At start every indexed adapter is streamed into a local folder (Lambda: `/tmp/onnxfn-adapters`) and hashed; one
whose bytes do not match the index, or that does not fit the bundle's adapter inputs, is logged and skipped: never
served. That folder becomes the engine's `--adapter-dir`. A bundle whose graph takes no adapters skips all this,
and so does a store that is empty, missing or unreachable (logged: the base and the bundled adapters serve anyway).

Where the store is: `$ONNXFN_ADAPTERS_S3` (`s3://BUCKET/adapters/FUNCTION/`) when set; otherwise the function's
bucket as `pkg deploy` names it: on Lambda the bucket of `$ONNXFN_BUNDLE_S3` or of the `--ledger` flag (both in
that bucket), else `onnxfn-FUNCTION-lambda|sagemaker-ACCOUNT-REGION` (the account from STS), FUNCTION being the
`--model-name` flag (the function's name) or the manifest's. Keep `store_bucket` in step with the packager's
`bucket_name` (packager/targets/aws/resources.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.adapters.layout import NAME, AdapterLayout
from runtime.bundle import BundleError, Manifest, file_digest, read_manifest

if TYPE_CHECKING:
    from runtime.engine.engine import Engine

log = logging.getLogger("runtime.aws_lambda")
ADAPTERS_S3_ENV = "ONNXFN_ADAPTERS_S3"  # s3://BUCKET/adapters/FUNCTION/, when not the deploy's own bucket
ADAPTER_CACHE_ENV = "ONNXFN_ADAPTER_CACHE"  # where fetched adapters go (default /tmp/onnxfn-adapters)
DEFAULT_ADAPTER_CACHE = "/tmp/onnxfn-adapters"
INDEX_NAME = "index.json"
INDEX_FORMAT = 1
LAMBDA, SAGEMAKER = "aws-lambda", "aws-sagemaker"
SUFFIX = ".safetensors"  # runtime.adapters.files.SUFFIX: that module (safetensors, numpy) loads only when needed
_CHUNK = 8 << 20


def store_prefix(function: str) -> str:
    return f"adapters/{function}/"


def store_bucket(function: str, target: str, account: str, region: str) -> str:
    """The deploy's bucket name (packager.targets.aws.resources.bucket_name): the runtime never imports the packager."""
    name = f"onnxfn-{function}-{target.removeprefix('aws-')}-{account}-{region}".lower()
    return name.replace("_", "-")[:63].rstrip("-")


@dataclass(frozen=True)
class StoredAdapter:
    name: str
    key: str
    sha256: str  # hex
    size: int
    version_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "version_id": self.version_id, "sha256": self.sha256, "bytes": self.size}


def parse_index(raw: bytes) -> dict[str, StoredAdapter]:
    data = json.loads(raw)
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT or not isinstance(data.get("adapters"), dict):
        raise ValueError(f"not an adapter index of format {INDEX_FORMAT}")
    return {
        name: StoredAdapter(name, str(e["key"]), str(e["sha256"]), int(e["bytes"]), e.get("version_id") or None)
        for name, e in data["adapters"].items()
    }


def index_bytes(adapters: dict[str, StoredAdapter]) -> bytes:
    body = {"format": INDEX_FORMAT, "adapters": {n: a.to_json() for n, a in sorted(adapters.items())}}
    return json.dumps(body, indent=1, sort_keys=True).encode()


def read_index(s3: Any, bucket: str, prefix: str) -> dict[str, StoredAdapter]:
    """The store's adapters; empty when it has no index yet."""
    try:
        raw = s3.get_object(Bucket=bucket, Key=prefix + INDEX_NAME)["Body"].read()
    except s3.exceptions.NoSuchKey:
        return {}
    return parse_index(raw)


@dataclass
class SyncResult:
    directory: Path
    served: dict[str, str] = field(default_factory=dict)  # name -> sha256:HEX, in the directory and verified
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why


def sync_adapters(
    s3: Any, bucket: str, prefix: str, directory: Path, layout: AdapterLayout, *, bundled: frozenset[str] = frozenset()
) -> SyncResult:
    """Make `directory` hold exactly the store's verified adapters (files already there with the right digest stay)."""
    index = read_index(s3, bucket, prefix)
    directory.mkdir(parents=True, exist_ok=True)
    result = SyncResult(directory)
    for name, stored in sorted(index.items()):
        why = _fetch_one(s3, bucket, stored, directory, layout, bundled)
        if why is None:
            result.served[name] = f"sha256:{stored.sha256}"
        else:
            result.skipped[name] = why
            log.warning("adapter %r from s3://%s/%s skipped, not served: %s", name, bucket, stored.key, why)
    for path in directory.glob(f"*{SUFFIX}"):  # an earlier start in this sandbox, or a removed adapter
        if path.name.removesuffix(SUFFIX) not in result.served:
            path.unlink(missing_ok=True)
    return result


def _fetch_one(
    s3: Any, bucket: str, stored: StoredAdapter, directory: Path, layout: AdapterLayout, bundled: frozenset[str]
) -> str | None:
    """None once `directory/NAME.safetensors` is the verified adapter, else why it is not."""
    from runtime.adapters.files import AdapterFileError, AdapterMisfit, verify_adapter_file

    if not NAME.match(stored.name):
        return "not a valid adapter name"
    if stored.name in bundled:
        return "the bundle ships an adapter of that name"
    final = directory / f"{stored.name}{SUFFIX}"
    if final.is_file() and file_digest(final).sha256 == stored.sha256:
        return None
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".incoming-", suffix=SUFFIX)
    try:
        arguments = {"Bucket": bucket, "Key": stored.key}
        if stored.version_id:
            arguments["VersionId"] = stored.version_id
        try:
            body = s3.get_object(**arguments)["Body"]
        except Exception as exc:  # a missing object or version: this adapter only
            return f"cannot read it ({exc})"
        h, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            while size <= stored.size and (chunk := body.read(_CHUNK)):  # a longer object stops one chunk past
                h.update(chunk)
                out.write(chunk)
                size += len(chunk)
        if (size, h.hexdigest()) != (stored.size, stored.sha256):
            return (
                f"its bytes do not match the index: {size} bytes, sha256 {h.hexdigest()[:16]}…, expected "
                f"{stored.size} bytes, {stored.sha256[:16]}…"
            )
        try:
            verify_adapter_file(Path(tmp), layout, label=stored.key)  # values too: a non-finite one is refused
        except AdapterMisfit as exc:
            return f"does not fit this bundle's adapter inputs: {exc}"
        except AdapterFileError as exc:
            return f"not an adapter file: {exc}"
        os.replace(tmp, final)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---- start-up -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreLocation:
    bucket: str
    prefix: str
    why: str  # how it was found, for the log


def _s3_client(args: argparse.Namespace) -> Any:
    import boto3
    from botocore.config import Config

    region = getattr(args, "region", None) or os.environ.get("AWS_REGION") or None
    config = Config(connect_timeout=3, read_timeout=30, retries={"mode": "standard", "max_attempts": 3})
    return boto3.client("s3", endpoint_url=getattr(args, "endpoint_url", None), region_name=region, config=config)


@dataclass(frozen=True)
class _Fetched:
    bucket: str
    prefix: str
    directory: Path


_fetched: tuple[_Fetched, argparse.Namespace] | None = None  # what the init phase read (for `resync_adapters`)


def store_location(args: argparse.Namespace, manifest: Manifest, target: str) -> StoreLocation | None:
    """Where this function's adapter store is, or None (logged) when it cannot be told."""
    explicit = os.environ.get(ADAPTERS_S3_ENV, "").strip()
    if explicit:
        if not explicit.startswith("s3://") or "/" not in explicit[5:]:
            log.warning("adapters: $%s must be s3://BUCKET/PREFIX/, got %r: store not read", ADAPTERS_S3_ENV, explicit)
            return None
        bucket, _, prefix = explicit[5:].partition("/")
        return StoreLocation(bucket, prefix.rstrip("/") + "/", f"${ADAPTERS_S3_ENV}")
    function = getattr(args, "model_name", None) or manifest.function
    if target == LAMBDA:
        for uri, origin in ((os.environ.get("ONNXFN_BUNDLE_S3", ""), "$ONNXFN_BUNDLE_S3"),
                            (getattr(args, "ledger", None) or "", "--ledger")):  # fmt: skip
            if uri.startswith("s3://") and uri[5:].partition("/")[0]:
                return StoreLocation(uri[5:].partition("/")[0], store_prefix(function), f"the bucket of {origin}")
    import boto3

    session = boto3.session.Session()
    region = getattr(args, "region", None) or os.environ.get("AWS_REGION") or session.region_name
    if not region:
        log.warning("adapters: no AWS region ($AWS_REGION) to name the function's bucket by: store not read")
        return None
    sts = session.client("sts", region_name=region, endpoint_url=getattr(args, "endpoint_url", None))
    account = sts.get_caller_identity()["Account"]
    return StoreLocation(store_bucket(function, target, account, region), store_prefix(function), "the deploy's name")


def fetch_adapters(args: argparse.Namespace, bundle: Path, *, target: str) -> Path | None:
    """Before the engine loads: fetch the store's adapters and make their folder the engine's `adapter_dir`.

    Returns that folder, or None (logged why) when nothing is fetched; never raises for the store's sake.
    """
    global _fetched
    if getattr(args, "adapter_dir", None) is not None:
        log.info("adapters: --adapter-dir %s given, the function's adapter store is not read", args.adapter_dir)
        return None
    try:
        manifest = read_manifest(bundle)
    except BundleError as exc:
        log.info("adapters: the bundle's manifest cannot be read (%s): store not read", exc)  # the load says why
        return None
    if not manifest.adapters or "layout" not in manifest.adapters:
        log.info("adapters: the bundle's graph takes no adapters, the adapter store is not read")
        return None
    import botocore.exceptions

    started = time.monotonic()
    directory = Path(os.environ.get(ADAPTER_CACHE_ENV, DEFAULT_ADAPTER_CACHE))
    try:
        location = store_location(args, manifest, target)
        if location is None:
            return None
        result = sync_adapters(
            _s3_client(args), location.bucket, location.prefix, directory,
            AdapterLayout.from_json(manifest.adapters["layout"]),
            bundled=frozenset(manifest.adapters.get("bundled") or {}),
        )  # fmt: skip
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, ValueError, OSError) as exc:
        log.warning("adapters: the adapter store could not be read (%s): serving the bundle's adapters only", exc)
        return None
    args.adapter_dir = directory
    _fetched = (_Fetched(location.bucket, location.prefix, directory), args)
    where = f"s3://{location.bucket}/{location.prefix} ({location.why})"
    if result.served or result.skipped:
        log.info("adapters: %d fetched and verified from %s in %.2f s: %s%s", len(result.served), where,
                 time.monotonic() - started, ", ".join(result.served) or "none",
                 f"; {len(result.skipped)} skipped" if result.skipped else "")  # fmt: skip
    else:
        log.info("adapters: the adapter store %s is empty", where)
    return directory


def resync_adapters(engine: Engine) -> None:
    """After a SnapStart restore: the store may have changed since the snapshot (taken when the version was
    published). Fetch what is new and make the engine's catalog match the store; never raises."""
    adapters = getattr(engine, "adapters", None)
    if adapters is None or _fetched is None:
        return  # no adapter inputs, or no store read in the init phase
    import botocore.exceptions

    from runtime.adapters.files import AdapterFileError

    store, args = _fetched
    try:
        bundled = frozenset(e.name for e in adapters.catalog.entries() if e.bundled)
        result = sync_adapters(
            _s3_client(args), store.bucket, store.prefix, store.directory, adapters.catalog.layout, bundled=bundled
        )
        for name, digest in result.served.items():
            entry = adapters.catalog.get(name)
            if entry is None or entry.digest != digest:
                adapters.catalog.add(name, (store.directory / f"{name}{SUFFIX}").read_bytes(), digest)
        for entry in adapters.catalog.entries():
            if not entry.bundled and entry.name not in result.served:
                engine.remove_adapter(entry.name)
        log.info("adapters: re-read after the restore: %s", ", ".join(result.served) or "none")
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, ValueError, OSError,
            AdapterFileError, KeyError) as exc:  # fmt: skip
        log.warning("adapters: re-reading the store after the restore failed (%s): the snapshot's adapters serve", exc)
