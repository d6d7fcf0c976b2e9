"""Push an OCI layout to a registry and pull it back, over the OCI distribution API, with `oras` as client.

oras does the blob protocol (HEAD to skip what the registry has, chunked POST/PATCH/PUT uploads) and
the auth handshakes (basic, bearer tokens, ECR tokens through boto3). What it lacks is written here:
- manifests and the index are PUT as their exact bytes (oras re-serialises JSON, which changes the
  digest, and refuses an index), and the index goes last, so a failed push leaves no tag behind;
- a registry that is down or refuses the credentials fails in seconds with a message saying which,
  because oras retries every exception for ~2 minutes: its retry is bypassed for urllib3's `Retry`
  (429 and 5xx with backoff, honouring Retry-After) and every request has a timeout;
- a bearer token is requested per scope (oras reuses a pull-only token for pushes: upstream #187);
- pulled documents and blobs are checked against their digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packager.errors import UserError
from packager.image.layout import INDEX_MEDIA_TYPE, MANIFEST_MEDIA_TYPE, REF_NAME, blob_path

if TYPE_CHECKING:  # oras and requests come with the packager extra: imported when a registry is reached
    import oras.container
    import requests

    from packager.image.oras_client import Client

CHUNK_SIZE = 16 << 20  # under ECR's 20 MiB upload-part limit; 64 MiB peak memory for a 200 MB layer
PROBE_TIMEOUT = 5.0
TIMEOUT = (10.0, 300.0)  # connect, read (the final PUT of a big blob may take a while to verify)
ECR_HOST = re.compile(r"\d{12}\.dkr\.ecr\.[^.]+\.amazonaws\.com(\.cn)?")
_ACCEPT = f"{INDEX_MEDIA_TYPE}, {MANIFEST_MEDIA_TYPE}"


@dataclass(frozen=True)
class RegistryAuth:
    """Credentials: a username and password (basic auth, or to obtain bearer tokens), or a bearer token."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls) -> RegistryAuth:
        """ONNXFN_REGISTRY_USER + ONNXFN_REGISTRY_PASSWORD, or ONNXFN_REGISTRY_TOKEN: never flags, which
        would land in shell history. ECR registries need neither (boto3's credentials)."""
        return cls(
            username=os.environ.get("ONNXFN_REGISTRY_USER") or None,
            password=os.environ.get("ONNXFN_REGISTRY_PASSWORD") or None,
            token=os.environ.get("ONNXFN_REGISTRY_TOKEN") or None,
        )


@dataclass(frozen=True)
class RegistryTarget:
    registry: str  # host[:port]
    repository: str  # e.g. onnxfn/smollm2-chat
    tag: str = "latest"
    insecure: bool = False  # plain HTTP, for a registry on this machine
    auth: RegistryAuth = RegistryAuth()

    @property
    def reference(self) -> str:
        return f"{self.registry}/{self.repository}:{self.tag}"

    @property
    def is_ecr(self) -> bool:
        return ECR_HOST.fullmatch(self.registry) is not None

    @classmethod
    def parse(cls, reference: str, *, insecure: bool | None = None, auth: RegistryAuth | None = None) -> RegistryTarget:
        """`host[:port]/repository[:tag]`; plain HTTP by default only for loopback hosts."""
        host, _, rest = reference.partition("/")
        if not rest or not ("." in host or ":" in host or host == "localhost"):
            raise UserError(f"registry reference {reference!r}: expected HOST[:PORT]/REPOSITORY[:TAG]", exit_code=2)
        repository, _, tag = rest.rpartition(":") if ":" in rest.rsplit("/", 1)[-1] else (rest, "", "latest")
        loopback = host.split(":")[0] in ("127.0.0.1", "localhost", "[::1]")
        return cls(
            host, repository, tag or "latest", loopback if insecure is None else insecure, auth or RegistryAuth()
        )


@dataclass(frozen=True)
class PushReport:
    reference: str
    index_digest: str
    bytes_sent: int  # blob and document bytes uploaded
    blobs_sent: list[str]  # digests uploaded
    blobs_skipped: list[str]  # digests the registry already had
    seconds: float


@dataclass(frozen=True)
class PulledImage:
    index_digest: str
    manifests: dict[str, str]  # "os/arch[/variant]" → manifest digest
    blobs: dict[str, int]  # digest → size, every config and layer, each verified
    layout: Path | None


