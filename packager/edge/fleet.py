"""Push one bundle archive to many devices at once (one thread each), or roll them back.

A device that fails never stops the others: each gets a `DeviceResult`, and the caller shows them all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from packager.edge.archive import BundleArchive
from packager.edge.client import AgentClient, AgentError, DeviceAuth
from packager.sizes import device_refusal

MAX_PARALLEL = 16
# (device, phase, bytes the device holds, total bytes): the CLI draws a progress bar per device from it.
Progress = Callable[[str, str, int, int], None]


@dataclass(frozen=True)
class DeviceResult:
    device: str
    # installed, unchanged, rolled_back, added, removed, listed; refused, unreachable, unauthorized, tls, failed
    outcome: str
    digest: str = ""  # what the device serves afterwards, when known
    resumed_from: int = 0
    sent: int = 0
    upload_seconds: float = 0.0
    install_seconds: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome in ("installed", "unchanged", "rolled_back", "added", "removed", "listed")


def push(
    devices: Sequence[str], archive: BundleArchive, auth: DeviceAuth, progress: Progress, chunk_bytes: int
) -> list[DeviceResult]:
    return _fan_out(devices, lambda device: _push_one(device, archive, auth, progress, chunk_bytes))


def rollback(devices: Sequence[str], auth: DeviceAuth, progress: Progress) -> list[DeviceResult]:
    return _fan_out(devices, lambda device: _rollback_one(device, auth, progress))


def add_adapter(
    devices: Sequence[str], name: str, data: bytes, digest: str, auth: DeviceAuth, progress: Progress
) -> list[DeviceResult]:
    """Send one adapter file to every device's agent (which checks `digest`, stores it and serves it at once)."""

    def one(device: str) -> DeviceResult:
        with AgentClient(device, auth) as client:
            progress(device, "adapter", 0, len(data))
            started = time.perf_counter()
            client.put_adapter(name, data, digest)
            progress(device, "done", len(data), len(data))
            return DeviceResult(device, "added", digest, sent=len(data), upload_seconds=time.perf_counter() - started)

    return _fan_out(devices, one)


def remove_adapter(devices: Sequence[str], name: str, auth: DeviceAuth) -> list[DeviceResult]:
    def one(device: str) -> DeviceResult:
        with AgentClient(device, auth) as client:
            client.delete_adapter(name)
            return DeviceResult(device, "removed")

    return _fan_out(devices, one)


def list_adapters(devices: Sequence[str], auth: DeviceAuth) -> list[tuple[DeviceResult, list[dict[str, Any]]]]:
    """Each device's adapters; a device that cannot be asked has none and says why in its result."""
    found: dict[str, list[dict[str, Any]]] = {}

    def one(device: str) -> DeviceResult:
        with AgentClient(device, auth) as client:
            found[device] = client.adapters()
            return DeviceResult(device, "listed")

    return [(result, found.get(result.device, [])) for result in _fan_out(devices, one)]


def _fan_out(devices: Sequence[str], work: Callable[[str], DeviceResult]) -> list[DeviceResult]:
    def guarded(device: str) -> DeviceResult:
        try:
            return work(device)
        except AgentError as exc:
            return DeviceResult(device, exc.kind, detail=exc.reason)

    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(devices)), thread_name_prefix="onnxfn-push") as pool:
        return list(pool.map(guarded, devices))


def _push_one(
    device: str, archive: BundleArchive, auth: DeviceAuth, progress: Progress, chunk_bytes: int
) -> DeviceResult:
    with AgentClient(device, auth, chunk_bytes=chunk_bytes) as client:
        progress(device, "connecting", 0, archive.size)
        status = client.status()
        current = status.get("current") or {}
        if current.get("digest") == archive.manifest.digest:
            progress(device, "up to date", archive.size, archive.size)
            return DeviceResult(device, "unchanged", archive.manifest.digest, detail="already serving this bundle")
        refusal = device_refusal(archive.manifest, status.get("memory") or {})
        if refusal is not None:  # before a byte is sent: the upload alone could take minutes
            progress(device, "refused", 0, archive.size)
            return DeviceResult(device, "refused", str(current.get("digest") or ""), detail=refusal)
        started = time.perf_counter()
        upload = client.upload(
            archive.path, archive.sha256, lambda held: progress(device, "upload", held, archive.size)
        )
        uploaded = time.perf_counter()
        progress(device, "install", archive.size, archive.size)
        report = client.install(archive.sha256)
        progress(device, "done", archive.size, archive.size)
        phases = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in report.get("phases", {}).items())
        return DeviceResult(
            device,
            report["action"],
            report["digest"],
            resumed_from=upload.resumed_from,
            sent=upload.sent,
            upload_seconds=uploaded - started,
            install_seconds=time.perf_counter() - uploaded,
            detail=phases,
        )


def _rollback_one(device: str, auth: DeviceAuth, progress: Progress) -> DeviceResult:
    with AgentClient(device, auth) as client:
        progress(device, "rollback", 0, 1)
        started = time.perf_counter()
        report = client.rollback()
        progress(device, "done", 1, 1)
        return DeviceResult(
            device,
            report["action"],
            report["digest"],
            install_seconds=time.perf_counter() - started,
            detail=f"was {report.get('previous_digest') or '-'}",
        )
