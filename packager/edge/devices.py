"""Which devices a push goes to and how to authenticate: command-line flags first, then `[targets.edge]`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from packager.edge.client import DeviceAuth
from packager.errors import UserError
from packager.spec import EdgeTarget

TOKEN_ENV = "ONNXFN_EDGE_TOKEN"


@dataclass(frozen=True)
class EdgeOptions:
    devices: tuple[str, ...]
    auth: DeviceAuth


def edge_options(
    settings: EdgeTarget, device_flags: list[str] | None, token_file: Path | None, tls: dict[str, Path | None]
) -> EdgeOptions:
    devices = _devices(device_flags, settings)
    token = _token(token_file or (Path(settings.token_file) if settings.token_file else None))
    ca = tls.get("ca_file") or _path(settings.ca_file)
    cert = tls.get("client_cert") or _path(settings.client_cert)
    key = tls.get("client_key") or _path(settings.client_key)
    for flag, path in (("--ca-file", ca), ("--client-cert", cert), ("--client-key", key)):
        if path is not None and not path.is_file():
            raise UserError(f"{flag} {path}: no such file", exit_code=2)
    return EdgeOptions(devices, DeviceAuth(token, ca, cert, key))


def _devices(flags: list[str] | None, settings: EdgeTarget) -> tuple[str, ...]:
    raw = [d.strip() for flag in flags or [] for d in flag.split(",")] if flags else list(settings.devices)
    devices = tuple(dict.fromkeys(d for d in raw if d))
    if not devices:
        raise UserError(
            "no devices: pass --device http://HOST:8470[,…] or list them in [targets.edge] devices", exit_code=2
        )
    for device in devices:
        parts = urlsplit(device)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"--device {device!r}: expected an agent URL such as http://10.0.0.7:8470", exit_code=2)
    return devices


def _token(token_file: Path | None) -> str:
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise UserError(f"--token-file {token_file}: cannot read it ({exc.strerror})", exit_code=2) from exc
        if not token:
            raise UserError(f"--token-file {token_file} is empty", exit_code=2)
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise UserError(
            f"no agent token: pass --token-file (the file the agent's --token-file reads), set ${TOKEN_ENV}, "
            "or set [targets.edge] token_file",
            exit_code=2,
        )
    return token


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None
