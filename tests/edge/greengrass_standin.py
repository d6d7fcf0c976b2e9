"""A local stand-in for the Greengrass v2 API (moto has none), driven by botocore's own service model.

It serves HTTP on 127.0.0.1 for a real boto3 client (`AWS_ENDPOINT_URL_GREENGRASSV2`). Each request is routed by
the operation's `http.method` / `requestUri`, its parameters are rebuilt from path, query and JSON body by
the input shape's locations, and checked with `botocore.validate.validate_parameters`; every answer is
checked against the output shape before it is sent. A request or answer that does not fit is recorded in
`problems` and answered with a 400 `ValidationException`. The state is a small in-memory model: component
versions, deployments per target (a new one makes the previous revision INACTIVE), and core devices.
"""

from __future__ import annotations

import base64
import datetime
import json
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import botocore.session
from botocore.exceptions import ParamValidationError
from botocore.validate import validate_parameters

MODEL = botocore.session.get_session().get_service_model("greengrassv2")
NOW = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _routes() -> list[tuple[str, re.Pattern[str], str]]:
    routes = []
    for name in MODEL.operation_names:
        http = MODEL.operation_model(name).http
        path = http["requestUri"].split("?")[0]
        pattern = re.sub(r"\{(\w+)\+\}", r"(?P<\1>.+)", path)
        pattern = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", pattern)
        routes.append((http["method"], re.compile(f"^{pattern}$"), name))
    return routes


ROUTES = _routes()


@dataclass
class Call:
    operation: str
    params: dict[str, Any]


