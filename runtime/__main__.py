"""`python -m runtime COMMAND`: the runtime's entry points.

Each command module exposes `register(subparsers)`, which adds its parser and sets `run(args) -> int`;
modules keep heavy imports inside `run` so one command never pays for another's. Only the named
command's module is imported (the agent's TLS stack or the worker's asyncio never delay `serve`); help
and unknown commands import them all. `worker` also takes flags from `$ONNXFN_FLAGS` (as the Lambda
handler does); those on the command line come after them and win.
"""

from __future__ import annotations

import runtime.timeline  # noqa: F401  (first: its clock marks when the runtime began importing)

# isort: split
import argparse
import importlib
import signal
import sys
from collections.abc import Sequence

COMMANDS = {"serve": "runtime.http.serve", "worker": "runtime.events.command", "agent": "runtime.agent.command"}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = [argv[0]] if argv[:1] and argv[0] in COMMANDS else list(COMMANDS)
    parser = argparse.ArgumentParser(prog="python -m runtime", description="Serve an onnxfn bundle.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in chosen:
        importlib.import_module(COMMANDS[name]).register(subparsers)
    if chosen == ["worker"]:
        from runtime.events.loading import environment_flags

        argv[1:1] = environment_flags()
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        # Ctrl-C: uvicorn has shut down gracefully, then re-raised SIGINT so the exit status says so.
        sys.exit(128 + signal.SIGINT)
