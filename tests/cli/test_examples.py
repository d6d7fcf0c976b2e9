"""Every command's `--help` example is a command line `pkg` accepts as written (issue 39)."""

from __future__ import annotations

import shlex

import pytest

from packager.cli import EXAMPLES, build_parser


@pytest.mark.parametrize("command", sorted(EXAMPLES))
def test_the_help_example_parses(command: str) -> None:
    words = shlex.split(EXAMPLES[command])
    if ">" in words:  # a shell redirection is not pkg's (`pkg completion bash > FILE`)
        words = words[: words.index(">")]
    assert words[0] == "pkg"
    try:
        args = build_parser().parse_args(words[1:])
    except SystemExit as exc:  # argparse's way of refusing: the example would print a usage error
        pytest.fail(f"`{EXAMPLES[command]}` is refused by the parser (exit {exc.code})")
    assert args.command == command and callable(args.run)
