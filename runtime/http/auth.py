"""Bearer-token auth: one API key, read from an environment variable or a file at start.

With a key configured every route needs it except `/health` (liveness) and `/ready`, which orchestrators
probe without secrets and which then answers with its status code and status word only. `/metrics` needs
the key: Prometheus sends it (`authorization: {credentials_file: ...}` in the scrape config).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from runtime.api.errors import APIError


class AuthConfigError(Exception):
    """The configured key source is unusable; the server refuses to start rather than run unprotected."""


def load_api_key(env_name: str | None, key_file: Path | None) -> str | None:
    """The key from `$env_name` or `key_file` (at most one may be given); None means auth is off."""
    if env_name and key_file:
        raise AuthConfigError("give either --api-key-env or --api-key-file, not both")
    if env_name:
        key = os.environ.get(env_name, "").strip()
        if not key:
            raise AuthConfigError(f"--api-key-env {env_name}: the environment variable {env_name} is unset or empty")
        return key
    if key_file:
        try:
            key = key_file.read_text().strip()
        except OSError as exc:
            raise AuthConfigError(f"--api-key-file {key_file}: cannot read it ({exc.strerror})") from exc
        if not key:
            raise AuthConfigError(f"--api-key-file {key_file}: the file is empty")
        return key
    return None


class BearerAuth:
    def __init__(self, api_key: str | None) -> None:
        self._key = _digest(api_key.encode()) if api_key else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def check(self, authorization: str | None) -> None:
        """Raise a 401 unless the `Authorization` header carries the key."""
        if self._key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("missing bearer token: send 'Authorization: Bearer <API key>'")
        # Constant-time comparison of fixed-length digests: timing reveals neither how much of a guessed key
        # was right nor the key's length.
        if not hmac.compare_digest(_digest(token.strip().encode()), self._key):
            raise _unauthorized("incorrect API key provided")

    def allows(self, authorization: str | None) -> bool:
        try:
            self.check(authorization)
        except APIError:
            return False
        return True


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _unauthorized(message: str) -> APIError:
    return APIError(
        401,
        message,
        error_type="invalid_request_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
