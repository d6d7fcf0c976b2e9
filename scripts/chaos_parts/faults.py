"""The chaos run's faults, injected at random while the traffic runs, and how long each took to recover from.

Kinds (each chosen in turn from a shuffled deck, so all of them happen about as often):
- `kill_server`: SIGKILL a running function server (the gateway starts it again on its next request);
- `kill_gateway`: SIGKILL the gateway; the run's supervisor (as an init system would) starts it again with
  `pkg gateway start` once it sees the process gone;
- `disk_full_snapshot`: fill the small tmpfs under the chat function's state (its process snapshot, its
  record, its log) for a while: idle stops cannot dump, records cannot be written;
- `disk_full_prepack`: redeploy the lora function with a tiny tmpfs mounted over its prepacked weights
  (`build/NAME/local`), so the derived-weight write runs out of space; unmounted after;
- `corrupt_state`: garbage over a function's `state.json`;
- `corrupt_snapshot`: garbage over the chat function's `process-snapshot/snapshot.json`;
- `redeploy`: `pkg deploy` of a function while its traffic runs (the chat function's changes each time);
- `kill_worker`: SIGKILL the SQS worker; the supervisor starts another.

Recovery time: from the fault (for a full disk: from the moment it has space again) until a probe request to
the function concerned (for the worker: a probe message's result) succeeds, probing every 0.1 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from scripts.chaos_parts import world as worlds
from scripts.chaos_parts.world import Function, World

KINDS = (
    "kill_server", "kill_gateway", "disk_full_snapshot", "disk_full_prepack", "corrupt_state",
    "corrupt_snapshot", "redeploy", "kill_worker",
)  # fmt: skip
PROBE_LIMIT_S = 180.0
DISK_FULL_S = 12.0
PREPACK_TMPFS = "8m"
PROMPTS = ("You are a helpful AI assistant named SmolLM, trained by Hugging Face", "You are a terse assistant.")


@dataclass
class Fault:
    kind: str
    target: str
    at: float  # monotonic, when injected
    recovery_s: float | None = None  # None: never recovered within PROBE_LIMIT_S
    note: str = ""


@dataclass
class Supervisor:
    """Restarts the gateway and the worker when they are gone, as an init system would."""

    world: World
    restarts: dict[str, int] = field(default_factory=lambda: {"gateway": 0, "worker": 0})
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="supervisor")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            pid = self.world.gateway_pid()
            if pid is not None and not _alive(pid) and self.world.pkg("gateway", "start").returncode == 0:
                self.restarts["gateway"] += 1
            queue = self.world.queue
            if queue is not None and queue.worker is not None and queue.worker.poll() is not None:
                worlds.start_worker(self.world)
                self.restarts["worker"] += 1


class Faults:
    def __init__(self, world: World, seed: int) -> None:
        self.world = world
        self.random = random.Random(seed)
        self.done: list[Fault] = []
        self._deck: list[str] = []
        self._prompt = 0

    def next_kind(self) -> str:
        if not self._deck:
            self._deck = list(KINDS)
            self.random.shuffle(self._deck)
        return self._deck.pop()

    def inject(self, kind: str) -> Fault:
        fault = getattr(self, kind)()
        self.done.append(fault)
        return fault

    # the faults

    def kill_server(self) -> Fault:
        """SIGKILL a function's server while it streams an answer (the stream is started here, waking it if it
        was idle): the stream must end with an error event, never as if it were whole."""
        function = self.random.choice([f for f in self.world.functions.values() if f.kind != "embed"])
        outcome: list[str] = []
        streaming = threading.Event()
        streamer = threading.Thread(target=_stream_until_told, args=(self.world, function, streaming, outcome))
        streamer.start()
        if not streaming.wait(60):
            streamer.join(120)
            return Fault("kill_server", function.kind, time.monotonic(), None, f"no stream to cut: {outcome}")
        pid = self._running_pid(function)
        at = time.monotonic()
        if pid is not None:
            _kill_group(pid)
        streamer.join(120)
        fault = self._recovered(Fault("kill_server", function.kind, at), function)
        fault.note = f"the stream in flight: {outcome[0] if outcome else 'no outcome (hung)'}"
        return fault

    def kill_gateway(self) -> Fault:
        pid = self.world.gateway_pid()
        at = time.monotonic()
        if pid is not None:
            _kill_group(pid)
        return self._recovered(Fault("kill_gateway", "gateway", at), self.world.functions["chat"])

    def disk_full_snapshot(self) -> Fault:
        function = self.world.functions["chat"]
        filler = self.world.state_dir(function) / "filler"
        at = time.monotonic()
        _fill(filler)
        # A redeploy on the full disk: its record, its log and its process snapshot have nowhere to go. The
        # traffic runs on meanwhile: idle stops (each dumps a snapshot) and wakes hit the full disk too.
        deployed = self.world.pkg("deploy", str(function.folder))
        last = deployed.stderr.strip().splitlines()[-1:] or [""]
        how = "a traceback" if "Traceback" in deployed.stderr else last[0][:200] if deployed.returncode else "no error"
        time.sleep(max(0.0, at + DISK_FULL_S - time.monotonic()))
        filler.unlink(missing_ok=True)
        freed = time.monotonic()
        fault = self._recovered(Fault("disk_full_snapshot", "chat", freed), function)
        fault.note = f"full for {freed - at:.0f} s; pkg deploy meanwhile: exit {deployed.returncode} with {how}"
        return fault

    def disk_full_prepack(self) -> Fault:
        function = self.world.functions["lora"]
        local = self.world.root / "build" / function.name / "local"
        worlds.mount_tmpfs(self.world, local, PREPACK_TMPFS)
        started = time.monotonic()
        try:
            deployed = self.world.pkg("deploy", str(function.folder))
        finally:
            worlds.unmount(local)
            self.world.mounts.remove(local)
        said = " ".join(deployed.stdout.split() + deployed.stderr.split())
        why = "weights not prepacked" if "weights not prepacked" in said else said[-200:]
        took = time.monotonic() - started
        fault = self._recovered(Fault("disk_full_prepack", "lora", time.monotonic()), function)
        fault.note = f"deploy under the full disk took {took:.0f} s, exit {deployed.returncode}: {why}"
        return fault

    def corrupt_state(self) -> Fault:
        function = self.random.choice(list(self.world.functions.values()))
        state = self.world.state_dir(function) / "state.json"
        at = time.monotonic()
        try:
            state.write_text('{"function": "' + function.name + '", "url": ')  # cut short, as by a crash
        except OSError as exc:
            return Fault("corrupt_state", function.kind, at, 0.0, f"could not write: {exc}")
        fault = self._recovered(Fault("corrupt_state", function.kind, at), function)
        repaired = _parses(state)
        deadline = time.monotonic() + 30
        while not repaired and time.monotonic() < deadline:
            time.sleep(0.1)
            repaired = _parses(state)
        fault.note = "state.json rewritten by the gateway" if repaired else "state.json still corrupt after 30 s"
        return fault

    def corrupt_snapshot(self) -> Fault:
        function = self.world.functions["chat"]
        meta = self.world.state_dir(function) / "process-snapshot" / "snapshot.json"
        at = time.monotonic()
        if not meta.is_file():
            return Fault("corrupt_snapshot", "chat", at, 0.0, "no snapshot on disk at that moment")
        try:
            meta.write_text("{not json")
        except OSError as exc:
            return Fault("corrupt_snapshot", "chat", at, 0.0, f"could not write: {exc}")
        return self._recovered(Fault("corrupt_snapshot", "chat", at), function)

    def redeploy(self) -> Fault:
        function = self.random.choice(list(self.world.functions.values()))
        note = "unchanged"
        if function.kind == "chat":
            toml = function.folder / "function.toml"
            old, new = PROMPTS[self._prompt % 2], PROMPTS[(self._prompt + 1) % 2]
            toml.write_text(toml.read_text().replace(old, new))
            self._prompt += 1
            note = "changed (system prompt)"
        at = time.monotonic()
        deployed = self.world.pkg("deploy", str(function.folder))
        fault = Fault("redeploy", function.kind, at, time.monotonic() - at)
        failed = f": {deployed.stderr[-300:]}" if deployed.returncode else ""
        fault.note = f"{note}; exit {deployed.returncode}{failed}"
        return fault

    def kill_worker(self) -> Fault:
        queue = self.world.queue
        at = time.monotonic()
        if queue is None or queue.worker is None or queue.worker.poll() is not None:
            return Fault("kill_worker", "worker", at, 0.0, "no worker running at that moment")
        queue.worker.send_signal(signal.SIGKILL)
        request_id = uuid.uuid4().hex
        envelope = {
            "request_id": request_id, "kind": "embedding", "body": {"input": ["probe"]},
            "reply_to": {"s3": f"s3://{queue.bucket}/probes/{request_id}.json"},
        }  # fmt: skip
        queue.client("sqs").send_message(QueueUrl=queue.url, MessageBody=json.dumps(envelope))
        s3 = queue.client("s3")
        deadline = at + PROBE_LIMIT_S
        while time.monotonic() < deadline:
            try:
                s3.head_object(Bucket=queue.bucket, Key=f"probes/{request_id}.json")
                return Fault("kill_worker", "worker", at, time.monotonic() - at)
            except s3.exceptions.ClientError:
                time.sleep(0.1)
        return Fault("kill_worker", "worker", at, None, "the probe message got no result")

    # helpers

    def _running_pid(self, function: Function) -> int | None:
        try:
            record = self.world.record(function)
        except (OSError, ValueError):
            return None
        pid = int(record["pid"])
        return pid if record.get("idle_since") is None and _alive(pid) else None

    def _recovered(self, fault: Fault, function: Function) -> Fault:
        """Probe `function` through the gateway every 0.1 s until it answers; the time since `fault.at`."""
        deadline = fault.at + PROBE_LIMIT_S
        while time.monotonic() < deadline:
            if _probe(self.world, function):
                fault.recovery_s = time.monotonic() - fault.at
                return fault
            time.sleep(0.1)
        return fault


def _stream_until_told(world: World, function: Function, streaming: threading.Event, outcome: list[str]) -> None:
    """A long streamed answer; `streaming` is set at its first chunk; how it ended goes into `outcome`."""
    body = {"model": function.model, "messages": [{"role": "user", "content": "Tell a long story."}]}
    body.update({"max_tokens": 400, "stream": True})
    done, error = False, ""
    try:
        with httpx.stream(
            "POST", world.gateway_url + "/v1/chat/completions", json=body,
            headers={"authorization": f"Bearer {function.key}"}, timeout=httpx.Timeout(60.0, connect=5.0),
        ) as events:  # fmt: skip
            for line in events.iter_lines():
                if line.startswith("data:"):
                    streaming.set()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data:") and '"error"' in line:
                    error = json.loads(line.removeprefix("data:"))["error"].get("code") or "error"
    except httpx.HTTPError as exc:
        outcome.append(f"the connection broke ({type(exc).__name__})")
        return
    outcome.append(f"error event {error}" if error else "[DONE] (not cut)" if done else "TRUNCATED as if whole")


def _probe(world: World, function: Function) -> bool:
    if function.kind == "embed":
        path, body = "/v1/embeddings", {"model": function.model, "input": "probe"}
    else:
        path, body = "/v1/chat/completions", {"model": function.model, "messages": [{"role": "user", "content": "Hi"}]}
        body["max_tokens"] = 2
    try:
        answer = httpx.post(
            world.gateway_url + path, json=body, headers={"authorization": f"Bearer {function.key}"}, timeout=60
        )
    except httpx.HTTPError:
        return False
    return answer.status_code == 200


def _fill(filler: Path) -> None:
    """Take every free page of the file system `filler` is on (unbuffered: nothing left to fail at close)."""
    try:
        descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    except OSError:
        return  # full already
    try:
        for size in (1 << 20, 4096):
            with contextlib.suppress(OSError):
                while True:
                    os.write(descriptor, b"\0" * size)
    finally:
        os.close(descriptor)


def _parses(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:
        subprocess.run(["kill", "-9", str(pid)], check=False)
