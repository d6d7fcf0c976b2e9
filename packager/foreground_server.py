"""A runtime server that `pkg` runs as its own child, not as a deployment: `pkg serve` (in the foreground) and
`pkg chat --start` (for one conversation).

Nothing is recorded in the per-user state folder: the server lives exactly as long as the `pkg` that started
it, which stops it on Ctrl-C, on exit, and (through the kernel's parent-death signal) when it is killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from packager.errors import UserError
from packager.paths import bundle_dir
from packager.processes import precompile_runtime
from packager.runtime_flags import server_flags
from packager.spec import FunctionSpec
from runtime.bundle import BundleError, read_manifest

LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Auth:
    """How the server checks requests: its flags, a phrase for the banner, the header clients send."""

    flags: tuple[str, ...]
    description: str
    headers: dict[str, str]


def bundle(spec: FunctionSpec) -> Path:
    """The function's built bundle; building it is `pkg build`'s job (minutes, not something to do silently)."""
    path = bundle_dir(spec).resolve()
    try:
        read_manifest(path)
    except BundleError as exc:
        raise UserError(
            f"{exc}\nbuild outputs live under the current folder: from the project's folder, "
            f"run pkg build {spec.directory}"
        ) from exc
    return path


def auth(spec: FunctionSpec, host: str, key_env: str | None, key_file: Path | None) -> Auth:
    """The key the server requires: the one named on the command line, else the function's `[endpoint]
    api_key_env` when that variable is set (clients of its deployment keep working), else none.

    No key on a loopback address is what local model servers do (only this machine can connect); a function
    that asks for a key is not put on the network without one.
    """
    if key_env is not None:
        return Auth(("--api-key-env", key_env), f"from ${key_env}", _bearer(_env_key(key_env)))
    if key_file is not None:
        try:
            key = key_file.read_text().strip()
        except OSError as exc:
            raise UserError(f"cannot read the API key file {key_file}: {exc.strerror}; pass a readable file") from exc
        return Auth(("--api-key-file", str(key_file.resolve())), f"from {key_file}", _bearer(key))
    wanted = spec.endpoint.api_key_env
    if wanted is not None and os.environ.get(wanted, "").strip():
        return Auth(("--api-key-env", wanted), f"from ${wanted}", _bearer(_env_key(wanted)))
    if wanted is not None and not _is_loopback(host):
        raise UserError(
            f"--host {host} would put {spec.name} on the network without an API key; set ${wanted} "
            "(its [endpoint] api_key_env) or pass --api-key-env NAME or --api-key-file PATH",
            exit_code=2,
        )
    reach = "only this machine can connect" if _is_loopback(host) else "the function's spec sets no api_key_env"
    return Auth((), f"none ({reach})", {})


def _env_key(name: str) -> str:
    key = os.environ.get(name, "").strip()
    if not key:
        raise UserError(f"${name} is unset or empty; export the API key in it, or leave out --api-key-env", exit_code=2)
    return key


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def command(spec: FunctionSpec, bundle: Path, host: str, port: int, auth: Auth) -> list[str]:
    """The command line the local target runs for this function (`LocalPlan.command`), minus prepacked weights:
    those are a deploy's build output, written once per bundle, and the server packs its weights itself. A bundle
    with adapters serves its own; adding more at run time (`pkg adapter add`) is for deployed endpoints."""
    return [
        sys.executable, "-m", "runtime", "serve", str(bundle),
        "--host", host, "--port", str(port), *server_flags(spec), *auth.flags,
    ]  # fmt: skip


def free_port(host: str, port: int) -> int:
    """`port` if it can be listened on now (any free one for 0), so a taken port fails here with what to do
    rather than in the server's log. The server binds it again a moment later (the same way: SO_REUSEADDR)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family) as sock:
            return int(sock.getsockname()[1])
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)  # create_server appends the address to strerror
        raise UserError(
            f"cannot listen on {host}:{port}: {reason}; choose another with --port N (0: any free port)"
        ) from exc


def url(host: str, port: int) -> str:
    shown = LOOPBACK if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def start(argv: list[str], output: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """Start the server as a child in a process group of its own: a Ctrl-C in the terminal reaches only `pkg`,
    which stops the server with SIGTERM (uvicorn then drains and exits quietly; on SIGINT it re-raises
    KeyboardInterrupt after draining and prints a traceback). `output`: where its log goes (None: this
    terminal)."""
    precompile_runtime()
    stderr = subprocess.STDOUT if output is not None else None
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=output, stderr=stderr, process_group=0,
        preexec_fn=_parent_death_signal(os.getpid()),
    )  # fmt: skip


def _parent_death_signal(parent: int) -> Callable[[], None] | None:
    """SIGTERM the server when `pkg` dies, however it dies (SIGKILL included): no server outlives it."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def set_signal() -> None:  # in the child, between fork and exec
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # `pkg` died before the line above took effect
            os._exit(1)

    return set_signal
