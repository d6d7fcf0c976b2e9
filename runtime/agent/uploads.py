"""Resumable uploads of a bundle archive, in the manner of tus and OCI blob uploads.

An upload is named by the sha256 of the whole archive, so a client that was interrupted (or a pusher
restarted from scratch) finds its upload again. The received bytes are appended to `ID.part`; its size
*is* the offset, so an agent killed mid-write resumes from exactly the bytes that reached the disk.
`ID.json` records the archive's announced size, written once when the upload starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

# Matched with fullmatch: `$` would admit a final newline, and the id names files in uploads/.
UPLOAD_ID = re.compile(r"[0-9a-f]{64}")
# At most 19 ASCII digits each (10**19 bytes is beyond any archive), so int() never meets a number too
# long for it (a ValueError past 4,300 digits) and `\d` never admits another script's digits.
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,19})-([0-9]{1,19})/([0-9]{1,19})")
_HASH_CHUNK = 1 << 20


class UploadError(Exception):
    """A client mistake about an upload; `status` is the HTTP status the agent answers with."""

    def __init__(self, status: int, message: str, *, code: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.offset = offset


@dataclass(frozen=True)
class ContentRange:
    start: int
    end: int  # inclusive, as in HTTP
    total: int

    @property
    def length(self) -> int:
        return self.end - self.start + 1

    @classmethod
    def parse(cls, header: str | None) -> ContentRange:
        match = _CONTENT_RANGE.fullmatch((header or "").strip())
        if match is None:
            raise UploadError(
                400,
                f"Content-Range {_shown(header)!r} is not 'bytes START-END/TOTAL' (numbers of at most 19 digits)",
                code="invalid_content_range",
            )
        start, end, total = map(int, match.groups())
        if not start <= end < total:
            raise UploadError(400, f"Content-Range {header!r}: need START <= END < TOTAL", code="invalid_content_range")
        return cls(start, end, total)


@dataclass(frozen=True)
class UploadState:
    upload_id: str
    offset: int
    size: int

    @property
    def complete(self) -> bool:
        return self.offset == self.size


class UploadStore:
    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes

    def part(self, upload_id: str) -> Path:
        return self.folder / f"{checked_id(upload_id)}.part"

    def state(self, upload_id: str) -> UploadState | None:
        meta = self.folder / f"{checked_id(upload_id)}.json"
        try:
            size = int(json.loads(meta.read_text())["size"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # never started, or killed before its metadata landed: start again at 0
        part = self.part(upload_id)
        return UploadState(upload_id, part.stat().st_size if part.exists() else 0, size)

    def begin(self, upload_id: str, content_range: ContentRange) -> UploadState:
        """The upload a chunk belongs to, created on its first chunk; refuses a chunk that is not next."""
        state = self.state(upload_id)
        if state is None:
            state = self._create(upload_id, content_range.total)
        if content_range.total != state.size:
            raise UploadError(
                400,
                f"Content-Range total {content_range.total} differs from the upload's size {state.size}",
                code="size_mismatch",
            )
        if content_range.start != state.offset:
            raise UploadError(
                416,
                f"this chunk starts at byte {content_range.start}, but the upload has {state.offset} bytes: "
                "continue from Upload-Offset",
                code="wrong_offset",
                offset=state.offset,
            )
        return state

    def open_for_append(self, upload_id: str) -> int:
        return os.open(self.part(upload_id), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def digest(self, upload_id: str) -> str:
        h = hashlib.sha256()
        with self.part(upload_id).open("rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    def discard(self, upload_id: str) -> None:
        for suffix in (".json", ".part"):
            (self.folder / f"{checked_id(upload_id)}{suffix}").unlink(missing_ok=True)

    def _create(self, upload_id: str, size: int) -> UploadState:
        if size > self.max_bytes:
            raise UploadError(
                413, f"the archive is {size} bytes; this agent accepts at most {self.max_bytes}", code="too_large"
            )
        free = shutil.disk_usage(self.folder).free
        if free < 2 * size:  # the archive and its unpacked copy live side by side until the install ends
            raise UploadError(
                507,
                f"the archive needs {2 * size} bytes free (archive + unpacked), the device has {free}",
                code="insufficient_storage",
            )
        self.part(upload_id).unlink(missing_ok=True)
        meta = self.folder / f"{upload_id}.json"
        tmp = meta.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"size": size}))
        tmp.replace(meta)
        return UploadState(upload_id, 0, size)


def checked_id(upload_id: str) -> str:
    """`upload_id` itself, when it is a sha256 in lowercase hex; else a 400."""
    if UPLOAD_ID.fullmatch(upload_id) is None:
        message = f"upload id {_shown(upload_id)!r} must be the archive's sha256 (64 lowercase hex digits)"
        raise UploadError(400, message, code="invalid_id")
    return upload_id


def _shown(text: str | None) -> str | None:
    """`text` cut short for an error message: a hostile header must not come back 5,000 characters long."""
    return text if text is None or len(text) <= 100 else text[:100] + "..."
