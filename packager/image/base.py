"""The runtime base, built offline from Debian packages and PyPI wheels, cached by content.

Two layers per platform:
- `os`: `debootstrap --variant=minbase --include=python3` (python3-minimal lacks `json`), trimmed of
  what a server never reads (apt lists and caches, docs, man pages, logs) and of build-host traces
  (hostname, resolv.conf, dated shadow entries).
- `python-deps`: the runtime's import closure as wheels for the target platform (`pip install --target
  --platform --only-binary=:all: --no-deps`), pinned to the versions in this environment, pre-compiled
  to hash-checked `.pyc` so a container's cold start compiles nothing.

Each layer is keyed by what it is made of, so only a change of packages rebuilds it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packager.cache import cached_dir, digest_of, read_json, write_json
from packager.errors import UserError
from packager.image.layers import Entry, Layer, tree_entries, write_layer
from packager.image.platforms import Platform
from packager.paths import cache_root

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("ONNXFN_DEBIAN_MIRROR", "http://deb.debian.org/debian")
IMAGE_PYTHON = "3.11"  # bookworm's python3
PYTHON_DIR = "/opt/onnxfn/python"
BASE_VERSION = 1  # bump when trimming or layout changes, to rebuild cached layers

# What `runtime/` imports, closed over dependencies, minus what its code paths never import:
# onnxruntime's flatbuffers/protobuf/sympy/packaging serve its converters and tools, tokenizers'
# huggingface_hub serves `from_pretrained`. The image test proves the closure: it serves a chat.
RUNTIME_DISTRIBUTIONS = (
    "onnxruntime", "numpy", "tokenizers", "jinja2", "markupsafe", "starlette", "anyio", "idna",
    "typing_extensions", "uvicorn", "click", "h11", "httptools", "msgpack", "prometheus_client",
    # The queue worker and the Lambda handler (runtime/events) talk to SQS and S3.
    "boto3", "botocore", "s3transfer", "jmespath", "python_dateutil", "six", "urllib3",
    # LoRA adapter files (runtime/adapters/files.py).
    "safetensors",
)  # fmt: skip
# The Lambda entry point (the `lambda` command): the runtime interface client, SnapStart's hook registry and
# mangum (HTTP events into the ASGI app). Pinned as in pyproject's `lambda` extra.
LAMBDA_DISTRIBUTIONS = (
    "awslambdaric==3.1.1", "simplejson==3.20.1", "snapshot-restore-py==1.0.0", "mangum==0.22.0",
)  # fmt: skip
# Parts of installed wheels that serve development, never the runtime (`bin` holds scripts whose
# shebang names this host's python).
DEPS_PRUNE = (
    "bin", "**/tests", "numpy/_core/include", "numpy/f2py",
    "onnxruntime/transformers", "onnxruntime/quantization", "onnxruntime/tools", "onnxruntime/datasets",
)  # fmt: skip
# Deleted from the OS tree (globs): what a server never reads, and what would describe the build host.
# The three usr/share/doc globs delete every file but each package's `copyright`.
OS_TRIM = (
    "var/cache/apt/*", "var/lib/apt/lists/*", "var/cache/debconf/*-old", "var/lib/dpkg/*-old", "var/log/*",
    "var/cache/ldconfig/*", "usr/share/man/*", "usr/share/info/*", "usr/share/lintian/*", "usr/share/locale/*",
    "usr/share/doc/*/[!c]*", "usr/share/doc/*/c[!o]*", "usr/share/doc/*/co[!p]*", "etc/hostname",
    "etc/resolv.conf", "etc/hosts", "dev/*", "proc/*", "sys/*", "run/*", "tmp/*",
)  # fmt: skip


@dataclass(frozen=True)
class BaseLayers:
    os: Layer
    deps: Layer
    os_reused: bool
    deps_reused: bool


Report = Callable[[str], None]


def base_layers(platform: Platform, report: Report) -> BaseLayers:
    os_layer, os_reused = _cached_layer("image-os", _os_key(platform), "os", lambda d: _build_os(platform, d, report))
    requirements = runtime_requirements()
    deps_layer, deps_reused = _cached_layer(
        "image-deps",
        digest_of("deps", BASE_VERSION, platform.oci, IMAGE_PYTHON, requirements, DEPS_PRUNE),
        "python-deps",
        lambda d: _build_deps(platform, requirements, d, report),
    )
    return BaseLayers(os_layer, deps_layer, os_reused, deps_reused)


def runtime_requirements() -> list[str]:
    """`name==version` for the runtime's closure, pinned to this environment so the image runs what was tested."""
    pinned = []
    for name in RUNTIME_DISTRIBUTIONS:
        try:
            pinned.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError as exc:
            raise UserError(f"{name} is not installed here; install onnxfn's runtime dependencies first") from exc
    return pinned + list(LAMBDA_DISTRIBUTIONS)


def _os_key(platform: Platform) -> str:
    return digest_of("os", BASE_VERSION, DEBIAN_SUITE, DEBIAN_MIRROR, platform.debian_arch, OS_TRIM)


