"""Requests a web page could make the user's browser send are refused: DNS rebinding and cross-site forms.

A server on 127.0.0.1 without an API key (the documented default) is reachable by any page the user visits:
the page's own name is rebound to 127.0.0.1 (DNS rebinding: Ollama's CVE-2024-28224), so the browser
treats the server as the page's origin and lets it read the answers. What the browser cannot hide is the
name it connected to: the `Host` header. A rebinding attack needs a name the attacker's DNS answers for, so
`Host` must be one no outside DNS can answer for:

- an IP literal (`127.0.0.1`, `[::1]`, a device's address, the host's address a container port is published
  on): a page whose origin is an IP address is served by that address, never by an attacker's name;
- `localhost` and `*.localhost`; a name of one label (`jetson`, a compose service `llm`, this machine's
  hostname); `*.local` (mDNS, Kubernetes' `svc.cluster.local`) and `*.internal`: names only the local network
  or the machine resolves;
- a name the user allows: `--allowed-host NAME` (repeatable) or `$ONNXFN_ALLOWED_HOSTS` (comma-separated), for
  a server reached by a public DNS name; `*` turns the check off (behind a reverse proxy that checks names).

Anything else (`evil.example`) is a 403 (`host_not_allowed`).

A page can also send a request without reading the answer (a form, `fetch` in `no-cors` mode): browsers send
such cross-site requests without asking first only with the CORS-simple body types `text/plain`,
`multipart/form-data` and `application/x-www-form-urlencoded`, which no route of this API takes: they are a 415
(`unsupported_media_type`). Such requests also carry an `Origin` header; one whose host is not allowed as a
`Host` would be (or the opaque `null`) is a 403 (`cross_origin_request`), which covers a body sent without a
type. Programs send no `Origin`; the gateway's own page sends its own address.

Frontends not bound to the user's machine do not install this: SageMaker routes to its container by its own
names (through its authenticated API), and a Lambda function receives its Function URL's host through mangum.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.api.errors import APIError
from runtime.http.wire import WireFormat

ALLOWED_HOSTS_ENV = "ONNXFN_ALLOWED_HOSTS"
ANY_HOST = "*"
# The body types a browser sends cross-site without a CORS preflight (the Fetch standard's CORS-safelisted ones).
SIMPLE_BODY_TYPES = frozenset({"text/plain", "multipart/form-data", "application/x-www-form-urlencoded"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Names no outside DNS answers for (RFC 6761 `localhost`, RFC 6762 `local`, ICANN's reserved `internal`).
LOCAL_SUFFIXES = (".localhost", ".local", ".internal")


def allowed_hosts(flags: Iterable[str] = ()) -> frozenset[str]:
    """The names allowed besides IP literals and local names: `flags` (each may be a comma-separated list) and
    `$ONNXFN_ALLOWED_HOSTS`, normalised."""
    names = [*flags, os.environ.get(ALLOWED_HOSTS_ENV, "")]
    return frozenset(_hostname(n) for entry in names for n in entry.split(",") if n.strip())


class HostGuard:
    """ASGI middleware refusing what a browser could be made to send (module docstring): one per server."""

    def __init__(self, app: ASGIApp, names: frozenset[str] | None = None) -> None:
        self.app = app
        self.names = allowed_hosts() if names is None else names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and ANY_HOST not in self.names:
            error = self.refusal(scope)
            if error is not None:
                headers = Headers(scope=scope)
                response = WireFormat.for_accept(headers.get("accept")).error_response(error)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> APIError | None:
        headers = Headers(scope=scope)
        host = headers.get("host")
        if host is not None and not self.allows(_hostname(host)):
            return APIError(
                403,
                f"Host {host!r} is not a name of this server: a page in a browser may have rebound its own name to "
                f"this address. Use http://127.0.0.1 or http://localhost, or allow the name with --allowed-host "
                f"{_hostname(host) or 'NAME'} or ${ALLOWED_HOSTS_ENV}",
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not self.allows(_origin_host(origin)):
            return APIError(
                403,
                f"a request from the web page at {origin!r} (its Origin header): pages of other sites may not use "
                f"this server; call it from a program, or allow that host with ${ALLOWED_HOSTS_ENV}",
                code="cross_origin_request",
            )
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if scope["method"] in _BODY_METHODS and media in SIMPLE_BODY_TYPES:
            return APIError(
                415,
                f"Content-Type {media} is not accepted: send the body as application/json (or application/msgpack) "
                "with that Content-Type (curl: -H 'Content-Type: application/json'). Browsers send this type "
                "across sites unasked, so it is refused",
                code="unsupported_media_type",
            )
        return None

    def allows(self, hostname: str) -> bool:
        if not hostname:
            return False
        if hostname in self.names or "." not in hostname or hostname == "localhost":
            return True
        if hostname.endswith(LOCAL_SUFFIXES):
            return True
        try:
            ipaddress.ip_address(hostname)
        except ValueError:
            return False
        return True


def _hostname(host: str) -> str:
    """`Host`'s name without its port or brackets, lowercase, without a trailing dot: `[::1]:80` -> `::1`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    name, colon, port = host.rpartition(":")
    return (name if colon and port.isdigit() and ":" not in name else host).rstrip(".")


def _origin_host(origin: str) -> str:
    """The host of an `Origin` (`scheme://host[:port]`); an opaque `null` origin names none."""
    _, separator, rest = origin.partition("://")
    return _hostname(rest) if separator else ""
