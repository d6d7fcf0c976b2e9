"""The `aws-lambda` target: the function's image in ECR, run by Lambda behind a streaming function URL and an
SQS queue (with a dead-letter queue) whose batches report partial failures.

Resources, in creation order (names from the function name `F`):
  s3-bucket `onnxfn-F-lambda-ACCOUNT-REGION` (queue results and the ledger), log-group `/aws/lambda/F`,
  sqs-queue `F-dlq`, sqs-queue `F-requests` (redrive to the DLQ), ecr-repository `onnxfn/F/aws-lambda`, ecr-image,
  iam-role `onnxfn-F-lambda`, lambda-function `F`, lambda-alias `F:live`, lambda-url `F:live`,
  event-source `F-requests`, and provisioned-concurrency `F:live` when asked for.
Every taggable resource carries the function name and bundle digest (`aws_common.tags`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shlex
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from packager.errors import UserError
from packager.paths import build_dir
from packager.progress import StepProgress
from packager.runtime_flags import server_flags
from packager.spec import AwsLambdaTarget, FunctionSpec
from packager.targets.aws import common as aws
from packager.targets.aws.common import AwsContext, AwsDeployment, AwsPlan, Driver, Resource
from packager.targets.aws.lambda_drivers import (
    AliasDriver,
    EventSourceDriver,
    FunctionDriver,
    FunctionUrlDriver,
    ProvisionedConcurrencyDriver,
    QueueDriver,
)
from packager.targets.aws.resources import (
    BucketDriver,
    ImageDriver,
    LogGroupDriver,
    RepositoryDriver,
    RoleDriver,
    bucket_name,
    bucket_resource,
    bundle_digest,
    function_image,
    image_registry,
    repository_resource,
)
from packager.targets.base import TargetStatus

TARGET = "aws-lambda"
ALIAS = "live"
DLQ_RETENTION_SECONDS = 14 * 24 * 3600  # SQS' maximum: time to look at what failed
QUEUE_RETENTION_SECONDS = 4 * 24 * 3600
PLATFORMS = {"x86_64": "linux/amd64", "arm64": "linux/arm64"}
REPLY_QUEUE_PREFIX = "onnxfn-reply-"  # queues a request may name as `reply_to`; the role may send only to these


@dataclass(frozen=True)
class Names:
    function: str
    queue: str
    dlq: str
    repository: str
    role: str
    bucket: str
    log_group: str

    @classmethod
    def of(cls, function: str, context: AwsContext) -> Names:
        return cls(
            function=function, queue=f"{function}-requests", dlq=f"{function}-dlq",
            repository=f"onnxfn/{function}/{TARGET}", role=f"onnxfn-{function}-lambda",
            bucket=bucket_name(function, TARGET, context),
            log_group=f"/aws/lambda/{function}",
        )  # fmt: skip


def state_dir(spec: FunctionSpec) -> Path:
    return build_dir(spec) / TARGET


def check_settings(settings: AwsLambdaTarget) -> None:
    """What the schema cannot say: combinations AWS refuses."""
    section = f"targets.{TARGET}"
    problems = []
    if settings.snapstart:
        problems.append(
            f"{section}.snapstart = true: AWS offers SnapStart for zip packages only, and this target deploys a "
            "container image; use provisioned_concurrency to keep instances warm"
        )
    if settings.batch_size > 10 and settings.batch_window_seconds < 1:
        problems.append(f"{section}.batch_size = {settings.batch_size}: above 10 needs batch_window_seconds >= 1")
    reserved = settings.reserved_concurrency
    if reserved is not None and settings.provisioned_concurrency > reserved:
        problems.append(
            f"{section}.provisioned_concurrency = {settings.provisioned_concurrency} exceeds "
            f"reserved_concurrency = {reserved}"
        )
    if problems:
        raise UserError("\n".join(problems), exit_code=2)


def drivers(image: ImageDriver | None = None) -> dict[str, Driver]:
    table: dict[str, Driver] = {
        "s3-bucket": BucketDriver(), "log-group": LogGroupDriver(), "sqs-queue": QueueDriver(),
        "ecr-repository": RepositoryDriver(), "iam-role": RoleDriver(), "lambda-function": FunctionDriver(),
        "lambda-alias": AliasDriver(), "lambda-url": FunctionUrlDriver(), "event-source": EventSourceDriver(),
        "provisioned-concurrency": ProvisionedConcurrencyDriver(),
    }  # fmt: skip
    if image is not None:
        table["ecr-image"] = image
    return table


def plan(spec: FunctionSpec, *, progress: StepProgress | None = None) -> AwsPlan:
    """Build (or reuse) the image, then compare every resource with what exists. Touches nothing in AWS."""
    settings = spec.targets.aws_lambda
    check_settings(settings)
    digest = bundle_digest(spec)
    context = aws.connect(TARGET, settings.region, settings.endpoint_url)
    names = Names.of(spec.name, context)
    platform = PLATFORMS[settings.architecture]
    layout, manifest_digest = function_image(spec, platform, state_dir(spec), progress or StepProgress())
    repository_uri, registry = image_registry(context, names.repository, tag=manifest_digest[7:23])
    desired = resources(spec, context, names, f"{repository_uri}@{manifest_digest}", digest)
    table = drivers(ImageDriver(layout, registry))
    return AwsPlan(
        target=TARGET, function=spec.name, context=context, changes=aws.plan_changes(context, table, desired),
        removals=_stale(spec, desired), state_dir=state_dir(spec), bundle_digest=digest,
        url="", drivers=table,
    )  # fmt: skip


def resources(spec: FunctionSpec, context: AwsContext, names: Names, image_uri: str, digest: str) -> list[Resource]:
    """Every resource of the deployment with the settings `pkg deploy` gives it (and Terraform's inputs mirror)."""
    settings = spec.targets.aws_lambda
    tags = aws.tags(spec.name, digest, TARGET)
    function_arn = context.arn("lambda", f"function:{names.function}")
    queue_arn, dlq_arn = context.arn("sqs", names.queue), context.arn("sqs", names.dlq)
    manifest_digest = image_uri.rpartition("@")[2]
    function = {
        "image_uri": image_uri,
        "role": context.arn("iam", f"role/{names.role}", regional=False),
        "memory_mb": settings.memory_mb,
        "timeout_seconds": settings.timeout_seconds,
        "architecture": settings.architecture,
        "ephemeral_storage_mb": settings.ephemeral_storage_mb,
        "environment": {"ONNXFN_FLAGS": shlex.join([*server_flags(spec), "--ledger", f"s3://{names.bucket}/ledger"])},
        "command": ["lambda"],
        "reserved_concurrency": settings.reserved_concurrency,
        "tags": tags,
    }
    versioned = {k: v for k, v in function.items() if k not in ("tags", "reserved_concurrency")}
    config_digest = hashlib.sha256(json.dumps(versioned, sort_keys=True).encode()).hexdigest()[:16]
    listed = [
        bucket_resource(names.bucket, tags),
        Resource("log-group", names.log_group, {"retention_days": settings.log_retention_days, "tags": tags}),
        Resource("sqs-queue", names.dlq, _queue(DLQ_RETENTION_SECONDS, 30, None, tags)),
        Resource(
            "sqs-queue",
            names.queue,
            _queue(
                QUEUE_RETENTION_SECONDS,
                # AWS: at least the function timeout; 6x leaves room for retries of a throttled batch.
                min(6 * settings.timeout_seconds, 43200),
                {"deadLetterTargetArn": dlq_arn, "maxReceiveCount": settings.max_receive_count},
                tags,
            ),
        ),
        repository_resource(names.repository, _repository_policy(function_arn), tags),
        Resource("ecr-image", f"{names.repository}@{manifest_digest}", {"digest": manifest_digest}),
        Resource(
            "iam-role",
            names.role,
            {
                "trust": aws.trust_policy("lambda.amazonaws.com"),
                "policy": role_policy(context, names),
                "tags": tags,
            },
        ),
        Resource("lambda-function", names.function, function),
        Resource("lambda-alias", f"{names.function}:{ALIAS}", {"config_digest": config_digest}),
        Resource(
            "lambda-url",
            f"{names.function}:{ALIAS}",
            {
                "auth_type": settings.url_auth,
                "invoke_mode": "RESPONSE_STREAM",
            },
        ),
        Resource(
            "event-source",
            names.queue,
            {
                "queue_arn": queue_arn,
                "function_arn": f"{function_arn}:{ALIAS}",
                "batch_size": settings.batch_size,
                "batch_window_seconds": settings.batch_window_seconds,
                "response_types": ["ReportBatchItemFailures"],
                "max_concurrency": settings.max_concurrency,
            },
        ),
    ]
    if settings.provisioned_concurrency > 0:
        count = {"count": settings.provisioned_concurrency}
        listed.append(Resource("provisioned-concurrency", f"{names.function}:{ALIAS}", count))
    return listed


def _queue(retention: int, visibility: int, redrive: dict[str, Any] | None, tags: dict[str, str]) -> dict[str, Any]:
    return {"visibility_timeout": visibility, "retention_seconds": retention, "sse": True, "redrive": redrive,
            "tags": tags}  # fmt: skip


def _repository_policy(function_arn: str) -> dict[str, Any]:
    """Only Lambda, and only on behalf of this function, may pull the image."""
    return aws.policy({
        "Sid": "LambdaPullForThisFunction",
        "Principal": {"Service": "lambda.amazonaws.com"},
        "Action": ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"],
        "Condition": {"StringLike": {"aws:sourceArn": f"{function_arn}*"}},
    })  # fmt: skip


def role_policy(context: AwsContext, names: Names) -> dict[str, Any]:
    """What the function does, written out: its logs, its queue, its bucket's results and ledger, reply queues."""
    bucket = context.arn("s3", names.bucket, regional=False)
    return aws.policy(
        {"Sid": "Logs", "Action": ["logs:CreateLogStream", "logs:PutLogEvents"],
         "Resource": context.arn("logs", f"log-group:{names.log_group}:*")},
        {"Sid": "ConsumeRequests",
         "Action": ["sqs:ChangeMessageVisibility", "sqs:DeleteMessage", "sqs:GetQueueAttributes", "sqs:ReceiveMessage"],
         "Resource": context.arn("sqs", names.queue)},
        {"Sid": "Replies", "Action": ["sqs:SendMessage"], "Resource": context.arn("sqs", f"{REPLY_QUEUE_PREFIX}*")},
        {"Sid": "Results", "Action": ["s3:GetObject", "s3:PutObject"],
         "Resource": [f"{bucket}/results/*", f"{bucket}/ledger/*"]},
        {"Sid": "ResultsListing", "Action": ["s3:ListBucket"], "Resource": bucket,
         "Condition": {"StringLike": {"s3:prefix": ["results/*", "ledger/*"]}}},
    )  # fmt: skip


def _stale(spec: FunctionSpec, desired: list[Resource]) -> tuple[Resource, ...]:
    """Resources an earlier deploy made that this one no longer wants (provisioned concurrency turned off)."""
    previous = aws.load_state(state_dir(spec))
    wanted = {(r.kind, r.name) for r in desired}
    recorded = previous.resources if previous is not None else []
    return tuple(Resource(k, n, {}) for k, n in recorded if (k, n) not in wanted and k != "ecr-image")


def apply(plan: AwsPlan) -> AwsDeployment:
    deployment = aws.apply_plan(plan)
    url = _function_url(plan.context, plan.function)
    final = AwsDeployment(**{**deployment.__dict__, "url": url})
    aws.save_state(plan.state_dir, final)
    return final


def _function_url(context: AwsContext, function: str) -> str:
    with aws.aws_errors(context, f"read the URL of {function}"):
        config = context.client("lambda").get_function_url_config(FunctionName=function, Qualifier=ALIAS)
    return str(config["FunctionUrl"])


def status(spec: FunctionSpec) -> TargetStatus | None:
    deployment = aws.load_state(state_dir(spec))
    if deployment is None:
        return None
    context = aws.connect(TARGET, deployment.region, deployment.endpoint_url)
    row = partial(
        TargetStatus, target=TARGET, url=deployment.url, bundle_digest=deployment.bundle_digest, deployment=deployment
    )
    if deployment.outcome == "failed":
        return row(state="failed", detail=f"the last deploy stopped at: {deployment.failed_step}")
    with aws.aws_errors(context, f"read Lambda function {deployment.function}"):
        try:
            config = context.client("lambda").get_function_configuration(FunctionName=deployment.function)
        except context.client("lambda").exceptions.ResourceNotFoundException:
            return row(state="missing", detail="the function no longer exists in AWS; deploy again")
    state, update = config.get("State"), config.get("LastUpdateStatus")
    if state == "Failed" or update == "Failed":
        reason = config.get("StateReason") or config.get("LastUpdateStatusReason") or "no reason given"
        return row(state="failed", detail=f"Lambda reports: {reason}")
    if state == "Pending" or update == "InProgress":
        return row(state="updating", detail=f"Lambda state {state}, last update {update}")
    return row(state="ready")


def destroy(spec: FunctionSpec) -> list[str] | None:
    """Delete every resource of the deployment (those recorded, and those its names imply); None if none existed."""
    deployment = aws.load_state(state_dir(spec))
    settings = spec.targets.aws_lambda
    region = deployment.region if deployment else settings.region
    endpoint = deployment.endpoint_url if deployment else settings.endpoint_url
    context = aws.connect(TARGET, region, endpoint)
    names = Names.of(spec.name, context)
    implied = resources(spec, context, names, image_uri="", digest="")
    recorded = [Resource(kind, name, {}) for kind, name in (deployment.resources if deployment else [])]
    deleted = aws.destroy_resources(context, drivers(), [*recorded, *implied])
    (state_dir(spec) / "state.json").unlink(missing_ok=True)
    return deleted or None


def function_url_event(path: str, body: dict[str, Any], *, method: str = "POST") -> dict[str, Any]:
    """An HTTP request as a Lambda function URL delivers it (payload format 2.0)."""
    now = time.time()
    raw = json.dumps(body)
    return {
        "version": "2.0", "routeKey": "$default", "rawPath": path, "rawQueryString": "",
        "headers": {"content-type": "application/json", "accept": "application/json", "user-agent": "onnxfn-pkg"},
        "requestContext": {
            "accountId": "anonymous", "apiId": "onnxfn", "domainName": "lambda-url.onnxfn", "domainPrefix": "onnxfn",
            "http": {"method": method, "path": path, "protocol": "HTTP/1.1", "sourceIp": "127.0.0.1",
                     "userAgent": "onnxfn-pkg"},
            "requestId": str(uuid.uuid4()), "routeKey": "$default", "stage": "$default",
            "time": time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(now)), "timeEpoch": int(now * 1000),
        },
        "body": base64.b64encode(raw.encode()).decode(), "isBase64Encoded": True,
    }  # fmt: skip


