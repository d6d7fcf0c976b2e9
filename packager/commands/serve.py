"""`pkg serve functions/NAME`: the function's server in the foreground, its log on this terminal, until Ctrl-C.

It runs the command line `pkg deploy --target local` runs (`python -m runtime serve BUNDLE …`, the flags from
runtime_flags.py), on 127.0.0.1:8000 unless told otherwise, and deploys nothing: `pkg ps` and `pkg status` do
not see it. The bundle must be built (`pkg build`: minutes, so it is never started implicitly). Once the
server is ready, stdout says where it answers and how to chat with it.

Ctrl-C (or SIGTERM, SIGHUP) asks the server to stop: it finishes the requests in flight (5 s at most) and
`pkg serve` exits 0. A second Ctrl-C kills it at once. A server that ends on its own exits 1.

API key: `--api-key-env NAME` or `--api-key-file PATH`; else the variable the function's `[endpoint]
api_key_env` names, when it is set (the deployment's clients keep working); else none, which is allowed only
on a loopback address when the function asks for a key.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from rich.console import Console

from packager import foreground_server
from packager.errors import UserError
from packager.processes import stop_process
from packager.spec import FunctionSpec, load_spec
from packager.targets.local.server_process import exit_reason, probe

DEFAULT_PORT = 8000  # `python -m runtime serve`'s own default
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL = 0.1
err_console = Console(stderr=True)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run a function's server in the foreground, logs on the terminal (Ctrl-C stops it)",
        description="Run the function's built bundle the way `pkg deploy --target local` would, but in the "
        "foreground and without recording a deployment.",
    )
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument(
        "--host", default=foreground_server.LOOPBACK, help="address to listen on (default: 127.0.0.1, this machine)"
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on (0: any free port)")
    key = parser.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="require the key in $NAME (default: the function's api_key_env variable when set, else no key)",
    )
    key.add_argument("--api-key-file", type=Path, metavar="PATH", help="require the key in this file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    bundle = foreground_server.bundle(spec)
    auth = foreground_server.auth(spec, args.host, args.api_key_env, args.api_key_file)
    port = foreground_server.free_port(args.host, args.port)
    url = foreground_server.url(args.host, port)
    process = foreground_server.start(foreground_server.command(spec, bundle, args.host, port, auth))
    stop = _Stop(process)
    try:
        with _forwarding(stop):
            if _wait_ready(process, url, stop):
                _announce(spec, args.function, url, auth)
            code = process.wait()
    finally:
        stop_process(process)  # whatever went wrong in between, the server does not outlive `pkg serve`
    if stop.requested:
        err_console.print(f"stopped {spec.name}", highlight=False)
        return 0
    raise UserError(f"the server of {spec.name} {exit_reason(code)}; its log above says why")


class _Stop:
    """A signal handler: the first Ctrl-C (SIGTERM, SIGHUP) asks the server to stop, a second one kills it."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            self.process.kill()
            return
        self.requested = True
        self.process.terminate()  # SIGTERM: uvicorn drains quietly, where SIGINT ends in a traceback


@contextmanager
def _forwarding(stop: _Stop) -> Iterator[None]:
    previous = {sig: signal.signal(sig, stop) for sig in _FORWARDED}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait_ready(process: subprocess.Popen[bytes], url: str, stop: _Stop) -> bool:
    """Whether the server became ready; False once it exited or was asked to stop first. No time limit: the
    terminal shows how its start goes, and Ctrl-C ends the wait."""
    while process.poll() is None and not stop.requested:
        if probe(url) == "ready":
            return True
        time.sleep(_POLL)
    return False


def _announce(spec: FunctionSpec, function: Path, url: str, auth: foreground_server.Auth) -> None:
    # Plain print, flushed: these lines are the command's output (a script may read the URL) and must not wrap.
    lines = [
        f"{spec.name} is ready at {url}/v1 (OpenAI-compatible, model {spec.name!r})",
        f"api key: {auth.description}",
    ]
    if spec.model.task == "chat" and auth.flags in ((), ("--api-key-env", spec.endpoint.api_key_env)):
        # `pkg chat --url` sends the key of the function's api_key_env variable, so it can talk to this one.
        lines.append(f"chat with it: pkg chat {function} --url {url}")
    lines.append("Ctrl-C stops it")
    print("\n".join(lines), flush=True)