def connect(target: RegistryTarget) -> tuple[Client, oras.container.Container]:
    """A client for `target` whose reachability and credentials are checked before anything is sent."""
    import oras.auth
    import requests

    from packager.image.oras_client import Client

    scheme = "http" if target.insecure else "https"
    try:
        probe = requests.get(f"{scheme}://{target.registry}/v2/", timeout=PROBE_TIMEOUT)
    except requests.RequestException as exc:
        raise UserError(f"registry {target.registry} is unreachable ({scheme}): {_reason(exc)}") from exc
    challenge = probe.headers.get("www-authenticate", "")
    if target.is_ecr:
        backend = "ecr"
    elif challenge.lower().startswith("basic"):
        backend = "basic"
    else:
        backend = "token"
    client = Client(target.registry, target.insecure, backend, TIMEOUT)
    auth = target.auth
    if probe.status_code == 401 and not (auth.username or auth.token or target.is_ecr):
        raise UserError(f"registry {target.registry} requires credentials ({challenge.split(' ')[0]} auth): none given")
    if auth.username and auth.password:
        client.auth.set_basic_auth(auth.username, auth.password)
        if backend == "basic":
            client.session.auth = (auth.username, auth.password)  # up front: else every body is sent twice
    if auth.token and isinstance(client.auth, oras.auth.TokenAuth):
        client.auth.set_token_auth(auth.token)
    container = client.get_container(f"{target.registry}/{target.repository}:{target.tag}")
    _check_access(client, container, target)
    return client, container


def _check_access(client: Client, container: oras.container.Container, target: RegistryTarget) -> None:
    """One authenticated request on the repository, so bad credentials fail before any upload."""
    response = client.do_request(f"{client.prefix}://{container.tags_url()}", "GET")
    if response.status_code in (401, 403):
        raise UserError(
            f"registry {target.registry} refused access to {target.repository} "
            f"(HTTP {response.status_code}): {_errors(response)}; check the credentials"
        )


def push_layout(layout: Path, target: RegistryTarget) -> PushReport:
    """Push the image index tagged in `layout` and everything under it; the index (the tag) goes last."""
    start = time.perf_counter()
    index_digest = _tagged_index(layout)
    client, container = connect(target)
    index = json.loads(blob_path(layout, index_digest).read_bytes())
    sent: list[str] = []
    skipped: list[str] = []
    bytes_sent = 0
    for descriptor in index["manifests"]:
        manifest_bytes = blob_path(layout, descriptor["digest"]).read_bytes()
        manifest = json.loads(manifest_bytes)
        for blob in [manifest["config"], *manifest["layers"]]:
            if blob["digest"] in sent or blob["digest"] in skipped:
                continue
            if client.blob_exists(blob, container):
                skipped.append(blob["digest"])
                continue
            _upload_blob(client, container, layout, blob)
            sent.append(blob["digest"])
            bytes_sent += blob["size"]
        bytes_sent += _put_document(client, container, descriptor["digest"], manifest_bytes, MANIFEST_MEDIA_TYPE)
    bytes_sent += _put_document(
        client, container, target.tag, blob_path(layout, index_digest).read_bytes(), INDEX_MEDIA_TYPE
    )
    return PushReport(target.reference, index_digest, bytes_sent, sent, skipped, time.perf_counter() - start)


def _upload_blob(client: Client, container: oras.container.Container, layout: Path, blob: dict[str, Any]) -> None:
    path = blob_path(layout, blob["digest"])
    try:
        response = client.chunked_upload(str(path), container, blob, chunk_size=CHUNK_SIZE)
    except ValueError as exc:  # oras raises ValueError when a PATCH is refused
        raise UserError(f"uploading {blob['digest']} to {container} failed: {exc}; the tag was not pushed") from exc
    if response.status_code != 201:
        raise UserError(
            f"uploading {blob['digest']} ({blob['size']} bytes) to {container} failed: HTTP {response.status_code} "
            f"{_errors(response)}; the tag was not pushed"
        )