@dataclass
class GreengrassStandIn:
    account: str
    region: str
    calls: list[Call] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    components: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # name → version → record
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    core_devices: dict[str, str] = field(default_factory=dict)  # thing name → thing group ARN
    device_outcomes: dict[str, str] = field(default_factory=dict)  # thing name → coreDeviceExecutionStatus
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def operations(self) -> list[str]:
        return [c.operation for c in self.calls]

    def complete_deployments(self) -> None:
        """What the devices would do: the active deployment of each target finishes."""
        for record in self.deployments.values():
            if record["deploymentStatus"] == "ACTIVE":
                record["deploymentStatus"] = "COMPLETED"

    # -- the operations the target uses ------------------------------------------------------------
    def component_arn(self, name: str) -> str:
        return f"arn:aws:greengrass:{self.region}:{self.account}:components:{name}"

    def CreateComponentVersion(self, p: dict[str, Any]) -> dict[str, Any]:
        recipe = json.loads(p["inlineRecipe"])
        name, version = recipe["ComponentName"], recipe["ComponentVersion"]
        versions = self.components.setdefault(name, {})
        if version in versions:
            raise ApiError(409, "ConflictException", f"{name} {version} already exists")
        arn = f"{self.component_arn(name)}:versions:{version}"
        status = {"componentState": "DEPLOYABLE", "message": "NONE", "errors": {}}
        versions[version] = {"recipe": recipe, "tags": p.get("tags", {}), "arn": arn, "status": status}
        return {"arn": arn, "componentName": name, "componentVersion": version, "creationTimestamp": NOW,
                "status": status}  # fmt: skip

    def _version(self, arn: str) -> tuple[str, str, dict[str, Any]]:
        head, _, version = arn.rpartition(":versions:")
        name = head.rpartition(":components:")[2]
        record = self.components.get(name, {}).get(version)
        if record is None:
            raise ApiError(404, "ResourceNotFoundException", f"no component version {arn}")
        return name, version, record

    def ListComponentVersions(self, p: dict[str, Any]) -> dict[str, Any]:
        name = p["arn"].rpartition(":components:")[2]
        if not self.components.get(name):
            raise ApiError(404, "ResourceNotFoundException", f"no component {p['arn']}")
        return {"componentVersions": [{"componentName": name, "componentVersion": v, "arn": r["arn"]}
                                      for v, r in self.components[name].items()]}  # fmt: skip

    def DescribeComponent(self, p: dict[str, Any]) -> dict[str, Any]:
        name, version, record = self._version(p["arn"])
        platforms = [{"attributes": m["Platform"]} for m in record["recipe"].get("Manifests", [])]
        return {"arn": record["arn"], "componentName": name, "componentVersion": version, "creationTimestamp": NOW,
                "publisher": record["recipe"].get("ComponentPublisher", ""), "status": record["status"],
                "platforms": platforms, "tags": record["tags"]}  # fmt: skip

    def DeleteComponent(self, p: dict[str, Any]) -> dict[str, Any]:
        name, version, _ = self._version(p["arn"])
        del self.components[name][version]
        return {}

    def CreateDeployment(self, p: dict[str, Any]) -> dict[str, Any]:
        for name, spec in p.get("components", {}).items():
            if name.startswith("aws.greengrass."):
                continue  # AWS-provided components are not modelled here
            self._version(f"{self.component_arn(name)}:versions:{spec['componentVersion']}")
        revisions = [d for d in self.deployments.values() if d["targetArn"] == p["targetArn"]]
        for previous in revisions:
            previous["isLatestForTarget"] = False
            if previous["deploymentStatus"] in ("ACTIVE", "COMPLETED"):
                previous["deploymentStatus"] = "INACTIVE"
        deployment_id = str(uuid.uuid4())
        self.deployments[deployment_id] = {
            "targetArn": p["targetArn"], "revisionId": str(len(revisions) + 1), "deploymentId": deployment_id,
            "deploymentName": p.get("deploymentName") or f"Deployment for {p['targetArn'].rpartition('/')[2]}",
            "deploymentStatus": "ACTIVE",
            "iotJobId": deployment_id, "iotJobArn": f"arn:aws:iot:{self.region}:{self.account}:job/{deployment_id}",
            "components": p.get("components", {}), "deploymentPolicies": p.get("deploymentPolicies", {}),
            "creationTimestamp": NOW, "isLatestForTarget": True, "tags": p.get("tags", {}),
        }  # fmt: skip
        return {"deploymentId": deployment_id, "iotJobId": deployment_id,
                "iotJobArn": self.deployments[deployment_id]["iotJobArn"]}  # fmt: skip

    def _deployment(self, deployment_id: str) -> dict[str, Any]:
        if deployment_id not in self.deployments:
            raise ApiError(404, "ResourceNotFoundException", f"no deployment {deployment_id}")
        return self.deployments[deployment_id]

    def ListDeployments(self, p: dict[str, Any]) -> dict[str, Any]:
        keys = ("targetArn", "revisionId", "deploymentId", "deploymentName", "creationTimestamp",
                "deploymentStatus", "isLatestForTarget")  # fmt: skip
        found = [d for d in self.deployments.values() if d["targetArn"] == p.get("targetArn", d["targetArn"])]
        if p.get("historyFilter", "LATEST_ONLY") == "LATEST_ONLY":
            found = [d for d in found if d["isLatestForTarget"]]
        return {"deployments": [{k: d[k] for k in keys} for d in reversed(found)]}

    def GetDeployment(self, p: dict[str, Any]) -> dict[str, Any]:
        return dict(self._deployment(p["deploymentId"]))

    def CancelDeployment(self, p: dict[str, Any]) -> dict[str, Any]:
        self._deployment(p["deploymentId"])["deploymentStatus"] = "CANCELED"
        return {"message": "canceled"}

    def DeleteDeployment(self, p: dict[str, Any]) -> dict[str, Any]:
        if self._deployment(p["deploymentId"])["deploymentStatus"] == "ACTIVE":
            raise ApiError(409, "ConflictException", "cancel an active deployment before deleting it")
        del self.deployments[p["deploymentId"]]
        return {}

    def ListCoreDevices(self, p: dict[str, Any]) -> dict[str, Any]:
        group = p.get("thingGroupArn")
        devices = [name for name, arn in self.core_devices.items() if group in (None, arn)]
        return {"coreDevices": [{"coreDeviceThingName": name, "status": "HEALTHY",
                                 "lastStatusUpdateTimestamp": NOW} for name in devices]}  # fmt: skip

    def ListEffectiveDeployments(self, p: dict[str, Any]) -> dict[str, Any]:
        name = p["coreDeviceThingName"]
        group = self.core_devices.get(name)
        latest = [d for d in self.deployments.values() if d["targetArn"] == group and d["isLatestForTarget"]]
        entries = [{
            "deploymentId": d["deploymentId"], "deploymentName": d["deploymentName"], "iotJobId": d["iotJobId"],
            "targetArn": d["targetArn"], "coreDeviceExecutionStatus": self.device_outcomes.get(name, "IN_PROGRESS"),
            "creationTimestamp": NOW, "modifiedTimestamp": NOW,
        } for d in latest]  # fmt: skip
        return {"effectiveDeployments": entries}

    # -- HTTP ------------------------------------------------------------------------------------------
    def handle(self, method: str, raw_path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        parts = urlsplit(raw_path)
        for route_method, pattern, name in ROUTES:  # noqa: B007  (`name` is the operation matched)
            match = pattern.match(parts.path)
            if route_method == method and match:
                break
        else:
            return 404, {"x-amzn-errortype": "UnknownOperationException"}, b'{"message": "no such route"}'
        operation = MODEL.operation_model(name)
        params = _request_params(operation, match.groupdict(), parse_qs(parts.query), body)
        with self.lock:
            self.calls.append(Call(name, params))
            try:
                validate_parameters(params, operation.input_shape)
            except ParamValidationError as exc:
                self.problems.append(f"{name} request: {exc}")
                return 400, {"x-amzn-errortype": "ValidationException"}, json.dumps({"message": str(exc)}).encode()
            handler = getattr(self, name, None)
            if handler is None:
                self.problems.append(f"{name}: not modelled by the stand-in")
                return 501, {"x-amzn-errortype": "InternalServerException"}, b'{"message": "not modelled"}'
            try:
                answer = handler(params)
            except ApiError as exc:
                return exc.status, {"x-amzn-errortype": exc.code}, json.dumps({"message": str(exc)}).encode()
            if operation.output_shape is not None:
                try:
                    validate_parameters(answer, operation.output_shape)
                except ParamValidationError as exc:
                    self.problems.append(f"{name} answer: {exc}")
        status = int(operation.http.get("responseCode", 200))
        payload = b"" if status == 204 else json.dumps(answer, default=_timestamp).encode()
        return status, {"Content-Type": "application/json"}, payload


def _timestamp(value: Any) -> float:
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    raise TypeError(f"cannot encode {value!r}")


def _request_params(operation: Any, labels: dict[str, str], query: dict[str, list[str]], body: bytes) -> dict[str, Any]:
    """The call's parameters, rebuilt from where the service model puts each member on the wire."""
    shape = operation.input_shape
    if shape is None:
        return {}
    document = json.loads(body) if body else {}
    params: dict[str, Any] = {}
    for name, member in shape.members.items():
        location, wire_name = member.serialization.get("location"), member.serialization.get("name", name)
        if location == "uri" and wire_name in labels:
            params[name] = unquote(labels[wire_name])
        elif location == "querystring" and wire_name in query:
            value = query[wire_name][0]
            params[name] = int(value) if member.type_name == "integer" else value
        elif location is None and wire_name in document:
            value = document[wire_name]
            params[name] = base64.b64decode(value) if member.type_name == "blob" else value
    return params


@contextmanager
def running_standin(account: str, region: str) -> Iterator[GreengrassStandIn]:
    standin = GreengrassStandIn(account, region)

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            status, headers, payload = standin.handle(self.command, self.path, self.rfile.read(length))
            self.send_response(status)
            for key, value in {**headers, "x-amzn-RequestId": str(uuid.uuid4())}.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    standin.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield standin
    finally:
        server.shutdown()
        server.server_close()
