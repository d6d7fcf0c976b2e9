"""Request streams: outputs pushed on the engine thread reach sync and async consumers, woken once a step."""

from __future__ import annotations

import asyncio
import threading

from runtime.engine.request import SequenceOutput
from runtime.engine.stream import RequestStream, Wakeups


def _output(token: int) -> SequenceOutput:
    return SequenceOutput(
        request_id="r", index=0, token_ids=(token,), text=str(token), prompt_tokens=1, completion_tokens=1
    )


def _streams(count: int, wakeups: Wakeups) -> list[RequestStream]:
    return [RequestStream(f"r{i}", 0.0, lambda _id: None, wakeups) for i in range(count)]


def test_async_consumers_wait_for_the_flush_and_share_one_self_pipe_write() -> None:
    wakeups = Wakeups()
    streams = _streams(8, wakeups)

    async def main() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        scheduled: list[int] = []  # the consumers each of the streams' wake-up callbacks wakes
        real = loop.call_soon_threadsafe

        def counting(callback, *args):  # type: ignore[no-untyped-def]
            if callback.__module__ == "runtime.engine.stream":  # not asyncio.to_thread's own result delivery
                scheduled.append(len(args[0]))
            return real(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

        async def consume(stream: RequestStream) -> list[int]:
            return [token async for output in stream for token in output.token_ids]

        tasks = [asyncio.ensure_future(consume(s)) for s in streams]
        await asyncio.sleep(0)  # every consumer now waits on its stream

        def engine_step() -> None:
            for token in (1, 2):
                for stream in streams:
                    stream.push(_output(token), 0.0)
            for stream in streams:
                stream.close()

        await asyncio.to_thread(engine_step)
        await asyncio.sleep(0.05)
        pending = [t for t in tasks if not t.done()]
        assert len(pending) == 8, "a consumer woke before the step's flush"
        assert scheduled == [], "pushing must not write the event loop's self-pipe"
        await asyncio.to_thread(wakeups.flush)
        results = await asyncio.gather(*tasks)
        assert scheduled == [8], "eight consumers of one loop are woken by one call_soon_threadsafe"
        return results

    assert asyncio.run(main()) == [[1, 2]] * 8


def test_a_sync_consumer_needs_no_flush() -> None:
    wakeups = Wakeups()
    (stream,) = _streams(1, wakeups)
    received: list[int] = []
    consumer = threading.Thread(target=lambda: received.extend(t for o in stream for t in o.token_ids))
    consumer.start()
    stream.push(_output(7), 0.0)
    stream.close()
    consumer.join(timeout=5)
    assert received == [7]


def test_a_flush_for_a_closed_loop_is_dropped() -> None:
    wakeups = Wakeups()
    (stream,) = _streams(1, wakeups)

    async def start_waiting() -> None:
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        waiting.cancel()

    asyncio.run(start_waiting())  # the loop closes with the consumer's waiter registered
    stream.push(_output(1), 0.0)
    wakeups.flush()  # must not raise: nobody is left to wake