def _put_document(
    client: Client, container: oras.container.Container, reference: str, data: bytes, media_type: str
) -> int:
    """PUT a manifest or index as its exact bytes under `reference` (a digest or tag), unless already there."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    url = f"{client.prefix}://{container.manifest_url(reference)}"
    existing = client.do_request(url, "HEAD", headers={"Accept": _ACCEPT})
    if existing.status_code == 200 and existing.headers.get("docker-content-digest") == digest:
        return 0
    response = client.do_request(url, "PUT", data=data, headers={"Content-Type": media_type})
    if response.status_code != 201:
        raise UserError(
            f"the registry refused {media_type} {digest} as {reference}: HTTP {response.status_code} "
            f"{_errors(response)}"
        )
    stored = response.headers.get("docker-content-digest")
    if stored and stored != digest:
        raise UserError(f"the registry stored {reference} as {stored}, not {digest}: it rewrote the document")
    return len(data)


def pull_image(target: RegistryTarget, out: Path | None = None, *, layers: bool = True) -> PulledImage:
    """Fetch the index tagged `target.tag`, its manifests and configs (and layers, if `layers`), verifying
    every digest; with `out`, write them as an OCI layout there."""
    client, container = connect(target)
    index_bytes, index_digest = _get_document(client, container, target.tag, None)
    if out is not None:
        _store(out, index_digest, index_bytes)
    manifests: dict[str, str] = {}
    blobs: dict[str, int] = {}
    for descriptor in json.loads(index_bytes)["manifests"]:
        manifest_bytes, digest = _get_document(client, container, descriptor["digest"], descriptor["digest"])
        platform = descriptor.get("platform", {})
        name = "/".join(filter(None, (platform.get("os"), platform.get("architecture"), platform.get("variant"))))
        manifests[name] = digest
        if out is not None:
            _store(out, digest, manifest_bytes)
        manifest = json.loads(manifest_bytes)
        for blob in [manifest["config"], *(manifest["layers"] if layers else [])]:
            if blob["digest"] not in blobs:
                _fetch_blob(client, container, blob, out)
                blobs[blob["digest"]] = blob["size"]
    if out is not None:
        top = {"schemaVersion": 2, "manifests": [{"mediaType": INDEX_MEDIA_TYPE, "digest": index_digest,
               "size": len(index_bytes), "annotations": {REF_NAME: target.tag}}]}  # fmt: skip
        (out / "index.json").write_text(json.dumps(top, sort_keys=True, separators=(",", ":")))
        (out / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    return PulledImage(index_digest, manifests, blobs, out)


def _get_document(
    client: Client, container: oras.container.Container, reference: str, expected: str | None
) -> tuple[bytes, str]:
    response = client.do_request(
        f"{client.prefix}://{container.manifest_url(reference)}", "GET", headers={"Accept": _ACCEPT}
    )
    if response.status_code != 200:
        raise UserError(f"{container.registry} has no {container.repository}@{reference}: HTTP {response.status_code}")
    data = response.content
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    announced = response.headers.get("docker-content-digest")
    if (expected and digest != expected) or (announced and announced != digest):
        raise UserError(
            f"{container.repository}@{reference}: content digest {digest} does not match {expected or announced}"
        )
    return data, digest


def _fetch_blob(client: Client, container: oras.container.Container, blob: dict[str, Any], out: Path | None) -> None:
    digest = hashlib.sha256()
    size = 0
    path = blob_path(out, blob["digest"]) if out is not None else None
    with client.get_blob(container, blob["digest"], stream=True) as response:
        if response.status_code != 200:
            raise UserError(f"{container.registry} has no blob {blob['digest']}: HTTP {response.status_code}")
        sink = path.open("wb") if path is not None else None
        try:
            for chunk in response.iter_content(chunk_size=1 << 20):
                digest.update(chunk)
                size += len(chunk)
                if sink is not None:
                    sink.write(chunk)
        finally:
            if sink is not None:
                sink.close()
    actual = "sha256:" + digest.hexdigest()
    if actual != blob["digest"] or size != blob["size"]:
        if path is not None:
            path.unlink(missing_ok=True)
        raise UserError(f"blob {blob['digest']} from {container.registry} arrived as {actual} ({size} bytes)")


def _store(layout: Path, digest: str, data: bytes) -> None:
    path = blob_path(layout, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _tagged_index(layout: Path) -> str:
    try:
        top = json.loads((layout / "index.json").read_text())
        return top["manifests"][0]["digest"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise UserError(f"{layout} is not an OCI image layout written by pkg build ({exc})") from exc


def _errors(response: requests.Response) -> str:
    try:
        errors = response.json().get("errors", [])
        return "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors) or response.reason
    except ValueError:
        return response.reason or ""


def _reason(exc: requests.RequestException) -> str:
    text = str(exc)
    for marker in ("Connection refused", "Name or service not known", "timed out", "No route to host"):
        if marker in text:
            return marker.lower()
    return text
