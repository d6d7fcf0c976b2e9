"""`pkg chat functions/NAME`: a conversation with a chat function in the terminal, its replies streamed.

As `ollama run` does: each line read is a user message, sent with the whole conversation so far (the
`messages` list, and `--system` first when given), and the reply streams to stdout as it is generated.
`/reset` starts a new conversation; `/exit` (or `/bye`, Ctrl-D, Ctrl-C at the prompt) leaves with exit 0.
Ctrl-C while a reply streams stops that reply and leaves the turn out of the conversation; so does an error
the endpoint answers (a conversation grown past the context, say), which is printed before the next prompt.

Where it talks to:
- by default, the function deployed on `--target` (local unless told): its URL and key (`http_endpoint`);
- `--url URL`: a server of the function that runs anyway (`pkg serve`'s), with the key of the function's
  `[endpoint] api_key_env` variable when it is set;
- `--start`: a server started for this chat on a free loopback port, without a key, stopped when it ends.

stdin need not be a terminal: piped lines are the turns (no prompt is shown), which is how scripts drive it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape

from packager import foreground_server
from packager.errors import UserError
from packager.openai_stream import choice_text, error_message, events
from packager.processes import stop_process
from packager.spec import FunctionSpec, load_spec
from packager.targets.base import READY_TIMEOUT, TARGETS, HttpEndpoint, target
from packager.targets.local.server_process import exit_reason, wait_ready

EXIT_COMMANDS = ("/exit", "/bye")
PROMPT = ">>> "
_OTHER_TASKS = {
    "completion": 'continues raw text (task = "completion"): send it the text to continue',
    "embedding": 'embeds text (task = "embedding"): embed a text',
    "classification": 'classifies text (task = "classification"): classify a text',
}
err_console = Console(stderr=True)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="chat with a function in the terminal: streamed replies, history, /reset, /exit",
        description="A multi-turn chat with a chat function: deployed, running elsewhere (--url) or started "
        "for the chat (--start). Lines on stdin are the user's turns; /reset starts over, /exit leaves.",
    )
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--target", choices=TARGETS, help="chat with its deployment there (default: local)")
    where.add_argument("--url", help="chat with the function's server at this URL (e.g. pkg serve's)")
    where.add_argument("--start", action="store_true", help="start its server for this chat, stop it at the end")
    parser.add_argument("--system", help="a system message (default: the function's system prompt)")
    parser.add_argument("--max-tokens", type=int, help="per reply (default: the function's)")
    parser.add_argument("--temperature", type=float, help="default: the function's")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each whole reply")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    if spec.model.task != "chat":
        raise UserError(
            f'{spec.name} {_OTHER_TASKS[spec.model.task]} with pkg invoke {args.function} "TEXT"; '
            'pkg chat holds conversations with chat functions (task = "chat")',
            exit_code=2,
        )
    with _endpoint(spec, args) as (endpoint, unreachable):
        return Chat(spec, endpoint, args, unreachable).run()


@contextmanager
def _endpoint(spec: FunctionSpec, args: argparse.Namespace) -> Iterator[tuple[HttpEndpoint, str]]:
    """Where the chat goes, and what to check should it stop answering."""
    if args.start:
        with _started(spec) as started:
            yield started, f"its server stopped; start a new chat: pkg chat {args.function} --start"
        return
    if args.url:
        key = foreground_server.auth(spec, foreground_server.LOOPBACK, None, None)  # the spec's variable, if set
        yield HttpEndpoint(args.url.rstrip("/").removesuffix("/v1"), key.headers), "is a server running there?"
        return
    name = args.target or "local"
    endpoint = target(name).http_endpoint(spec)
    if endpoint is None:
        raise UserError(
            f"--target {name} answers one whole reply per request, with no stream to chat over; send single "
            f'prompts with pkg invoke {args.function} "PROMPT" --target {name}, or chat locally: pkg chat '
            f"{args.function} --start",
            exit_code=2,
        )
    yield endpoint, f"check its deployment: pkg status {args.function} --target {name}"


@contextmanager
def _started(spec: FunctionSpec) -> Iterator[HttpEndpoint]:
    """The function's server on a free loopback port, its log in a temporary file; stopped on the way out."""
    bundle = foreground_server.bundle(spec)
    host = foreground_server.LOOPBACK
    port = foreground_server.free_port(host, 0)
    url = foreground_server.url(host, port)
    auth = foreground_server.Auth((), "none", {})  # loopback only, and gone when the chat ends
    with tempfile.TemporaryFile() as log:
        process = foreground_server.start(foreground_server.command(spec, bundle, host, port, auth), output=log)
        try:
            with err_console.status(f"starting {spec.name}…"):
                problem = wait_ready(url, lambda: _ended(process.poll()), READY_TIMEOUT)
            if problem is not None:
                log.seek(0)
                tail = "\n".join("  " + line for line in log.read().decode(errors="replace").splitlines()[-25:])
                raise UserError(f"{spec.name} did not start: its server {problem}; the last lines of its log:\n{tail}")
            yield HttpEndpoint(url, auth.headers)
        finally:
            stop_process(process)


