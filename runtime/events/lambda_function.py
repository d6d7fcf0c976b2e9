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

from runtime.events.handler import QueueHandler
from runtime.events.invocation_loop import InvocationLoop
from runtime.events.sqs_batch import process_sqs_batch

if TYPE_CHECKING:
    from mangum import Mangum
    from starlette.applications import Starlette

    from runtime.engine.engine import Engine
    from runtime.events.loading import PendingHandler
    from runtime.server.state import ServerState

log = logging.getLogger("runtime.events")


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

        from runtime.startup import TIMELINE

        queue = pending.finish()
        app = http_app(queue.state)
        loop = InvocationLoop()
        loop.enter()  # Mangum binds to the thread's current loop when it is created
        function = cls(pending.args, queue, app, Mangum(app, lifespan="off"), loop)
        log.info("%s", TIMELINE.log_line())
        return function

    @property
    def engine(self) -> Engine:
        return self.queue.state.require_engine()

    def handles_http(self, event: Any, context: Any) -> bool:
        from mangum.adapter import HANDLERS

        return isinstance(event, dict) and any(h.infer(event, context, self.adapter.config) for h in HANDLERS)

    def http(self, event: dict[str, Any], context: Any) -> dict[str, Any]:
        self.loop.enter()
        return self.adapter(event, context)

    def sqs_batch(self, records: Sequence[dict[str, Any]], *, time_left: float | None) -> dict[str, Any]:
        return process_sqs_batch(records, self.queue, time_left=time_left, loop=self.loop)

    def after_restore(self) -> None:
        """A SnapStart restore: AWS clients get this environment's credentials, clocks start from now."""
        from runtime.events.loading import result_store

        self.queue.results = result_store(self.args)
        now = int(time.time())
        for state in self.states:
            state.created = now

    @property
    def states(self) -> tuple[ServerState, ServerState]:
        return self.queue.state, self.app.state.server

    def shutdown(self) -> None:
        self.queue.state.shutdown()
        self.loop.close()


def http_app(queue_state: ServerState) -> Starlette:
    """The HTTP server's app, serving the queue handler's engine (already loaded) with the same request policy."""
    from runtime.encoder.engine import EncoderEngine
    from runtime.server.app import create_app

    engine = queue_state.require_engine()
    task = engine.task if isinstance(engine, EncoderEngine) else "chat"
    app = create_app(queue_state.settings, lambda: engine, task=task)
    app.state.server.load(lambda: engine)  # the lifespan that would load it never runs under mangum
    return app