def _cached_layer(kind: str, key: str, name: str, make_tree: Callable[[Path], None]) -> tuple[Layer, bool]:
    """A layer blob cached under `kind/key`: `make_tree(dir)` fills a scratch tree, which becomes the blob."""

    def produce(entry: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=f"onnxfn-{name}-") as scratch:
            tree = Path(scratch) / "tree"
            tree.mkdir()
            make_tree(tree)
            layer = write_layer(_layer_entries(name, tree), entry / "layer.tar.gz", name)
            write_json(entry / "layer.json", {**layer.to_json(), "path": "layer.tar.gz"})

    entry, reused = cached_dir(kind, key, produce)
    data = read_json(entry / "layer.json")
    return Layer.from_json({**data, "path": str(entry / data["path"])}), reused


def _layer_entries(name: str, tree: Path) -> Iterator[Entry]:
    return tree_entries(tree, "/" if name == "os" else PYTHON_DIR)


def _prune(tree: Path, patterns: tuple[str, ...]) -> None:
    for pattern in patterns:
        for path in sorted(tree.glob(pattern), reverse=True):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()


def _build_os(platform: Platform, tree: Path, report: Report) -> None:
    if shutil.which("debootstrap") is None:
        raise UserError(
            "debootstrap is not installed: run scripts/setup_image_tools.sh (or apt-get install debootstrap)"
        )
    report(f"debootstrap {DEBIAN_SUITE} {platform.debian_arch} (first build only)")
    # Downloaded .debs are kept apart from the tree, so a rebuild of this layer does not download again.
    debs = cache_root() / "image-debs" / f"{DEBIAN_SUITE}-{platform.debian_arch}"
    debs.mkdir(parents=True, exist_ok=True)
    command = [
        "debootstrap", "--variant=minbase", "--include=python3", f"--arch={platform.debian_arch}",
        f"--cache-dir={debs}", DEBIAN_SUITE, str(tree), DEBIAN_MIRROR,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        log = (tree / "debootstrap" / "debootstrap.log").read_text() if (tree / "debootstrap").is_dir() else ""
        detail = "\n".join((result.stderr + log).strip().splitlines()[-15:])
        raise UserError(
            f"debootstrap of {DEBIAN_SUITE}/{platform.debian_arch} from {DEBIAN_MIRROR} failed "
            f"(exit {result.returncode}); last lines:\n{detail}\n"
            + (
                "foreign architectures need qemu-user-static and binfmt_misc: scripts/setup_image_tools.sh"
                if platform.foreign
                else ""
            )
        )
    _prune(tree, OS_TRIM)
    _scrub_os(tree)


def _scrub_os(tree: Path) -> None:
    """Drop the build date from /etc/shadow (days since 1970 of the last password change)."""
    shadow = tree / "etc" / "shadow"
    lines = []
    for line in shadow.read_text().splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[2]:
            fields[2] = "0"
        lines.append(":".join(fields))
    shadow.write_text("\n".join(lines) + "\n")
    shutil.rmtree(tree / "debootstrap", ignore_errors=True)


def _build_deps(platform: Platform, requirements: list[str], tree: Path, report: Report) -> None:
    report(f"pip install --target for {platform.oci} ({len(requirements)} wheels)")
    install_wheels(tree, requirements, python=IMAGE_PYTHON, wheel_tags=platform.wheel_tags, where=platform.oci)
    compile_tree(tree, PYTHON_DIR)


def install_wheels(tree: Path, requirements: list[str], *, python: str, wheel_tags: Sequence[str], where: str) -> None:
    """`pip install --target tree` of `requirements` as wheels for another machine (CPython `python`, the
    platform tags `wheel_tags`), without their dependencies (`requirements` is the whole closure), then
    `DEPS_PRUNE` removed. Shared by the image's dependency layer and the Lambda zip."""
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
        "--no-compile", "--only-binary=:all:", "--target", str(tree), "--python-version", python,
        "--implementation", "cp", "--abi", f"cp{python.replace('.', '')}",
        *(arg for tag in wheel_tags for arg in ("--platform", tag)), *requirements,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"pip could not install the runtime's wheels for {where}:\n{result.stderr.strip()[-2000:]}")
    _prune(tree, DEPS_PRUNE)


def compile_tree(tree: Path, image_dir: str) -> None:
    """Pre-compile `tree` (which sits at `image_dir` in the image) to hash-checked `.pyc`.

    The bytes never depend on this host: source paths are the in-image ones, validity is checked by
    source hash rather than mtime, and PYTHONHASHSEED fixes the order of set constants in code objects.
    """
    if f"{sys.version_info.major}.{sys.version_info.minor}" != IMAGE_PYTHON:
        return  # other bytecode magic: the image's python compiles on first import instead
    command = [
        sys.executable, "-m", "compileall", "-q", "-j", "0", "-d", image_dir,
        "--invalidation-mode", "unchecked-hash", str(tree),
    ]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, "PYTHONHASHSEED": "0"}, stdout=subprocess.DEVNULL)
