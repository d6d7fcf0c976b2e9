"""A local SageMaker runtime for tests: boto3's `sagemaker-runtime` (pointed here by
AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME) reaches a real model container serving SageMaker's `/invocations`.

`InvokeEndpoint` forwards the body and returns the container's answer. `InvokeEndpointAsync` does what
SageMaker does with an async endpoint: reads the request from S3, runs it, writes the reply under the
endpoint config's S3OutputPath (or the failure under S3FailurePath), and answers 202 with both locations.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import requests

ROUTE = re.compile(r"^/endpoints/(?P<endpoint>[^/]+)/(?P<kind>invocations|async-invocations)$")


@dataclass
class SageMakerRuntime:
    container_url: str  # http://127.0.0.1:PORT of a container serving /invocations
    aws: Any  # a MotoServer: its clients read endpoint configs and S3
    address: str = ""
    calls: list[str] = field(default_factory=list)

    def run_async(self, endpoint: str, input_location: str) -> dict[str, str]:
        sagemaker, s3 = self.aws.client("sagemaker"), self.aws.client("s3")
        config_name = sagemaker.describe_endpoint(EndpointName=endpoint)["EndpointConfigName"]
        output = sagemaker.describe_endpoint_config(EndpointConfigName=config_name)["AsyncInferenceConfig"][
            "OutputConfig"
        ]
        bucket, key = input_location.removeprefix("s3://").split("/", 1)
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        inference = str(uuid.uuid4())
        answer = requests.post(f"{self.container_url}/invocations", data=body, timeout=300,
                               headers={"Content-Type": "application/json"})  # fmt: skip
        base = output["S3OutputPath"] if answer.ok else output["S3FailurePath"]
        location = f"{base.rstrip('/')}/{inference}.{'out' if answer.ok else 'error'}"
        out_bucket, out_key = location.removeprefix("s3://").split("/", 1)
        s3.put_object(Bucket=out_bucket, Key=out_key, Body=answer.content)
        return {"InferenceId": inference, "OutputLocation": f"{output['S3OutputPath'].rstrip('/')}/{inference}.out",
                "FailureLocation": f"{output['S3FailurePath'].rstrip('/')}/{inference}.error"}  # fmt: skip


def _handler(runtime: SageMakerRuntime) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            route = ROUTE.match(self.path.split("?")[0])
            if route is None:
                self._send(404, b'{"message": "unknown operation"}', {"Content-Type": "application/json"})
                return
            runtime.calls.append(f"{route['kind']} {route['endpoint']}")
            if route["kind"] == "invocations":
                content_type = self.headers.get("Content-Type", "application/json")
                answer = requests.post(f"{runtime.container_url}/invocations", data=body, timeout=300,
                                       headers={"Content-Type": content_type})  # fmt: skip
                self._send(answer.status_code, answer.content, {
                    "Content-Type": answer.headers.get("content-type", "application/json"),
                    "x-Amzn-Invoked-Production-Variant": "AllTraffic",
                })  # fmt: skip
                return
            result = runtime.run_async(route["endpoint"], self.headers["X-Amzn-SageMaker-InputLocation"])
            self._send(202, json.dumps({"InferenceId": result["InferenceId"]}).encode(), {
                "Content-Type": "application/json",
                "X-Amzn-SageMaker-OutputLocation": result["OutputLocation"],
                "X-Amzn-SageMaker-FailureLocation": result["FailureLocation"],
            })  # fmt: skip

    return Handler


@contextmanager
def running_sagemaker_runtime(container_url: str, aws: Any) -> Iterator[SageMakerRuntime]:
    runtime = SageMakerRuntime(container_url, aws)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(runtime))
    server.daemon_threads = True
    runtime.address = f"127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield runtime
    finally:
        server.shutdown()
        server.server_close()
