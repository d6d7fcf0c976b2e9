"""What one Lambda execution environment serves: one engine behind the SQS path and the HTTP app.

HTTP events (API Gateway REST and HTTP APIs, function URLs, ALB) go through `mangum` into the same
starlette app `python -m runtime serve` runs, so a request gets exactly the HTTP server's answer: the
OpenAI body, or an OpenAI-style error body with its 4xx status, as Lambda's HTTP response
(`statusCode`, `headers`, `body`). Mangum buffers the response: a `stream: true` request gets its whole
SSE body in one response, not token by token (see docs/targets/aws-lambda.md).

The app's lifespan is off: the engine is loaded once, before the first invocation, and the app is handed it.
Authentication is the HTTP front's (function URL `AWS_IAM`, API Gateway authorizers), as on SageMaker.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.api.encoding import JSON_TYPE, dump_json
from runtime.api.errors import APIError
from runtime.aws_lambda.invocation_loop import InvocationLoop
from runtime.aws_lambda.sqs_batch import process_sqs_batch
from runtime.events.handler import QueueHandler

if TYPE_CHECKING:
    from mangum import Mangum
    from starlette.applications import Starlette

    from runtime.api.service import ModelService
    from runtime.engine.engine import Engine
    from runtime.events.loading import PendingHandler

log = logging.getLogger("runtime.aws_lambda")


@dataclass
class LambdaFunction:
    args: argparse.Namespace
    queue: QueueHandler
    app: Starlette
    adapter: Mangum
    loop: InvocationLoop

    @classmethod
    def load(cls, pending: PendingHandler) -> LambdaFunction:
        """The function around `pending`'s handler; this module and mangum were imported while its model loaded."""
        from mangum import Mangum

        from runtime.timeline import TIMELINE

        queue = pending.finish()
        app = http_app(queue.service)
        loop = InvocationLoop()
        loop.enter()  # Mangum binds to the thread's current loop when it is created
        function = cls(pending.args, queue, app, Mangum(app, lifespan="off"), loop)
        log.info("%s", TIMELINE.log_line())
        return function

    @property
    def engine(self) -> Engine:
        return self.queue.service.require_engine()

    def handles_http(self, event: Any, context: Any) -> bool:
        from mangum.adapter import HANDLERS

        return isinstance(event, dict) and any(h.infer(event, context, self.adapter.config) for h in HANDLERS)

    def http(self, event: dict[str, Any], context: Any) -> dict[str, Any]:
        """The app's answer to an HTTP event; a 400 for an event mangum cannot read (never an invocation error)."""
        self.loop.enter()
        if event.get("headers") is None:  # null for a request without headers: mangum needs a map
            event = {**event, "headers": {}}
        try:
            return self.adapter(event, context)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # mangum reading the event: the app's own
            return malformed_http_event(exc)  # errors are answered inside it, as a 500 response

    def sqs_batch(self, records: Sequence[dict[str, Any]], *, time_left: float | None) -> dict[str, Any]:
        return process_sqs_batch(records, self.queue, time_left=time_left, loop=self.loop)

    def after_restore(self) -> None:
        """A SnapStart restore: AWS clients get this environment's credentials, clocks start from now, and the
        adapter store is read again (it may have changed since the snapshot)."""
        from runtime.adapters.s3_store import resync_adapters
        from runtime.events.loading import result_store

        self.queue.results = result_store(self.args)
        now = int(time.time())
        for service in self.services:
            service.created = now
        resync_adapters(self.engine)

    @property
    def services(self) -> tuple[ModelService, ModelService]:
        return self.queue.service, self.app.state.server

    def shutdown(self) -> None:
        self.queue.service.shutdown()
        self.loop.close()


def http_app(queue_service: ModelService) -> Starlette:
    """The HTTP server's app, serving the queue handler's engine (already loaded) with the same request policy."""
    from runtime.encoder.engine import EncoderEngine
    from runtime.http.app import create_app
    from runtime.http.state import ServerSettings

    engine = queue_service.require_engine()
    task = engine.task if isinstance(engine, EncoderEngine) else "chat"
    service = queue_service.settings
    settings = ServerSettings(policy=service.policy, fingerprint=service.fingerprint, max_waiting=service.max_waiting)
    app = create_app(settings, lambda: engine, task=task)
    app.state.server.load(lambda: engine)  # the lifespan that would load it never runs under mangum
    return app


def malformed_http_event(exc: Exception) -> dict[str, Any]:
    """Lambda's HTTP response for an event that does not have API Gateway's, a function URL's or an ALB's shape."""
    error = APIError(
        400,
        f"the Lambda HTTP event is malformed ({type(exc).__name__}: {exc}); send the event API Gateway, a function "
        "URL or an ALB sends",
        code="invalid_http_event",
    )
    body = dump_json(error.body()).decode()
    return {"statusCode": 400, "headers": {"content-type": JSON_TYPE}, "body": body, "isBase64Encoded": False}
