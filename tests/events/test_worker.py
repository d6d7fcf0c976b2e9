"""The long-poll worker against the moto server: nothing lost, nothing twice, poison to the DLQ."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from runtime.events.worker import Worker, WorkerConfig
from tests.events.conftest import EngineUnderTest, Queues, chat_envelope, make_queues, queue_handler
from tests.events.workers import wait_for, worker_process
from tests.fixtures.moto_server import MotoServer


def s3_reply(queues: Queues, request_id: str) -> dict[str, str]:
    return {"s3": f"s3://{queues.bucket}/out/{request_id}"}


def completion_envelope(request_id: str, reply_to: dict[str, str]) -> dict[str, Any]:
    body = {"prompt": f"Item {request_id}:", "max_tokens": 4}
    return {"request_id": request_id, "kind": "completion", "body": body, "reply_to": reply_to}


def send_mixed_load(queues: Queues, total: int) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """`total` messages, 5% of them malformed; returns S3-replied ids (to key), SQS-replied ids, malformed ids."""
    s3_ids: dict[str, str] = {}
    sqs_ids: dict[str, str] = {}
    malformed: set[str] = set()
    poison = [
        lambda i: queues.send_raw('{"request_id": "truncated'),
        lambda i: queues.send_raw("[1, 2, 3]"),
        lambda i: queues.send_raw(json.dumps({"request_id": f"p-{i}", "kind": "chat", "body": {}, "reply_to": {}})),
        lambda i: queues.send(chat_envelope(f"p-{i}", s3_reply(queues, f"p-{i}"), temperature=7)),
        lambda i: queues.send(chat_envelope(f"p-{i}", s3_reply(queues, f"p-{i}"), max_token=3)),
    ]
    for i in range(total):
        request_id = f"r-{i:03d}"
        if i % 20 == 7:
            malformed.add(poison[(i // 20) % len(poison)](i))
        elif i % 10 == 3:
            queues.send(chat_envelope(request_id, {"sqs": queues.reply_url}, content=f"Say {i}."))
            sqs_ids[request_id] = request_id
        elif i % 10 == 5:
            queues.send(completion_envelope(request_id, s3_reply(queues, request_id)), as_msgpack=i % 20 == 5)
            s3_ids[request_id] = f"out/{request_id}"
        else:
            queues.send(chat_envelope(request_id, s3_reply(queues, request_id), content=f"Count to {i % 7}."))
            s3_ids[request_id] = f"out/{request_id}"
    return s3_ids, sqs_ids, malformed


def stored_keys(queues: Queues) -> set[str]:
    return set(queues.versions("out/"))


def ledger_results(queues: Queues) -> set[str]:
    return {key.rsplit("/", 1)[1] for key in queues.versions("ledger/results/")}


def assert_exactly_one_result_each(queues: Queues, s3_ids: dict[str, str], sqs_ids: dict[str, str]) -> None:
    versions = queues.versions("out/")
    expected = set(s3_ids.values())
    assert expected <= set(versions)
    assert {key: n for key, n in versions.items() if key in expected and n != 1} == {}
    for key in list(expected)[:20]:
        data = queues.s3.get_object(Bucket=queues.bucket, Key=key)
        if data["ContentType"] == "application/json":
            record = json.loads(data["Body"].read())
            assert record["status"] == 200, record
            assert record["body"]["object"] in ("chat.completion", "text_completion")
    ledger = queues.versions("ledger/results/")
    assert {key.rsplit("/", 1)[1]: n for key, n in ledger.items()} == dict.fromkeys(sqs_ids, 1)
    bodies: dict[str, set[str]] = defaultdict(set)
    for message in queues.drain(queues.reply_url):
        bodies[message["MessageAttributes"]["request-id"]["StringValue"]].add(message["Body"])
    assert set(bodies) == set(sqs_ids)
    assert {request_id: len(b) for request_id, b in bodies.items() if len(b) != 1} == {}  # resends are identical


@pytest.mark.real_model
def test_200_messages_5_percent_malformed(
    demo_bundle: Path, moto_server: MotoServer, aws_env: dict[str, str], tmp_path: Path
) -> None:
    queues = make_queues(moto_server, max_receive_count=2)
    s3_ids, sqs_ids, malformed = send_mixed_load(queues, 200)
    assert len(malformed) == 10 and len(s3_ids) + len(sqs_ids) == 190

    with worker_process(demo_bundle, queues, aws_env, tmp_path) as worker:
        worker.wait_ready()

        def finished() -> bool:
            return len(stored_keys(queues) & set(s3_ids.values())) == len(s3_ids) and queues.depth() == 0

        wait_for(finished, 400, lambda: f"not finished; depth {queues.depth()}\n{worker.log()[-3000:]}", every=1)
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0

    assert_exactly_one_result_each(queues, s3_ids, sqs_ids)
    dead = queues.drain(queues.dlq_url)
    assert {m["MessageId"] for m in dead} == malformed
    errors = {key.rsplit("/", 1)[1].removesuffix(".json") for key in queues.versions("ledger/errors/")}
    assert errors == malformed  # each rejection's reason is kept under its message id
    validation = queues.result("out/p-67")  # temperature=7: the same 400 the HTTP endpoint gives
    assert validation is not None and validation.status == 400
    assert validation.body["error"]["param"] == "temperature"
    assert queues.depth() == 0
    assert "rejected" in worker.log()


@pytest.mark.real_model
def test_a_sigkilled_worker_loses_nothing_and_duplicates_nothing(
    demo_bundle: Path, moto_server: MotoServer, aws_env: dict[str, str], tmp_path: Path
) -> None:
    queues = make_queues(moto_server, visibility_timeout=4, max_receive_count=4)
    s3_ids = {}
    for i in range(32):
        request_id = f"k-{i:02d}"
        queues.send(
            chat_envelope(request_id, s3_reply(queues, request_id), content=f"Tell me about {i}.", max_tokens=8)
        )
        s3_ids[request_id] = f"out/{request_id}"
    flags = ("--visibility-timeout", "4")
    with worker_process(demo_bundle, queues, aws_env, tmp_path, *flags) as first:
        first.wait_ready()
        wait_for(lambda: len(stored_keys(queues)) >= 8, 300, lambda: first.log()[-3000:], every=0.1)
        first.signal(signal.SIGKILL)
        first.wait(timeout=10)
    done_by_first = len(stored_keys(queues))
    assert done_by_first < len(s3_ids), "the first worker finished everything before it was killed"

    with worker_process(demo_bundle, queues, aws_env, tmp_path, *flags) as second:
        wait_for(
            lambda: stored_keys(queues) == set(s3_ids.values()) and queues.depth() == 0,
            300,
            lambda: f"{len(stored_keys(queues))} results, depth {queues.depth()}\n{second.log()[-3000:]}",
            every=0.5,
        )
        second.signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
    assert_exactly_one_result_each(queues, s3_ids, {})
    assert queues.drain(queues.dlq_url) == []


@pytest.mark.real_model
def test_sigterm_finishes_in_flight_messages_and_leaves_the_rest_queued(
    demo_bundle: Path, moto_server: MotoServer, aws_env: dict[str, str], tmp_path: Path
) -> None:
    queues = make_queues(moto_server, visibility_timeout=60)
    for i in range(6):
        queues.send(chat_envelope(f"t-{i}", s3_reply(queues, f"t-{i}"), max_tokens=96, ignore_eos=True))
    with worker_process(demo_bundle, queues, aws_env, tmp_path, "--max-in-flight", "2") as worker:
        worker.wait_ready()
        not_visible = "ApproximateNumberOfMessagesNotVisible"

        def in_flight() -> int:
            attributes = queues.sqs.get_queue_attributes(QueueUrl=queues.url, AttributeNames=[not_visible])
            return int(attributes["Attributes"][not_visible])

        wait_for(lambda: in_flight() == 2, 30, lambda: worker.log()[-3000:], every=0.1)
        assert stored_keys(queues) == set()
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
    assert len(stored_keys(queues)) == 2  # the two in flight finished and were stored
    assert queues.depth() == 4  # the rest stay queued for the next worker, untouched
    assert len(queues.drain(queues.url)) == 4
    assert "stopping: no new messages; 2 in flight" in worker.log()


@pytest.mark.real_model
def test_a_generation_longer_than_the_visibility_timeout_runs_once(
    queues: Queues, engine_under_test: EngineUnderTest
) -> None:
    # Long enough to outlast the visibility window even on a fast, idle machine (~100 tok/s); a window of 2 s
    # leaves a loaded machine's moto 1.3 s to answer each extension (sent every 0.67 s).
    visibility, tokens = 2, 400
    queues.send(chat_envelope("long", s3_reply(queues, "long"), max_tokens=tokens, ignore_eos=True))
    handler = queue_handler(engine_under_test, queues)
    config = WorkerConfig(queues.url, max_in_flight=4, visibility_timeout=visibility, wait_time=1)
    sqs = CountingExtensions(queues.sqs)
    worker = Worker(sqs, handler, config)
    stolen: list[dict[str, Any]] = []
    watching = threading.Event()

    def competing_consumer() -> None:
        """Another worker polling the same queue: it must never get the message while it is in flight."""
        while not watching.is_set():
            stolen.extend(queues.receive(count=10, wait=0))
            time.sleep(0.2)

    async def run_until_stored() -> float:
        running = asyncio.create_task(worker.run())
        while worker.stats.received == 0:
            await asyncio.sleep(0.05)
        started = time.perf_counter()
        thread = threading.Thread(target=competing_consumer)
        thread.start()
        try:
            # Off the loop (a blocking S3 GET here would delay the worker's extensions on the same loop).
            while (
                await asyncio.to_thread(queues.result, "out/long") is None
                and not stolen
                and time.perf_counter() - started < 300
            ):
                await asyncio.sleep(0.2)
        finally:
            watching.set()
            thread.join()
        elapsed = time.perf_counter() - started
        worker.stop()
        await running
        return elapsed

    elapsed = asyncio.run(run_until_stored())
    assert stolen == []
    assert elapsed > visibility, f"the generation took {elapsed:.1f} s: too short to test the extension"
    assert sqs.extensions >= 2  # kept hidden by extending it, not by the window alone
    assert worker.stats.received == 1
    assert worker.stats.outcomes == {"done": 1}
    result = queues.result("out/long")
    assert result is not None and result.body["usage"]["completion_tokens"] == tokens
    assert queues.versions("out/") == {"out/long": 1}
    assert queues.depth() == 0


class CountingExtensions:
    """The real SQS client, counting the worker's visibility extensions."""

    def __init__(self, sqs: Any) -> None:
        self._sqs = sqs
        self.extensions = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sqs, name)

    def change_message_visibility_batch(self, **request: Any) -> Any:
        self.extensions += 1
        return self._sqs.change_message_visibility_batch(**request)
