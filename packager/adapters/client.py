"""The client side of a runtime server's adapter admin API (`/v1/adapters`, behind the endpoint's API key).

- `GET /v1/adapters` → `{"data": [{"id", "name", "digest", "bytes", "bundled", "resident"}]}`
- `PUT /v1/adapters/{name}`, the adapter file's bytes, `X-Onnxfn-Digest: sha256:<hex>` → 201 (400 `invalid_adapter`,
  409 a bundled name)
- `DELETE /v1/adapters/{name}` → 200 (404 unknown, 409 bundled)

Every failure becomes a `UserError` that says what to do (`unreachable` hints at how to start the endpoint).
Also the adapter file itself: `prepare` converts a source into the bytes every endpoint and agent receives.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from packager.adapters.convert import check_fits, read_adapter_source, to_adapter_file
from packager.edge.client import json_object
from packager.errors import UserError
from runtime.adapters.files import write_adapter_file
from runtime.adapters.layout import NAME, NAME_RULE, AdapterLayout
from runtime.bundle import BundleError, Manifest, read_manifest

DIGEST_HEADER = "X-Onnxfn-Digest"
TIMEOUT = 120.0  # an adapter of a few hundred MB over a slow link, verified and written at the other end


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter converted for one bundle: the file's bytes, as every endpoint receives them."""

    name: str
    source: Path
    data: bytes
    digest: str  # sha256:<hex> of `data`
    rank: int
    modules: tuple[str, ...]


def check_name(name: str) -> None:
    if not NAME.match(name):
        raise UserError(f"adapter name {name!r} is not valid: {NAME_RULE}", exit_code=2)


def bundle_layout(bundle: Path, function_dir: Path) -> tuple[Manifest, AdapterLayout]:
    """The bundle's manifest and adapter layout; `UserError` when its graph takes no adapters."""
    try:
        manifest = read_manifest(bundle)
    except BundleError as exc:
        raise UserError(f"{exc}\nbuild it first: pkg build {function_dir}") from exc
    if not manifest.adapters or "layout" not in manifest.adapters:
        raise UserError(
            f"the bundle of {manifest.function} ({bundle}) takes no LoRA adapters: declare [[adapters]] or "
            f'[export] adapter_modules (e.g. ["q_proj", "v_proj"]) in {function_dir / "function.toml"} '
            f"and rebuild: pkg build {function_dir}"
        )
    return manifest, AdapterLayout.from_json(manifest.adapters["layout"])


def bundled_names(manifest: Manifest) -> list[str]:
    return sorted((manifest.adapters or {}).get("bundled") or {})


def prepare(name: str, source: Path, manifest: Manifest, layout: AdapterLayout) -> PreparedAdapter:
    """Read `source` (PEFT folder or GGUF LoRA), check it against the base and the bundle's layout, convert it."""
    check_name(name)
    if name in bundled_names(manifest):
        raise UserError(
            f"{name!r} is one of the bundle's own adapters ([[adapters]] in function.toml); add this one under "
            "another name, or change the [[adapters]] entry and rebuild"
        )
    facts = manifest.decoder
    weights = read_adapter_source(source, facts)
    adapter = to_adapter_file(weights, facts)
    check_fits(name, str(source), adapter, layout)
    with tempfile.TemporaryDirectory(prefix="onnxfn-adapter-") as scratch:
        path = Path(scratch) / f"{name}.safetensors"
        write_adapter_file(path, adapter)
        data = path.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return PreparedAdapter(name, source, data, digest, adapter.rank, adapter.modules)


class AdapterClient:
    """One runtime server's (or gateway-less local server's) adapter API. `url` is without `/v1`."""

    def __init__(self, url: str, headers: dict[str, str], *, down_hint: str, timeout: float = TIMEOUT) -> None:
        self.url = url.rstrip("/")
        self.down_hint = down_hint  # what to do when nothing answers, e.g. "deploy it first: pkg deploy F"
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __enter__(self) -> AdapterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def adapters(self) -> list[dict[str, Any]]:
        return list(self._request("GET", "/v1/adapters").json().get("data", []))

    def put(self, name: str, data: bytes, digest: str) -> dict[str, Any]:
        headers = {DIGEST_HEADER: digest, "Content-Type": "application/octet-stream"}
        response = self._request("PUT", f"/v1/adapters/{name}", content=data, headers=headers)
        return json_object(response)

    def delete(self, name: str) -> dict[str, Any]:
        return json_object(self._request("DELETE", f"/v1/adapters/{name}"))

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise UserError(f"{self.url}: no answer to {method} {path} in time ({exc!r})") from exc
        except httpx.TransportError as exc:
            raise UserError(f"cannot reach the endpoint at {self.url} ({exc}); {self.down_hint}") from exc
        if response.is_success:
            return response
        raise UserError(_failure(self.url, method, path, response))


def _failure(url: str, method: str, path: str, response: httpx.Response) -> str:
    message, code = error_of(response)
    status = response.status_code
    if status == 401:
        return f"{url} refused the API key (401: {message}); `pkg status FUNCTION --api-key` prints the current one"
    if status in (404, 405) and code in ("not_found", "", None) and "/v1/adapters" in path and "adapter" not in message:
        return (
            f"{url} has no adapter API ({method} {path} answered {status}: {message}); "
            "redeploy the function so its server runs a runtime that serves adapters"
        )
    return f"{method} {path} answered {status} ({code or 'error'}): {message}"


def error_of(response: httpx.Response) -> tuple[str, str | None]:
    """The OpenAI-shaped error body's message and code (or the text, when the body is not one)."""
    try:
        error = response.json()["error"]
        return str(error.get("message") or response.reason_phrase), error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return (response.text[:300] or response.reason_phrase), None
