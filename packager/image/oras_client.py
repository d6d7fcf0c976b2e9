"""oras' registry client as registry.py uses it: bounded retries and timeouts, and a fresh token per scope.

Its own module because oras (and requests) come with the packager extra: registry.py imports it when it reaches a
registry, so `pkg` commands that never push or pull run without them.
"""

from __future__ import annotations

from typing import Any

import oras.auth
import oras.provider
import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from packager.errors import UserError


class Client(oras.provider.Registry):
    """oras' registry client with bounded retries and timeouts, and a fresh token per scope."""

    def __init__(self, registry: str, insecure: bool, backend: str, timeout: tuple[float, float]) -> None:
        super().__init__(hostname=registry, insecure=insecure, auth_backend=backend)
        adapter = _TimeoutAdapter(
            timeout,
            max_retries=Retry(
                total=4,
                connect=1,
                read=1,
                backoff_factor=0.5,
                status_forcelist=(429, 502, 503, 504),
                allowed_methods=frozenset({"HEAD", "GET", "PUT"}),
                respect_retry_after_header=True,
                raise_on_status=False,
            ),
        )
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def do_request(  # type: ignore[override]
        self,
        url: str,
        method: str = "GET",
        data: Any = None,
        headers: dict[str, str] | None = None,
        json: dict[str, Any] | None = None,
        stream: bool = False,
    ) -> requests.Response:
        request = oras.provider.Registry.do_request.__wrapped__  # without oras' 2-minute retry loop
        try:
            response = request(self, url, method, data, dict(headers or {}), json, stream)
            if response.status_code == 401 and isinstance(self.auth, oras.auth.TokenAuth) and self.auth.token:
                self.auth.token = None  # a token for another scope: ask for one covering this request
                response = request(self, url, method, data, dict(headers or {}), json, stream)
        except ValueError as exc:  # oras: "Cannot respond to request for authentication."
            raise UserError(f"{self.hostname} refused the credentials for {method} {url}: {exc}") from exc
        except requests.RequestException as exc:
            raise UserError(f"registry {self.hostname} did not answer {method} {url}: {exc}") from exc
        return response


class _TimeoutAdapter(HTTPAdapter):
    """Every request gets `timeout` unless it brings its own."""

    def __init__(self, timeout: tuple[float, float], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timeout = timeout

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:  # type: ignore[override]
        kwargs["timeout"] = kwargs.get("timeout") or self.timeout
        return super().send(request, **kwargs)
