"""One queue message through the engine: the HTTP endpoints' contract, with the result stored instead of returned.

The request body is validated and answered by the same `runtime.api` functions as `POST /v1/chat/completions`,
`POST /v1/completions`, `POST /v1/embeddings` and `POST /v1/classify`, so a body that gets a 200 over HTTP
gets the same object on the queue, and one that gets a 4xx gets the same error (a kind the bundle does
not serve is the HTTP server's `unsupported_endpoint`). What the frontends (worker, Lambda) do with each
message follows from its `Outcome`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from runtime.api.chat import collect_chat, submit_chat
from runtime.api.classify import classification_body
from runtime.api.completions import collect_completion, submit_completion
from runtime.api.embeddings import embedding_body
from runtime.api.errors import APIError
from runtime.api.grammar_compile import resolve_grammar
from runtime.api.protocol import parse_chat, parse_completion, unsupported
from runtime.api.service import ModelService
from runtime.bundle import GENERATION_TASKS
from runtime.encoder.engine import EncoderEngine
from runtime.engine.request import SamplingParams
from runtime.events.results import ResultStore
from runtime.events.schema import Envelope, MalformedMessage, QueueMessage, Reply, Result, decode_envelope

log = logging.getLogger("runtime.events")


class Outcome(Enum):
    DONE = "done"  # the result is stored: delete the message
    REJECTED = "rejected"  # it can never succeed: leave it to the redrive policy, which moves it to the DLQ
    RETRY = "retry"  # a transient failure (overload, engine, storage): release it for another attempt


@dataclass(frozen=True)
class Handled:
    outcome: Outcome
    request_id: str | None = None
    error: str | None = None


class QueueHandler:
    def __init__(self, service: ModelService, results: ResultStore) -> None:
        self.service = service
        self.results = results

    async def handle(self, message: QueueMessage, *, left_engine: Callable[[], None] | None = None) -> Handled:
        """Run one message to its outcome; `left_engine` is called once, as soon as the engine is done with it
        (before the result is stored), so a frontend can fill the freed slot while storage is under way."""
        called = False

        def once() -> None:
            nonlocal called
            if not called and left_engine is not None:
                called = True
                left_engine()

        try:
            return await self._handle(message, once)
        finally:
            once()

    async def _handle(self, message: QueueMessage, left_engine: Callable[[], None]) -> Handled:
        try:
            envelope = decode_envelope(message, self.service.policy.model_name)
        except MalformedMessage as bad:
            left_engine()
            return await self._reject(message, bad.error, bad.request_id, bad.reply)
        reply = envelope.reply
        try:
            # A first delivery cannot have a result yet, unless a producer reused the request id; the
            # conditional write below keeps that case correct, so only redeliveries pay for the look-up.
            recorded = await asyncio.to_thread(self.results.recorded, reply) if message.receive_count > 1 else None
            result = recorded or await generate(self.service, envelope)
            left_engine()
            if _transient(result.status):
                return Handled(Outcome.RETRY, reply.request_id, _message(result))
            stored = await asyncio.to_thread(self.results.deliver, reply, result, recorded=recorded is not None)
        except Exception as exc:
            log.warning("request %s failed, will retry: %r", reply.request_id, exc)
            return Handled(Outcome.RETRY, reply.request_id, repr(exc))
        if stored.ok:
            return Handled(Outcome.DONE, reply.request_id)
        error = stored.body.get("error", {})
        rejection = APIError(stored.status, str(error.get("message")), param=error.get("param"), code=error.get("code"))
        return await self._reject(message, rejection, reply.request_id, None)

    async def _reject(
        self, message: QueueMessage, error: APIError, request_id: str | None, reply: Reply | None
    ) -> Handled:
        """Record why the message failed (its reply, the ledger), never letting a recording failure retry it."""
        log.warning(
            "message %s (request %s, receive %d) rejected: %s",
            message.message_id, request_id, message.receive_count, error.message,
        )  # fmt: skip
        try:
            if reply is not None:
                failed = Result(reply.request_id, error.status, error.body())
                await asyncio.to_thread(self.results.deliver, reply, failed)
            await asyncio.to_thread(self.results.record_rejection, message, error, request_id)
        except Exception as exc:
            log.warning("message %s: recording its error failed: %r", message.message_id, exc)
        return Handled(Outcome.REJECTED, request_id, error.message)


async def generate(service: ModelService, envelope: Envelope) -> Result:
    """The response body (or error body) the HTTP endpoint would return for the envelope's body."""
    try:
        _check_kind(service, envelope.kind)
        if envelope.kind == "embedding":
            body = await embedding_body(service, envelope.body)
        elif envelope.kind == "classification":
            body = await classification_body(service, envelope.body)
        elif envelope.kind == "chat":
            chat = parse_chat(envelope.body, service.policy)
            _refuse_stream(chat.stream)
            chat = dataclasses.replace(chat, sampling=seeded(chat.sampling, envelope.request_id))
            chat = await resolve_grammar(service, chat)  # an unusable grammar is a stored 400, never a retry
            generation, meta = submit_chat(service, chat)
            body = await collect_chat(generation, meta, chat)
        else:
            completion = parse_completion(envelope.body, service.policy)
            _refuse_stream(completion.stream)
            completion = dataclasses.replace(completion, sampling=seeded(completion.sampling, envelope.request_id))
            generation, meta, echoes = submit_completion(service, completion)
            body = await collect_completion(generation, meta, completion, echoes)
    except APIError as err:
        return Result(envelope.request_id, err.status, err.body())
    return Result(envelope.request_id, 200, body)


def _check_kind(service: ModelService, kind: str) -> None:
    """Refuse a kind the bundle does not serve, as the HTTP routes do (`unsupported_endpoint`)."""
    engine = service.require_engine()
    served = (engine.task,) if isinstance(engine, EncoderEngine) else GENERATION_TASKS
    if kind in served:
        return
    serves = " or ".join(f"'{task}'" for task in served)
    raise APIError(
        400,
        f"{service.policy.model_name} serves {serves} requests, not '{kind}': send kind {serves}",
        param="kind",
        code="unsupported_endpoint",
    )


def seeded(sampling: SamplingParams, request_id: str) -> SamplingParams:
    """Sampling without a seed gets one derived from the request id, so a repeat run reproduces the first."""
    if sampling.seed is not None:
        return sampling
    seed = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1
    return dataclasses.replace(sampling, seed=seed)


def _refuse_stream(stream: bool) -> None:
    if stream:
        raise unsupported("stream", "'stream' is not supported on the queue: the whole result is written to reply_to")


def _transient(status: int) -> bool:
    return status in (408, 429) or status >= 500


def _message(result: Result) -> str:
    return str(result.body.get("error", {}).get("message", f"status {result.status}"))
