"""Install an uploaded bundle, roll back to the previous one, and recover at start.

An install runs: archive digest → unpack into staging → verify every file against the manifest → move
into `bundles/` → fresh engine + smoke generation → switch `current` → swap the served app. Any failure
before the switch leaves the served bundle and the `current` link untouched. One install or rollback
runs at a time; a second one gets 409.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from runtime.agent.history import History
from runtime.agent.layout import CURRENT, PREVIOUS, BundleRoot
from runtime.agent.serving import LoadError, Serving, ServingSlot
from runtime.agent.unpack import UnsafeArchiveError, unpack
from runtime.agent.uploads import UploadStore
from runtime.bundle import Bundle, BundleError, read_manifest
from runtime.verified import open_verified

log = logging.getLogger("runtime.agent")
LoadServing = Callable[[Bundle], Serving]


class InstallRefused(Exception):
    """The install or rollback did not happen; the served bundle is unchanged. `status` is the HTTP status."""

    def __init__(self, status: int, message: str, *, code: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.offset = offset


@dataclass
class InstallReport:
    action: str  # installed, unchanged, rolled_back
    function: str
    digest: str
    bundle: str  # the folder name under bundles/
    previous_digest: str | None
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "phases": {k: round(v, 4) for k, v in self.phases.items()}}


def bundle_name(digest: str) -> str:
    return digest.removeprefix("sha256:")[:16]


class Installer:
    def __init__(
        self, root: BundleRoot, uploads: UploadStore, slot: ServingSlot, history: History, load: LoadServing
    ) -> None:
        self.root = root
        self.uploads = uploads
        self.slot = slot
        self.history = history
        self._load = load
        self._lock = threading.Lock()
        self.phase: str | None = None  # what a running install is doing, for /agent/status

    def install(self, upload_id: str) -> tuple[InstallReport, Serving | None]:
        """Install the complete upload `upload_id`; returns the report and the app it replaced (to drain)."""
        with self._exclusive():
            try:
                return self._install(upload_id)
            except InstallRefused as exc:
                self.history.record("refused", upload=upload_id, code=exc.code, reason=str(exc))
                raise

    def rollback(self) -> tuple[InstallReport, Serving | None]:
        with self._exclusive():
            back = self.root.pointer(PREVIOUS)
            if back is None:
                raise InstallRefused(409, "there is no previous bundle to roll back to", code="no_previous")
            phases: dict[str, float] = {}
            with self._timed(phases, "verify"):
                bundle = self._verified(back)
            serving = self._load_checked(bundle, phases)
            with self._timed(phases, "switch"):
                self.root.swap_with_previous()
                old = self.slot.swap(serving)
            report = self._report("rolled_back", bundle, old, phases)
            self.history.record("rolled_back", digest=report.digest, previous=report.previous_digest)
            return report, old

    def recover(self) -> None:
        """At start: serve `current`, else `previous` (making it current); whatever a crash left behind."""
        with self._exclusive():
            self.phase = "recover"
            self.root.prepare()
            self._recover()

    def _recover(self) -> None:
        reasons = []
        for pointer in (CURRENT, PREVIOUS):
            path = self.root.pointer(pointer)
            if path is None:
                continue
            try:
                serving = self._load(self._verified(path))
            except (InstallRefused, LoadError) as exc:
                reasons.append(f"{pointer} ({path.name}): {exc}")
                self.history.record("start_failed", bundle=path.name, reason=str(exc))
                continue
            if pointer == PREVIOUS:
                self.root.swap_with_previous()
                self.history.record("recovered", digest=serving.bundle.manifest.digest, reason="; ".join(reasons))
            self.slot.swap(serving)
            log.info("serving %s (%s)", serving.bundle.manifest.function, serving.bundle.manifest.digest)
            return
        if reasons:
            self.slot.unavailable("failed", "; ".join(reasons))
        else:
            self.slot.unavailable("empty", "no bundle installed")

    def _install(self, upload_id: str) -> tuple[InstallReport, Serving | None]:
        state = self.uploads.state(upload_id)
        if state is None:
            raise InstallRefused(404, f"no upload {upload_id}: upload the archive first", code="unknown_upload")
        if not state.complete:
            raise InstallRefused(
                409,
                f"the upload has {state.offset} of {state.size} bytes: send the rest first",
                code="incomplete_upload",
                offset=state.offset,
            )
        phases: dict[str, float] = {}
        with self._timed(phases, "digest"):
            actual = self.uploads.digest(upload_id)
        if actual != upload_id:
            self.uploads.discard(upload_id)
            raise InstallRefused(
                422,
                f"the received archive has sha256 {actual}, not {upload_id}: it was altered in transit; push again",
                code="digest_mismatch",
            )
        staging = self.root.new_staging("incoming")
        try:
            with self._timed(phases, "unpack"):
                unpack(self.uploads.part(upload_id), staging)
            with self._timed(phases, "verify"):
                manifest = self._verified(staging).manifest
            name = bundle_name(manifest.digest)
            current = self.slot.current
            if current is not None and current.bundle.manifest.digest == manifest.digest:
                self.uploads.discard(upload_id)
                return self._report("unchanged", current.bundle, current, phases), None
            with self._timed(phases, "commit"):
                path = self.root.commit(staging, name)
        except UnsafeArchiveError as exc:
            self.uploads.discard(upload_id)
            raise InstallRefused(422, f"archive refused: {exc}", code="unsafe_archive") from exc
        except InstallRefused:
            self.uploads.discard(upload_id)  # the same archive would be refused again
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        try:
            serving = self._load_checked(Bundle(path, manifest), phases)
        except InstallRefused:
            self.root.collect_garbage()  # the new folder, unless it is also `previous`
            raise
        with self._timed(phases, "switch"):
            self.root.switch(path)
            old = self.slot.swap(serving)
        self.root.collect_garbage()
        self.uploads.discard(upload_id)
        report = self._report("installed", serving.bundle, old, phases)
        self.history.record(
            "installed", digest=report.digest, function=report.function, previous=report.previous_digest,
            phases=report.to_json()["phases"],
        )  # fmt: skip
        return report, old

    def _verified(self, path: Any) -> Bundle:
        try:
            return open_verified(path, self.root.verified)[0]
        except BundleError as exc:
            raise InstallRefused(422, f"bundle refused: {exc}", code="invalid_bundle") from exc

    def _load_checked(self, bundle: Bundle, phases: dict[str, float]) -> Serving:
        try:
            with self._timed(phases, "load_and_smoke"):
                return self._load(bundle)
        except LoadError as exc:
            raise InstallRefused(422, f"bundle refused: {exc}", code=exc.code) from exc

    def _report(self, action: str, bundle: Bundle, old: Serving | None, phases: dict[str, float]) -> InstallReport:
        previous = None if old is None or old.bundle.path == bundle.path else old.bundle.manifest.digest
        return InstallReport(
            action=action,
            function=bundle.manifest.function,
            digest=bundle.manifest.digest,
            bundle=bundle.path.name,
            previous_digest=previous,
            phases=phases,
        )

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise InstallRefused(409, f"another install is running ({self.phase}); retry when it ends", code="busy")
        try:
            yield
        finally:
            self.phase = None
            self._lock.release()

    @contextmanager
    def _timed(self, phases: dict[str, float], name: str) -> Iterator[None]:
        self.phase = name
        started = time.perf_counter()
        try:
            yield
        finally:
            phases[name] = time.perf_counter() - started

    def describe(self, pointer: str) -> dict[str, Any] | None:
        path = self.root.pointer(pointer)
        if path is None:
            return None
        try:
            manifest = read_manifest(path)
        except BundleError as exc:
            return {"bundle": path.name, "error": str(exc)}
        return {
            "bundle": path.name,
            "function": manifest.function,
            "digest": manifest.digest,
            "spec_digest": manifest.spec_digest,
            "precision": manifest.precision,
            "installed_at": path.stat().st_mtime,
        }
