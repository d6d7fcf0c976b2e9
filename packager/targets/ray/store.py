"""The bundle in the store every node fetches from, content-addressed: `STORE/bundles/HEX/` holds the files the
manifest lists, the manifest last, so a prefix with its manifest is complete. An upload is skipped when the
manifest is there already (the same digest is the same bytes).

The store is `s3://BUCKET/PREFIX` (nodes read it with their own credentials; the bucket is the user's, never
created or deleted here) or a folder every node mounts (NFS, EFS, a shared volume). Nodes fetch from it into
their own cache and verify each file against the manifest (`runtime.bundle_fetch`): a store holds no trust.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from packager.errors import UserError
from packager.spec import FunctionSpec
from runtime.bundle import MANIFEST_NAME, read_manifest
from runtime.ray_serve.settings import BUNDLES


def location(store: str, digest: str) -> str:
    return f"{store.rstrip('/')}/{BUNDLES}/{digest.removeprefix('sha256:')}/"


def files(bundle: Path) -> list[tuple[str, Path]]:
    """(name, path) of every file to upload, the manifest last."""
    manifest = read_manifest(bundle)
    return [(name, bundle / name) for name in sorted(manifest.files)] + [(MANIFEST_NAME, bundle / MANIFEST_NAME)]


def present(spec: FunctionSpec, store: str, digest: str) -> bool:
    """Whether the store holds this bundle whole (its manifest is there)."""
    where = location(store, digest)
    if not where.startswith("s3://"):
        return (Path(where) / MANIFEST_NAME).is_file()
    from packager.targets.aws import common as aws

    context = _s3_context(spec)
    bucket, _, prefix = where[5:].partition("/")
    with aws.aws_errors(context, f"look for the bundle in {where}"):
        found = aws.if_exists(
            lambda: context.client("s3").head_object(Bucket=bucket, Key=prefix + MANIFEST_NAME), "404", "NoSuchKey"
        )
    return found is not None


def upload(spec: FunctionSpec, bundle: Path, store: str, digest: str) -> int:
    """Put the bundle into the store under its digest; the bytes written."""
    where = location(store, digest)
    listed = files(bundle)
    if not where.startswith("s3://"):
        return _copy(listed, Path(where))
    from packager.targets.aws import common as aws

    context = _s3_context(spec)
    bucket, _, prefix = where[5:].partition("/")
    with aws.aws_errors(context, f"upload the bundle to {where}"):
        s3 = context.client("s3")
        for name, path in listed:
            s3.upload_file(str(path), bucket, prefix + name)
    return sum(path.stat().st_size for _, path in listed)


def _copy(listed: list[tuple[str, Path]], folder: Path) -> int:
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        for name, path in listed:
            (partial / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, partial / name)
        shutil.rmtree(folder, ignore_errors=True)
        partial.replace(folder)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(f"cannot write the bundle into the shared store {folder}: {exc}") from exc
    return sum(path.stat().st_size for _, path in listed)


def _s3_context(spec: FunctionSpec):  # type: ignore[no-untyped-def]
    from packager.targets.aws import common as aws

    settings = spec.targets.ray
    endpoint = settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
    return aws.connect("ray", settings.region, endpoint)
