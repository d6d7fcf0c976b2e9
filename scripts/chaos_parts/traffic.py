"""The chaos run's clients: mixed requests through the gateway, each judged as a client would need it judged.

Kinds: `chat-stream` (SSE), `chat` (one JSON answer), `embed`, `lora-stream` (an adapter as the model), and
`queue` (SQS messages for the worker). Each client sends a burst of 1-3 requests, then pauses 1-10 s: longer
than the functions' idle timeout most of the time, so they idle and wake all run long.

Clients behave as well-written ones do: a request that reached nothing (connection refused: the gateway is
down) or was told when to come back (429/503 with `Retry-After`) is sent again, within `PATIENCE_S`; any other
error is final. Outcomes:
- `ok`: a whole answer (a stream with its `[DONE]`);
- `failed`: an error the client saw (an HTTP error, a stream's error event: a failure reported as one);
- `hung`: no answer, no error within `HANG_S`;
- `truncated`: a stream that ended cleanly without `[DONE]` and without an error event (a failure that would
  pass for success; the issue's row 4).
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from scripts.chaos_parts.world import Queue, World

HANG_S = 120.0  # no answer in this long: the client hung
PATIENCE_S = 60.0  # how long a client keeps sending again what reached nothing or was told to wait
READ_TIMEOUT_S = 60.0
QUESTION = [{"role": "user", "content": "Name three primary colours."}]


@dataclass(frozen=True)
class Call:
    kind: str
    started: float  # monotonic
    seconds: float
    outcome: str  # ok, failed, hung, truncated
    cause: str = ""  # the error code, status or exception when not ok
    retries: int = 0


class Verdict(Exception):
    """How a request ended when not `ok`: (outcome, cause)."""

    def __init__(self, outcome: str, cause: str, retry_after: float | None = None) -> None:
        super().__init__(f"{outcome}: {cause}")
        self.outcome, self.cause, self.retry_after = outcome, cause, retry_after


class Traffic:
    def __init__(self, world: World, until: float, seed: int) -> None:
        self.world, self.until = world, until
        self.calls: list[Call] = []
        self.sent_messages: list[str] = []  # queue request ids
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._random = random.Random(seed)

    def start(self) -> None:
        for kind, ask in self.kinds().items():
            seed = self._random.randrange(1 << 30)
            thread = threading.Thread(target=self._client, args=(kind, ask, random.Random(seed)), name=kind)
            thread.start()
            self._threads.append(thread)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(HANG_S + PATIENCE_S + 30)

    def kinds(self) -> dict[str, Callable[[], None]]:
        functions = self.world.functions
        return {
            "chat-stream": lambda: self.stream(functions["chat"].model, functions["chat"].key),
            "chat": lambda: self.chat(functions["chat"].model, functions["chat"].key),
            "embed": lambda: self.embed(functions["embed"].model, functions["embed"].key),
            "lora-stream": lambda: self.stream(functions["lora"].model, functions["lora"].key),
            "queue": self.enqueue,
        }

    def _client(self, kind: str, ask: Callable[[], None], rng: random.Random) -> None:
        while time.monotonic() < self.until:
            for _ in range(rng.randint(1, 3)):
                self.record(kind, ask)
            time.sleep(rng.uniform(1.0, 10.0))

    def record(self, kind: str, ask: Callable[[], None]) -> Call:
        """Ask until answered, a final error, or patience runs out; note the outcome."""
        started, retries = time.monotonic(), 0
        while True:
            try:
                ask()
                call = Call(kind, started, time.monotonic() - started, "ok", retries=retries)
            except Verdict as verdict:
                waited = time.monotonic() - started
                if verdict.retry_after is not None and waited < PATIENCE_S:
                    retries += 1
                    time.sleep(min(verdict.retry_after, 2.0))
                    continue
                call = Call(kind, started, waited, verdict.outcome, verdict.cause, retries)
            with self._lock:
                self.calls.append(call)
            return call

    # the requests

    def _post(self, client: httpx.Client, path: str, key: str, body: dict[str, object]) -> httpx.Response:
        try:
            return client.post(path, json=body, headers={"authorization": f"Bearer {key}"})
        except httpx.ConnectError as exc:
            raise Verdict("failed", "gateway unreachable", retry_after=0.5) from exc
        except httpx.TimeoutException as exc:
            raise Verdict("hung", type(exc).__name__) from exc
        except httpx.HTTPError as exc:
            raise Verdict("failed", type(exc).__name__) from exc

    def _client_for(self) -> httpx.Client:
        timeout = httpx.Timeout(connect=5.0, read=READ_TIMEOUT_S, write=30.0, pool=5.0)
        return httpx.Client(base_url=f"{self.world.gateway_url}/v1", timeout=timeout)

    def chat(self, model: str, key: str) -> None:
        with self._client_for() as client:
            body = {"model": model, "messages": QUESTION, "max_tokens": 12}
            answer = self._post(client, "/chat/completions", key, body)
            _check(answer)
            if not answer.json()["choices"][0]["message"]["content"]:
                raise Verdict("failed", "empty answer")

    def embed(self, model: str, key: str) -> None:
        with self._client_for() as client:
            answer = self._post(client, "/embeddings", key, {"model": model, "input": ["a sentence", "another one"]})
            _check(answer)
            if [len(row["embedding"]) for row in answer.json()["data"]] != [384, 384]:
                raise Verdict("failed", "wrong embeddings")

    def stream(self, model: str, key: str) -> None:
        body = {"model": model, "messages": QUESTION, "max_tokens": 24, "stream": True}
        deadline = time.monotonic() + HANG_S
        done = False
        with self._client_for() as client:
            try:
                with client.stream(
                    "POST", "/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
                ) as events:
                    if events.status_code != 200:
                        events.read()
                        _check(events)
                    for line in events.iter_lines():
                        if time.monotonic() > deadline:
                            raise Verdict("hung", "stream longer than the hang limit")
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data:") and '"error"' in line:
                            error = json.loads(line.removeprefix("data:"))["error"]
                            raise Verdict("failed", f"stream error event {error.get('code')}")
            except httpx.ConnectError as exc:
                raise Verdict("failed", "gateway unreachable", retry_after=0.5) from exc
            except httpx.TimeoutException as exc:
                raise Verdict("hung", type(exc).__name__) from exc
            except httpx.HTTPError as exc:  # the connection broke mid-stream: the client sees an error
                raise Verdict("failed", f"stream broke: {type(exc).__name__}") from exc
        if not done:
            raise Verdict("truncated", "ended without [DONE] or an error event")

    def enqueue(self) -> None:
        queue = self.world.queue
        assert queue is not None
        request_id = uuid.uuid4().hex
        envelope = {
            "request_id": request_id, "kind": "embedding", "body": {"input": ["queued sentence"]},
            "reply_to": {"s3": f"s3://{queue.bucket}/results/{request_id}.json"},
        }  # fmt: skip
        try:
            _sqs(queue).send_message(QueueUrl=queue.url, MessageBody=json.dumps(envelope))
        except Exception as exc:  # moto is not a fault target: any failure here is the run's own
            raise Verdict("failed", f"send: {type(exc).__name__}") from exc
        with self._lock:
            self.sent_messages.append(request_id)


_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def _sqs(queue: Queue) -> Any:
    with _clients_lock:  # boto3 clients are thread-safe once made; making one is not
        if "sqs" not in _clients:
            _clients["sqs"] = queue.client("sqs")
        return _clients["sqs"]


def _check(answer: httpx.Response) -> None:
    if answer.status_code == 200:
        return
    try:
        code = answer.json()["error"].get("code") or answer.status_code
    except (ValueError, KeyError, TypeError, AttributeError):
        code = answer.status_code
    retry_after = answer.headers.get("retry-after")
    if answer.status_code in (429, 503) and retry_after is not None and retry_after.isdigit():
        raise Verdict("failed", f"{answer.status_code} {code}", retry_after=float(retry_after))
    raise Verdict("failed", f"{answer.status_code} {code}")
