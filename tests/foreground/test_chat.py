"""`pkg chat`: a multi-turn chat driven through a pipe, as a script (or these tests) would drive it.

What the chat sends is checked on the wire: `pkg chat --url` talks to a small recording HTTP server started
here, which either forwards to the real demo model (`pkg serve`) or answers itself (error paths)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from packager.openai_stream import choice_text, events
from tests.conftest import REPO
from tests.deploy_local.conftest import FUNCTION, Workspace
from tests.foreground.conftest import free_port, kill_session, session_processes
from tests.foreground.test_serve import start_serve, wait_ready

# (request body) -> (status, content type, body in chunks): what the recording server answers, each chunk sent
# as it comes (a stream).
Answer = Callable[[dict[str, Any]], tuple[int, str, Iterable[bytes]]]


@dataclass
class Recorded:
    bodies: list[dict[str, Any]] = field(default_factory=list)
    streams: list[str] = field(default_factory=list)  # each reply as it went back, server-sent events and all

    def replies(self) -> list[str]:
        """Each streamed reply's text, put together from its events."""
        return [_text(stream) for stream in self.streams]


def _text(stream: str) -> str:
    return "".join(choice_text(choice) for event in events(iter(stream.splitlines())) for choice in event["choices"])


@contextmanager
def recording_server(answer: Answer) -> Iterator[tuple[str, Recorded]]:
    """A real HTTP server on a free loopback port that records each request's body and reply."""
    recorded = Recorded()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            recorded.bodies.append(body)
            status, content_type, chunks = answer(body)
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.end_headers()  # HTTP/1.0: the reply ends when the connection closes
            sent = []
            try:
                for chunk in chunks:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    sent.append(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading (Ctrl-C during a reply)
            recorded.streams.append(b"".join(sent).decode())

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", recorded
    finally:
        server.shutdown()
        server.server_close()


def forward_to(upstream: str) -> Answer:
    """Pass each request on to `upstream` and its reply back as it streams."""

    def answer(body: dict[str, Any]) -> tuple[int, str, Iterable[bytes]]:
        client = httpx.Client(timeout=120)
        response = client.send(client.build_request("POST", f"{upstream}/v1/chat/completions", json=body), stream=True)

        def chunks() -> Iterator[bytes]:
            try:
                yield from response.iter_raw()
            finally:
                response.close()
                client.close()

        return response.status_code, response.headers["content-type"], chunks()

    return answer


def sse(*texts: str, pause: float = 0.0) -> Iterator[bytes]:
    """A chat reply streamed as server-sent events, one per text, `pause` seconds apart."""
    for text in texts:
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': text}}]})}\n\n".encode()
        time.sleep(pause)
    yield b"data: [DONE]\n\n"


def chat(cwd: Path, env: dict[str, str], *args: str, lines: str) -> subprocess.CompletedProcess[str]:
    """`pkg chat` with `lines` piped in; its session is checked for leftovers, whatever it started."""
    process = subprocess.Popen(
        [sys.executable, "-m", "packager.cli", "chat", *args], cwd=cwd, env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(lines, timeout=240)
        leftovers = session_processes(process.pid)
    finally:
        kill_session(process.pid)
    assert leftovers == [], f"pkg chat left processes behind: {leftovers}"
    assert "Traceback" not in stderr, stderr
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.real_model
def test_chat_with_a_server_of_its_own(workspace: Workspace) -> None:
    workspace.add_function(FUNCTION)
    result = chat(
        workspace.root, workspace.env, f"functions/{FUNCTION}", "--start", "--max-tokens", "48",
        lines="Hello\n/reset\nWhat is 2+2?\n/exit\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    replies = result.stdout.splitlines()
    assert len(replies) == 2 and all(reply.strip() for reply in replies), result.stdout
    assert "4" in replies[1]
    assert "new conversation" in result.stderr
    assert ">>>" not in result.stdout  # no prompt when stdin is not a terminal


@pytest.mark.real_model
def test_chat_streams_keeps_the_history_and_reset_clears_it(workspace: Workspace) -> None:
    workspace.add_function(FUNCTION)
    port = free_port()
    serve = start_serve(workspace, "--port", str(port))
    try:
        wait_ready(serve, f"http://127.0.0.1:{port}")
        with recording_server(forward_to(f"http://127.0.0.1:{port}")) as (url, recorded):
            result = chat(
                workspace.root, workspace.env, f"functions/{FUNCTION}", "--url", url, "--system", "Be brief.",
                "--max-tokens", "32", lines="Hello\nAnd once more?\n/reset\nWhat is 2+2?\n/exit\n",
            )  # fmt: skip
        os.kill(serve.pid, signal.SIGINT)
        assert serve.wait(timeout=30) == 0
    finally:
        kill_session(serve.pid)
    assert result.returncode == 0, result.stderr
    system = {"role": "system", "content": "Be brief."}
    first, second, third = recorded.replies()
    assert [body["messages"] for body in recorded.bodies] == [
        [system, {"role": "user", "content": "Hello"}],
        [system, {"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
         {"role": "user", "content": "And once more?"}],
        [system, {"role": "user", "content": "What is 2+2?"}],  # after /reset: one user message, nothing else
    ]  # fmt: skip
    assert all(body["stream"] is True and body["model"] == FUNCTION for body in recorded.bodies)
    assert all(stream.count("data: ") > 3 for stream in recorded.streams)  # each reply came as many events
    assert result.stdout == f"{first}\n{second}\n{third}\n"  # printed as it streamed, one line per reply


def test_a_failed_turn_is_reported_and_left_out_of_the_conversation() -> None:
    def answer(body: dict[str, Any]) -> tuple[int, str, Iterable[bytes]]:
        if body["messages"][-1]["content"] == "a very long question":
            error = {"message": "the prompt is 3000 tokens; the limit is 1792", "code": "context_length_exceeded"}
            return 400, "application/json", [json.dumps({"error": error}).encode()]
        return 200, "text/event-stream", sse("fi", "ne")

    with recording_server(answer) as (url, recorded):
        result = chat(
            REPO, {**os.environ, "COLUMNS": "250"}, "functions/smollm2-chat", "--url", url,
            lines="hi\na very long question\n/nonsense\nand now?\n",  # no /exit: the end of input leaves too
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == "fine\nfine\n"
    assert "the endpoint answered 400: the prompt is 3000 tokens" in result.stderr
    assert "/reset starts a new conversation" in result.stderr
    assert "unknown command /nonsense" in result.stderr
    assert [m["content"] for m in recorded.bodies[-1]["messages"]] == ["hi", "fine", "and now?"]


@pytest.mark.parametrize(
    ("function", "says"),
    [
        ("minilm-embed", 'embeds text (task = "embedding"): embed a text with pkg invoke functions/minilm-embed'),
        ("gemma3-completion", 'continues raw text (task = "completion")'),
    ],
)
def test_chat_refuses_a_function_that_does_not_chat(function: str, says: str) -> None:
    result = chat(REPO, {**os.environ, "COLUMNS": "250"}, f"functions/{function}", lines="hi\n")
    assert result.returncode == 2
    assert says in result.stderr


def test_chat_refuses_a_target_without_a_stream() -> None:
    result = chat(REPO, {**os.environ, "COLUMNS": "250"}, "functions/smollm2-chat", "--target", "aws-lambda", lines="")
    assert result.returncode == 2
    assert 'pkg invoke functions/smollm2-chat "PROMPT" --target aws-lambda' in result.stderr


def test_in_a_terminal_ctrl_c_stops_a_reply_then_leaves_at_the_prompt() -> None:
    def answer(body: dict[str, Any]) -> tuple[int, str, Iterable[bytes]]:
        if body["messages"][-1]["content"] == "tell me a long story":
            return 200, "text/event-stream", sse(*[f"word{i} " for i in range(100)], pause=0.1)  # 10 s
        return 200, "text/event-stream", sse("hello")

    with recording_server(answer) as (url, recorded):
        terminal = Terminal(["chat", "functions/smollm2-chat", "--url", url])
        try:
            terminal.read_until(b">>> ")
            terminal.write(b"tell me a long story\r")
            terminal.read_until(b"word1 ")
            terminal.write(b"\x03")  # Ctrl-C while the reply streams
            terminal.read_until(b"reply stopped")
            terminal.read_until(b">>> ")
            terminal.write(b"hi\r")
            terminal.read_until(b"hello")
            terminal.read_until(b">>> ")
            terminal.write(b"\x03")  # Ctrl-C at the prompt
            assert terminal.exit_code() == 0, terminal.output
        finally:
            terminal.close()
    assert "word99" not in terminal.output.decode()
    assert [body["messages"] for body in recorded.bodies][-1] == [{"role": "user", "content": "hi"}]
    assert b"Traceback" not in terminal.output


class Terminal:
    """`pkg` on a pseudo-terminal of its own, as a user at a terminal runs it (Ctrl-C: `\\x03`)."""

    def __init__(self, args: list[str], timeout: float = 30.0) -> None:
        self.timeout = timeout
        self.output = b""
        self.matched = 0  # where the last `read_until` match ended
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: pkg, its session led by it, this terminal its own
            # As a terminal's shell starts it: a suite started in the background (`cmd &`) ignores SIGINT, and
            # an ignored signal stays ignored across exec, so Python would never raise KeyboardInterrupt.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.chdir(REPO)
            os.execve(sys.executable, [sys.executable, "-m", "packager.cli", *args], {**os.environ, "COLUMNS": "200"})

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def read_until(self, wanted: bytes) -> None:
        """Wait for `wanted` after what the previous call matched (one read may hold a reply and the next prompt)."""
        start = self.matched
        deadline = time.monotonic() + self.timeout
        while wanted not in self.output[start:]:
            assert time.monotonic() < deadline, f"no {wanted!r} in {self.output[start:]!r}"
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    self.output += os.read(self.fd, 4096)
                except OSError:  # the terminal closed: pkg is gone
                    pytest.fail(f"pkg ended before {wanted!r}: {self.output[start:]!r}")
        self.matched = self.output.index(wanted, start) + len(wanted)

    def wait_blocked(self) -> None:
        """Wait until pkg sleeps (at a prompt: in readline's select).

        CPython's readline shows the prompt, then selects on stdin with no timeout, and reads a pending signal
        only when that select is interrupted: a Ctrl-C that lands in between is held until the next key. A user
        never types that fast; a test on a loaded machine can, so it waits for the select as a user would."""
        deadline = time.monotonic() + self.timeout
        while Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "S":
            assert time.monotonic() < deadline, "pkg never waited for input"
            time.sleep(0.01)

    def exit_code(self) -> int:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):
                    self.output += os.read(self.fd, 4096)
        pytest.fail(f"pkg did not exit: {self.output[-500:]!r}")

    def close(self) -> None:
        kill_session(self.pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        os.close(self.fd)
