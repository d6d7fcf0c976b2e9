"""The Greengrass v2 component: its artifacts (files put in S3) and its recipe (format 2020-01-25).

Artifacts are named by their content (`bundle-<sha>.tar`, `runtime-<sha>.zip`, …), so a new component version
never overwrites a file an older version points at: Greengrass can roll back to it. Each artifact carries
its digest as Greengrass checks it: base64 of the raw SHA-256 (`java.util.Base64` of `MessageDigest`).

The lifecycle: `Install` puts the runtime's dependencies (pinned as tested here) into the work folder once
per requirements file; `Run` starts the launcher (`runtime/agent/greengrass_launcher.py`), which runs the edge
agent and hands it the bundle, or becomes the queue worker. Port, token and queue are component configuration, so a
deployment can override them per thing group.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import shlex
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packager.edge.archive import BundleArchive
from packager.errors import UserError
from packager.image.app_layer import RUNTIME_SOURCE
from packager.image.base import LAMBDA_DISTRIBUTIONS, runtime_requirements
from runtime.bundle import file_digest

LAUNCHER_MODULE = "runtime.agent.greengrass_launcher"  # runs on the core device: stdlib and `runtime` only
RECIPE_FORMAT = "2020-01-25"
ARCHITECTURES = ("amd64", "aarch64")
TOKEN_EXCHANGE = "aws.greengrass.TokenExchangeService"
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class Artifact:
    path: Path  # the local file
    name: str  # its file name in S3 and on the device
    sha256: str  # hex
    size: int
    unarchive: str = "NONE"  # or ZIP: Greengrass unpacks it into {artifacts:decompressedPath}/<name without .zip>

    @property
    def greengrass_digest(self) -> str:
        return base64.b64encode(bytes.fromhex(self.sha256)).decode()

    @property
    def stem(self) -> str:
        return self.name.removesuffix(".zip")


@dataclass(frozen=True)
class Artifacts:
    bundle: Artifact
    runtime: Artifact
    requirements: Artifact
    launcher: Artifact
    bundle_digest: str  # the manifest digest inside the archive

    def all(self) -> tuple[Artifact, ...]:
        return self.bundle, self.runtime, self.requirements, self.launcher


def file_artifact(path: Path, prefix: str, suffix: str, *, unarchive: str = "NONE") -> Artifact:
    digest = file_digest(path).sha256
    return Artifact(path, f"{prefix}-{digest[:16]}{suffix}", digest, path.stat().st_size, unarchive)


def build_artifacts(archive: BundleArchive, out_dir: Path) -> Artifacts:
    """The runtime zip, requirements and launcher written to `out_dir`; the bundle is the push client's archive."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runtime_zip = out_dir / "runtime.zip"
    _write_runtime_zip(runtime_zip)
    requirements = out_dir / "requirements.txt"
    lambda_only = {line.split("==")[0] for line in LAMBDA_DISTRIBUTIONS}
    pins = [line for line in runtime_requirements() if line.split("==")[0] not in lambda_only]
    requirements.write_text("\n".join(pins) + "\n")
    launcher = _module_file(LAUNCHER_MODULE)
    bundle = Artifact(archive.path, f"bundle-{archive.sha256[:16]}.tar", archive.sha256, archive.size)
    return Artifacts(
        bundle=bundle,
        runtime=file_artifact(runtime_zip, "runtime", ".zip", unarchive="ZIP"),
        requirements=file_artifact(requirements, "requirements", ".txt"),
        launcher=file_artifact(launcher, "onnxfn_greengrass", ".py"),
        bundle_digest=archive.manifest.digest,
    )