def _ended(code: int | None) -> str | None:
    return None if code is None else exit_reason(code)


class Chat:
    """The conversation: the messages so far, one turn per line read."""

    def __init__(self, spec: FunctionSpec, endpoint: HttpEndpoint, args: argparse.Namespace, unreachable: str) -> None:
        self.spec = spec
        self.unreachable = unreachable  # what to check when the endpoint stops answering
        self.base_url = f"{endpoint.url}/v1"
        self.url = f"{self.base_url}/chat/completions"
        self.headers = endpoint.headers
        self.args = args
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.history: list[dict[str, str]] = []
        self.interactive = sys.stdin.isatty()

    def run(self) -> int:
        if self.interactive:
            import readline  # noqa: F401  (line editing and ↑ for earlier lines in input())

            self._note(f"chatting with {self.spec.name} at {self.base_url}; /reset starts over, /exit leaves")
        while (line := self._read()) is not None:
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                command = text.split()[0]
                if command in EXIT_COMMANDS:
                    break
                if command == "/reset":
                    self.history.clear()
                    self._note("new conversation")
                else:
                    self._note(f"unknown command {command}: /reset starts a new conversation, /exit leaves")
                continue
            turn = [{"role": "user", "content": text}]
            reply = self._reply(self.system + self.history + turn)
            if reply is not None:
                self.history += [*turn, {"role": "assistant", "content": reply}]
        return 0

    def _read(self) -> str | None:
        """The next line; None at the end of input or on Ctrl-C at the prompt (both leave the chat)."""
        try:
            return input(PROMPT if self.interactive else "")
        except (EOFError, KeyboardInterrupt):
            if self.interactive:
                print()  # the shell's prompt then starts on a line of its own
            return None

    def _reply(self, messages: list[dict[str, str]]) -> str | None:
        """Stream one reply to stdout; its text, or None when it failed or was stopped (the turn is dropped)."""
        parts: list[str] = []
        try:
            with httpx.stream("POST", self.url, json=self._body(messages), headers=self.headers,
                              timeout=self.args.timeout) as response:  # fmt: skip
                if response.status_code != 200:
                    response.read()
                    self._failed(f"the endpoint answered {response.status_code}: {_explain(response)}", parts)
                    return None
                for event in events(response.iter_lines()):
                    if "error" in event:
                        self._failed(f"the reply failed midway: {event['error'].get('message')}", parts)
                        return None
                    for choice in event.get("choices", []):
                        parts.append(choice_text(choice))
                        sys.stdout.write(parts[-1])
                        sys.stdout.flush()
        except KeyboardInterrupt:
            self._end_line(parts)
            self._note("reply stopped; it is left out of the conversation")
            return None
        except httpx.HTTPError as exc:
            raise UserError(f"cannot reach {self.url}: {exc}; {self.unreachable}") from exc
        print(flush=True)
        return "".join(parts)

    def _body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.spec.name, "messages": messages, "stream": True}
        if self.args.max_tokens is not None:
            body["max_tokens"] = self.args.max_tokens
        if self.args.temperature is not None:
            body["temperature"] = self.args.temperature
        return body

    def _failed(self, message: str, parts: list[str]) -> None:
        self._end_line(parts)
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)

    def _end_line(self, parts: list[str]) -> None:
        if any(parts):
            print(flush=True)  # what was streamed of the reply keeps its own line

    def _note(self, message: str) -> None:
        err_console.print(f"[dim]{escape(message)}[/]", highlight=False)


def _explain(response: httpx.Response) -> str:
    """The endpoint's message, with what to do when the conversation no longer fits the model's context."""
    message = error_message(response)
    try:
        code = response.json()["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        code = None
    return f"{message}; /reset starts a new conversation" if code == "context_length_exceeded" else message
