"""The Lambda zip package: the `runtime` package and its dependencies for the managed Python runtime.

What SnapStart needs (it exists for zip packages on the managed runtimes, not for container images). The zip
holds no bundle: the bundle goes to the function's bucket, content-addressed by its digest, and the handler
fetches and verifies it in the init phase (`runtime.aws_lambda.bundle_fetch`), before the snapshot.

Dependencies are the wheels for the function's platform (`pip install --target --platform ... --only-binary`),
pinned to the versions installed here so the function runs what was tested. boto3 and awslambdaric come with
the managed runtime; torch is never a runtime dependency. The zip is written deterministically (sorted entries,
fixed timestamps), so the same inputs give the same bytes and the same S3 key.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packager.errors import UserError
from packager.image.base import install_wheels

LAMBDA_PYTHON = "3.12"  # the managed runtime: SnapStart for Python starts at python3.12
HANDLER = "runtime.aws_lambda.handler.handler"
# Lambda's limit for a zip package: the function and its layers together, unpacked.
ZIP_LIMIT_BYTES = 262_144_000  # 250 MB
RUNTIME_SOURCE = Path(__file__).resolve().parents[3] / "runtime"
ZIP_FORMAT = 1  # bump when the zip's layout changes, to rebuild cached zips
# What the handler imports: the runtime's closure (as the image's, minus boto3's closure, which the managed
# runtime provides, and uvicorn's, which serves sockets Lambda never opens), plus mangum for HTTP events and
# SnapStart's hook registry (the managed runtime carries one too; the same module name is imported once).
ZIP_DISTRIBUTIONS = (
    "onnxruntime", "numpy", "tokenizers", "jinja2", "markupsafe", "starlette", "anyio", "idna",
    "typing_extensions", "msgpack", "prometheus_client", "mangum", "snapshot-restore-py",
)  # fmt: skip
# Wheel tags the managed runtime (Amazon Linux 2023, glibc 2.34) accepts, newest first.
ZIP_WHEEL_TAGS = {
    "x86_64": ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux2014_x86_64"),
    "arm64": ("manylinux_2_34_aarch64", "manylinux_2_28_aarch64", "manylinux2014_aarch64"),
}


@dataclass(frozen=True)
class ZipPackage:
    path: Path
    sha256: str  # hex
    unpacked_bytes: int
    reused: bool

    @property
    def code_sha256(self) -> str:
        """How Lambda reports the package (`CodeSha256`): base64 of the zip's sha256."""
        return base64.b64encode(bytes.fromhex(self.sha256)).decode()

    @property
    def key(self) -> str:
        return f"code/{self.sha256}.zip"


def zip_requirements() -> list[str]:
    pinned = []
    for name in ZIP_DISTRIBUTIONS:
        try:
            pinned.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError as exc:
            raise UserError(f"{name} is not installed here; install onnxfn's runtime and lambda extras first") from exc
    return pinned


def _source_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(RUNTIME_SOURCE.rglob("*.py")):
        h.update(path.relative_to(RUNTIME_SOURCE).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def build_zip(out_dir: Path, architecture: str, python: str = LAMBDA_PYTHON) -> ZipPackage:
    """The zip for `architecture` and `python` in `out_dir` (reused when its inputs are unchanged)."""
    requirements = zip_requirements()
    key = hashlib.sha256(
        json.dumps([ZIP_FORMAT, requirements, architecture, python, _source_digest()]).encode()
    ).hexdigest()[:16]
    path = out_dir / f"function-{key}.zip"
    record = path.with_suffix(".json")
    if path.is_file() and record.is_file():
        facts = json.loads(record.read_text())
        return ZipPackage(path, facts["sha256"], facts["unpacked_bytes"], reused=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="onnxfn-lambda-zip-") as scratch:
        tree = Path(scratch) / "tree"
        _install(tree, requirements, architecture, python)
        shutil.copytree(RUNTIME_SOURCE, tree / "runtime", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        part = path.with_suffix(f".{os.getpid()}.part")
        unpacked = _write_zip(tree, part)
    part.replace(path)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    part_record = record.with_suffix(f".{os.getpid()}.part")
    part_record.write_text(json.dumps({"sha256": sha, "unpacked_bytes": unpacked, "requirements": requirements}))
    part_record.replace(record)
    return ZipPackage(path, sha, unpacked, reused=False)


def _install(tree: Path, requirements: list[str], architecture: str, python: str) -> None:
    where = f"Lambda python{python} {architecture}"
    install_wheels(tree, requirements, python=python, wheel_tags=ZIP_WHEEL_TAGS[architecture], where=where)


def _write_zip(tree: Path, out: Path) -> int:
    """Sorted entries, fixed timestamps, 0644/0755 modes; returns the unpacked size in bytes."""
    unpacked = 0
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
        for path in sorted(p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()):
            info = zipfile.ZipInfo(path.relative_to(tree).as_posix(), date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            mode = 0o755 if path.stat().st_mode & 0o111 else 0o644
            info.external_attr = (0o100000 | mode) << 16
            with path.open("rb") as source, archive.open(info, "w") as target:
                shutil.copyfileobj(source, target, 1 << 20)
            unpacked += path.stat().st_size
    return unpacked


def check_fits(package: ZipPackage) -> None:
    """Lambda's limit on a zip package (function and layers, unpacked). Whether `/tmp`, where the init phase puts
    the bundle, holds it was checked before the package was built (packager/sizes.py)."""
    mb = 1_000_000
    if package.unpacked_bytes > ZIP_LIMIT_BYTES:
        raise UserError(
            f"the zip package does not fit: it unpacks to {package.unpacked_bytes / mb:.0f} MB, over Lambda's "
            f"{ZIP_LIMIT_BYTES / mb:.0f} MB limit for a zip package (function and layers, unpacked)\nuse package = "
            '"image" in [targets.aws-lambda] (a container image holds up to 10 GB; provisioned_concurrency keeps '
            "instances warm instead of SnapStart)",
            exit_code=2,
        )