def _write_runtime_zip(target: Path) -> None:
    """The `runtime` package as a reproducible zip: same sources, same bytes, same artifact name."""
    tmp = target.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(RUNTIME_SOURCE.rglob("*.py")):
            info = zipfile.ZipInfo(f"runtime/{path.relative_to(RUNTIME_SOURCE).as_posix()}", _ZIP_TIME)
            info.external_attr = 0o644 << 16
            archive.writestr(info, path.read_bytes(), compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(target)


@dataclass(frozen=True)
class ComponentSettings:
    name: str
    function: str
    mode: str  # agent | worker
    port: int
    token_file: str
    token_secret: str
    queue_url: str
    region: str
    install_timeout: int
    runtime_flags: tuple[str, ...]


def recipe(settings: ComponentSettings, artifacts: Artifacts, uris: dict[str, str], version: str) -> dict[str, Any]:
    """The recipe; `uris` maps each artifact's name to its `s3://` URI."""
    deps = f"{{work:path}}/python-{artifacts.requirements.sha256[:16]}"
    install = (
        f'set -e; deps="{deps}"; if [ ! -f "$deps/.complete" ]; then rm -rf "$deps.tmp"; '
        "python3 -m pip install --disable-pip-version-check --no-cache-dir --quiet "
        f'--target "$deps.tmp" -r {{artifacts:path}}/{artifacts.requirements.name}; '
        'touch "$deps.tmp/.complete"; rm -rf "$deps"; mv "$deps.tmp" "$deps"; fi'
    )
    run = " ".join([
        "python3 -u", f"{{artifacts:path}}/{artifacts.launcher.name}",
        "--mode {configuration:/Mode}", f"--archive {{artifacts:path}}/{artifacts.bundle.name}",
        f"--archive-sha256 {artifacts.bundle.sha256}", f"--bundle-digest {artifacts.bundle_digest}",
        "--work {work:path}", "--port {configuration:/Port}", "--token-file '{configuration:/TokenFile}'",
        "--token-secret '{configuration:/TokenSecret}'", "--queue-url '{configuration:/QueueUrl}'",
        f"--region '{settings.region}'", "--", *(shlex.quote(flag) for flag in settings.runtime_flags),
    ])  # fmt: skip
    lifecycle = {
        "Setenv": {"PYTHONPATH": f"{{artifacts:decompressedPath}}/{artifacts.runtime.stem}:{deps}"},
        "Install": {"Script": install, "Timeout": settings.install_timeout},
        "Run": {"Script": run},
    }
    listed = [
        {
            "Uri": uris[artifact.name],
            "Digest": artifact.greengrass_digest,
            "Algorithm": "SHA-256",
            "Unarchive": artifact.unarchive,
            "Permission": {"Read": "OWNER", "Execute": "NONE"},
        }
        for artifact in artifacts.all()
    ]
    document: dict[str, Any] = {
        "RecipeFormatVersion": RECIPE_FORMAT,
        "ComponentName": settings.name,
        "ComponentVersion": version,
        "ComponentType": "aws.greengrass.generic",
        "ComponentDescription": f"onnxfn function {settings.function} ({settings.mode}), "
        f"bundle {artifacts.bundle_digest[:19]}",
        "ComponentPublisher": "onnxfn",
        "ComponentConfiguration": {
            "DefaultConfiguration": {
                "Mode": settings.mode,
                "Port": settings.port,
                "TokenFile": settings.token_file,
                "TokenSecret": settings.token_secret,
                "QueueUrl": settings.queue_url,
            }
        },
        "Manifests": [
            {
                "Name": f"Linux {architecture}",
                "Platform": {"os": "linux", "architecture": architecture},
                "Lifecycle": lifecycle,
                "Artifacts": listed,
            }
            for architecture in ARCHITECTURES
        ],
    }
    if settings.token_secret or settings.mode == "worker":
        # AWS credentials for the device's process (Secrets Manager, SQS, S3) come from this component.
        document["ComponentDependencies"] = {
            TOKEN_EXCHANGE: {"VersionRequirement": ">=2.0.0 <3.0.0", "DependencyType": "HARD"}
        }
    return document


def recipe_digest(document: dict[str, Any]) -> str:
    """What identifies the component's content: the recipe without its version."""
    content = {k: v for k, v in document.items() if k != "ComponentVersion"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:32]


def _module_file(module: str) -> Path:
    """The source file of a runtime module, found without importing it: the packager ships it, never owns it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise UserError(f"cannot find {module}: reinstall onnxfn (`pip install -e .`)")
    return Path(spec.origin)
