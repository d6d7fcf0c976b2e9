"""`python -m runtime COMMAND`: the runtime's entry points.

Each command module exposes `register(subparsers)`, which adds its parser and sets `run(args) -> int`;
modules keep heavy imports inside `run` so one command never pays for another's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from runtime.events import command as worker
from runtime.server import serve

COMMANDS = (serve, worker)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime", description="Serve an onnxfn bundle.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