def invoke(spec: FunctionSpec, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Invoke the `live` alias through the Lambda API with a function-URL-shaped event; returns the JSON reply."""
    deployment = aws.load_state(state_dir(spec))
    if deployment is None or deployment.outcome != "applied":
        raise UserError(f"{spec.name} is not deployed on {TARGET}; deploy it first: pkg deploy {spec.directory} "
                        f"--target {TARGET}")  # fmt: skip
    context = aws.connect(TARGET, deployment.region, deployment.endpoint_url)
    with aws.aws_errors(context, f"invoke {deployment.function}:{ALIAS}"):
        response = context.client("lambda").invoke(
            FunctionName=deployment.function, Qualifier=ALIAS, Payload=json.dumps(function_url_event(path, body))
        )
    payload = response["Payload"].read()
    if response.get("FunctionError"):
        try:
            error = json.loads(payload)
            message = f"{error.get('errorType', 'Error')}: {error.get('errorMessage', payload[:500])}"
        except ValueError:
            message = payload[:500].decode(errors="replace")
        raise UserError(f"the function failed ({response['FunctionError']}): {message}")
    return decode_http_response(json.loads(payload))


def decode_http_response(reply: dict[str, Any]) -> dict[str, Any]:
    """A function URL response (`statusCode`, `body`, maybe base64) → the JSON body; an error status raises."""
    raw = reply.get("body") or ""
    text = base64.b64decode(raw).decode() if reply.get("isBase64Encoded") else raw
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise UserError(f"the function answered {reply.get('statusCode')} with a body that is not JSON: {text[:300]}")\
            from exc  # fmt: skip
    status_code = int(reply.get("statusCode", 200))
    if status_code >= 400:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        raise UserError(f"the function answered {status_code}: {message or text[:300]}")
    return dict(body)
