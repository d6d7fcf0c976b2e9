"""Cold start, measured: fresh `python -m runtime serve` processes from exec to the first streamed chat token.

Each run execs the server, polls `/ready`, streams one chat completion and reads the server's start-up
timeline (`runtime.timeline`) from its log, so every phase lands on the exec → first token timeline:
interpreter, imports, bundle verification, session, tokenizer, snapshot restore, the first step. Runs
of every variant and peer are interleaved round by round (the machine is shared: only ratios inside
one run mean anything). Peers (onnxruntime-genai, llama-cpp-python) run in-process through the bench's
own cold worker (`packager/bench/coldstart.py`), which stamps import, load and first token the same way.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx

from packager.processes import precompile_runtime, stop_process
from packager.targets.local.server_process import alive, terminate
from runtime.timeline import parse_timeline

# Spans of the server's timeline reported as phases, in start-up order (spans on threads overlap).
TIMELINE_PHASES = (
    "imports_server",
    "bundle_verify",
    "imports_onnxruntime",
    "imports_engine",
    "session",
    "tokenizer",
    "snapshot_restore",
    "system_prompt_prefill",
    "first_step",
)
READY_TIMEOUT = 120.0
STOP_GRACE = 10.0


@dataclass(frozen=True)
class ServerVariant:
    """One way of starting the server; `flags` are added to `python -m runtime serve BUNDLE`."""

    name: str
    flags: tuple[str, ...]


@dataclass(frozen=True)
class ChatProbe:
    """The request each fresh server gets: a chat with the function's system prompt."""

    system_prompt: str | None
    user: str = "What is the capital of France? Answer in one word."
    max_tokens: int = 4
    path: ClassVar[str] = "/v1/chat/completions"

    def body(self) -> dict[str, Any]:
        messages = [{"role": "user", "content": self.user}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return {"model": "bench", "messages": messages, "max_tokens": self.max_tokens, "stream": True, "temperature": 0}


@dataclass(frozen=True)
class CompletionProbe:
    """A plain streamed completion of `prompt` (what `scripts/bench.py` sends every system it starts)."""

    prompt: str
    extra_body: dict[str, Any] = field(default_factory=dict)
    max_tokens: int = 1
    path: ClassVar[str] = "/v1/completions"

    def body(self) -> dict[str, Any]:
        fields = {"prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True, "temperature": 0}
        return {"model": "bench", **fields, **self.extra_body}


Probe = ChatProbe | CompletionProbe


@dataclass
class ColdSample:
    """One fresh process; every figure in seconds after exec, or a phase's duration."""

    exec_to_ready: float
    exec_to_first_token: float
    ready_to_first_token: float  # the first request's TTFT as the client sees it
    phases: dict[str, float] = field(default_factory=dict)
    first_text: str = ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_server_once(
    python: str, bundle: Path, variant: ServerVariant, probe: ChatProbe, threads: int, state_dir: Path
) -> ColdSample:
    """Exec a server, wait for `/ready`, stream one chat completion, stop it; the sample with its phases."""
    port = free_port()
    precompile_runtime()
    command = server_command(python, bundle, variant, threads, port)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "ONNXFN_STATE_DIR": str(state_dir)}
    # The client exists before the exec: building one (its TLS context) is the bench's cost, not the server's.
    with tempfile.TemporaryDirectory(prefix="coldstart-") as tmp, _client(port) as client:
        log_path = Path(tmp) / "server.log"
        with log_path.open("wb") as log:
            exec_time = time.monotonic()
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready = _wait_ready(client, process, log_path)
            first, text = _first_token(client, probe)
        finally:
            stop_process(process)
        timeline = parse_timeline(log_path.read_text(errors="replace"))
    return ColdSample(
        exec_to_ready=ready - exec_time,
        exec_to_first_token=first - exec_time,
        ready_to_first_token=first - ready,
        phases=timeline_phases(timeline, exec_time),
        first_text=text,
    )


def server_command(python: str, bundle: Path, variant: ServerVariant, threads: int, port: int) -> list[str]:
    return [
        *(python, "-m", "runtime", "serve", str(bundle), "--port", str(port), "--model-name", "bench"),
        *("--threads", str(threads), "--log-level", "info", *variant.flags),
    ]


class ProcessSnapshotRuns:
    """Scale from zero through the `local` target's process snapshot: `criu restore` → ready → first token.

    The snapshot is taken once, of a server started as `pkg deploy` starts one (graphs with prepacked weights,
    a pid namespace of its own, the prompt graph built, then dumped); every call restores a copy, streams the
    probe and stops it.
    """

    def __init__(
        self, python: str, bundle: Path, variant: ServerVariant, probe: Probe, threads: int, work: Path
    ) -> None:
        from packager.targets.local.process_snapshot import Criu

        self.criu = Criu.find()  # SnapshotUnavailable, with the reason, where CRIU cannot run
        self.bundle, self.prepacked, self.threads = bundle, work / "prepacked", threads
        flags = ServerVariant(variant.name, (*variant.flags, "--prepacked", str(self.prepacked)))
        self.command = server_command(python, bundle, flags, threads, free_port())
        self.probe, self.work = probe, work
        self.captured: Any = None  # process_snapshot.Captured once taken: the images' bytes, the dump's time
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "ONNXFN_STATE_DIR": str(work / "state"),
                    "ORT_DISABLE_TELEMETRY": "1"}  # fmt: skip
        self.key: Any = None

    @property
    def port(self) -> int:
        return int(self.command[self.command.index("--port") + 1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __call__(self) -> ColdSample:
        from packager.targets.local import process_snapshot

        if self.key is None:
            self.key = self._capture()
        with _client(self.port) as client:
            exec_time = time.monotonic()
            try:
                pid = process_snapshot.restore(self.work, self.key, self.criu, self.work / "server.log")
            except process_snapshot.SnapshotUnavailable as exc:
                raise RuntimeError(str(exc)) from exc
            restored = time.monotonic()
            try:
                ready = _wait_ready(client, _Pid(pid), self.work / "server.log")
                first, text = _first_token(client, self.probe)
            finally:
                terminate(pid, STOP_GRACE)
        return ColdSample(
            exec_to_ready=ready - exec_time,
            exec_to_first_token=first - exec_time,
            ready_to_first_token=first - ready,
            phases={"criu_restore": restored - exec_time},
            first_text=text,
        )

    def _capture(self) -> Any:
        from packager.targets.local import process_snapshot
        from runtime.bundle import open_bundle
        from runtime.engine.graphs import bundle_graphs
        from runtime.engine.prepacked import PrepackedGraphs

        precompile_runtime()
        bundle = open_bundle(self.bundle, verify=False)
        prepacked = PrepackedGraphs(self.prepacked)
        prepacked.write(bundle, bundle_graphs(bundle), self.threads)
        with (self.work / "server.log").open("wb") as log:
            launcher, pid = process_snapshot.launch_isolated(self.command, log, self.env)
        try:
            with _client(self.port) as client:
                _wait_ready(client, launcher, self.work / "server.log")
            process_snapshot.wait_until_warm(self.url, {}, READY_TIMEOUT)
            command = tuple(self.command)
            key = process_snapshot.SnapshotKey.current("bench", command, self.criu.version, None, prepacked.digest())
            self.captured = process_snapshot.capture(self.work, pid, key, self.criu)
        except process_snapshot.SnapshotUnavailable as exc:
            raise RuntimeError(str(exc)) from exc
        finally:
            terminate(pid, STOP_GRACE)
            launcher.wait()
        return key


class _Pid:
    """`poll()` for a process that is not our child (a restored server)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if not alive(self.pid):
            self.returncode = -1
        return self.returncode


def timeline_phases(timeline: dict[str, Any] | None, exec_time: float) -> dict[str, float]:
    """Durations of the server's spans, plus `interpreter`: exec until the runtime's first import."""
    if timeline is None:
        return {}
    phases = {"interpreter": timeline["runtime_imported"] - exec_time}
    for name in TIMELINE_PHASES:
        if name in timeline["spans"]:
            start, end = timeline["spans"][name]
            phases[name] = end - start
    return phases


def _client(port: int) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0)


def _wait_ready(client: httpx.Client, process: subprocess.Popen[bytes] | _Pid, log_path: Path) -> float:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready:\n{tail}")
        try:
            if client.get("/ready").status_code == 200:
                return time.monotonic()
        except httpx.TransportError:
            pass
        time.sleep(0.002)
    raise TimeoutError(f"the server was not ready after {READY_TIMEOUT} s")


def _first_token(client: httpx.Client, probe: Probe) -> tuple[float, str]:
    with client.stream("POST", probe.path, json=probe.body()) as response:
        if response.status_code != 200:
            raise RuntimeError(f"chat completion failed: HTTP {response.status_code} {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or [{}]
            content = choices[0].get("delta", {}).get("content") or choices[0].get("text")
            if content:
                return time.monotonic(), content
    raise RuntimeError("the stream carried no token")
