"""A local Lambda service for tests: the Runtime API a function's runtime client polls, and the Invoke API boto3
calls, joined by a queue, so `lambda.invoke` (boto3, pointed here by AWS_ENDPOINT_URL_LAMBDA) reaches a real
`awslambdaric` running the function's image, and its answer or error comes back in Lambda's format.

Runtime API (https://docs.aws.amazon.com/lambda/latest/dg/runtimes-api.html): `GET
/2018-06-01/runtime/invocation/next` blocks until an event is queued; `POST .../invocation/ID/response` and
`.../invocation/ID/error` complete it; `POST .../init/error` reports a start-up failure. Under SnapStart
(`AWS_LAMBDA_INITIALIZATION_TYPE=snap-start`) the runtime calls `GET .../restore/next` once its before-snapshot
hooks ran (Lambda takes the snapshot there and answers when an environment resumes from it) and reports a failing
after-restore hook to `POST .../restore/error`. `calls` lists every Runtime API call in order.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

RUNTIME = "/2018-06-01/runtime"
INVOKE = re.compile(r"^/2015-03-31/functions/(?P<name>[^/]+)/invocations")
COMPLETE = re.compile(rf"^{RUNTIME}/invocation/(?P<id>[^/]+)/(?P<kind>response|error)$")
FUNCTION_TIMEOUT = 300.0


@dataclass
class Invocation:
    request_id: str
    event: bytes
    function_arn: str
    done: threading.Event = field(default_factory=threading.Event)
    payload: bytes = b""
    error_type: str | None = None  # set when the runtime reported an error


@dataclass
class LambdaService:
    pending: queue.Queue[Invocation] = field(default_factory=queue.Queue)
    running: dict[str, Invocation] = field(default_factory=dict)
    init_errors: list[dict[str, Any]] = field(default_factory=list)
    restore_errors: list[dict[str, Any]] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    address: str = ""

    def invoke(self, function: str, event: bytes, timeout: float = FUNCTION_TIMEOUT) -> Invocation:
        invocation = Invocation(str(uuid.uuid4()), event, f"arn:aws:lambda:us-east-1:123456789012:function:{function}")
        if self.init_errors:  # as Lambda does: every invocation of a runtime that failed to start gets its error
            invocation.payload, invocation.error_type = json.dumps(self.init_errors[-1]).encode(), "Unhandled"
            return invocation
        self.running[invocation.request_id] = invocation
        self.pending.put(invocation)
        if not invocation.done.wait(timeout):
            raise TimeoutError(f"the runtime did not answer invocation {invocation.request_id} in {timeout} s")
        return invocation


def _handler(service: LambdaService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            service.calls.append(f"GET {self.path.removeprefix(RUNTIME + '/')}")
            if self.path == f"{RUNTIME}/restore/next":
                self._send(200, b"")
                return
            if self.path != f"{RUNTIME}/invocation/next":
                self._send(404, b'{"errorMessage": "not found"}')
                return
            invocation = service.pending.get()
            deadline = int((time.time() + FUNCTION_TIMEOUT) * 1000)
            self._send(200, invocation.event, {
                "Lambda-Runtime-Aws-Request-Id": invocation.request_id,
                "Lambda-Runtime-Deadline-Ms": str(deadline),
                "Lambda-Runtime-Invoked-Function-Arn": invocation.function_arn,
                "Lambda-Runtime-Trace-Id": f"Root=1-{uuid.uuid4().hex[:8]}-{uuid.uuid4().hex[:24]}",
            })  # fmt: skip

        def do_POST(self) -> None:
            body = self._body()
            if self.path.startswith(RUNTIME):
                service.calls.append(f"POST {self.path.removeprefix(RUNTIME + '/')}")
            if self.path == f"{RUNTIME}/restore/error":
                service.restore_errors.append(json.loads(body or b"{}"))
                self._send(202, b'{"status": "OK"}')
                return
            if self.path == f"{RUNTIME}/init/error":
                service.init_errors.append(json.loads(body or b"{}"))
                for waiting in list(service.running.values()):
                    waiting.payload, waiting.error_type = body, "Unhandled"
                    waiting.done.set()
                self._send(202, b'{"status": "OK"}')
                return
            completed = COMPLETE.match(self.path)
            if completed:
                invocation = service.running.pop(completed["id"])
                invocation.payload = body
                if completed["kind"] == "error":
                    invocation.error_type = self.headers.get("Lambda-Runtime-Function-Error-Type", "Unhandled")
                invocation.done.set()
                self._send(202, b'{"status": "OK"}')
                return
            called = INVOKE.match(self.path)
            if called:
                invocation = service.invoke(called["name"], body)
                headers = {"X-Amz-Executed-Version": "1"}
                if invocation.error_type is not None:
                    headers["X-Amz-Function-Error"] = "Unhandled"
                self._send(200, invocation.payload, headers)
                return
            self._send(404, b'{"message": "not found"}')

    return Handler


@contextmanager
def running_lambda_service() -> Iterator[LambdaService]:
    service = LambdaService()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(service))
    server.daemon_threads = True
    service.address = f"127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield service
    finally:
        server.shutdown()
        server.server_close()
