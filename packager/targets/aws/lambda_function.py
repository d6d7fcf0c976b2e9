"""The `aws-lambda` target: the function run by Lambda behind a streaming function URL and an SQS queue (with a
dead-letter queue) whose batches report partial failures. The package is a container image in ECR (the bundle
in a layer), or a zip for the managed Python runtime (`lambda_zip`) whose bundle the init phase fetches from the
function's bucket, with SnapStart on published versions when asked for.

Resources, in creation order (names from the function name `F`):
  s3-bucket `onnxfn-F-lambda-ACCOUNT-REGION` (queue results and the ledger; for a zip package also the zip under
  `code/SHA256.zip` and the bundle under `bundles/DIGEST/`: s3-code and s3-bundle), log-group `/aws/lambda/F`,
  sqs-queue `F-dlq`, sqs-queue `F-requests` (redrive to the DLQ), ecr-repository `onnxfn/F/aws-lambda` and
  ecr-image (image package only), iam-role `onnxfn-F-lambda`, lambda-function `F`, lambda-alias `F:live`,
  lambda-url `F:live`, event-source `F-requests`, and provisioned-concurrency `F:live` when asked for.
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
from packager.paths import build_dir, bundle_dir, cache_root
from packager.progress import StepProgress
from packager.runtime_flags import server_flags
from packager.sizes import bundle_size, lambda_refusals
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
    S3UploadDriver,
)
from packager.targets.aws.lambda_zip import HANDLER, LAMBDA_PYTHON, ZipPackage, build_zip, check_fits
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
from runtime.bundle import MANIFEST_NAME, read_manifest

TARGET = "aws-lambda"
ALIAS = "live"
DLQ_RETENTION_SECONDS = 14 * 24 * 3600  # SQS' maximum: time to look at what failed
QUEUE_RETENTION_SECONDS = 4 * 24 * 3600
PLATFORMS = {"x86_64": "linux/amd64", "arm64": "linux/arm64"}
SNAPSTART_TMP_MB = 512  # SnapStart's cap on ephemeral storage
BUNDLE_S3_ENV, BUNDLE_DIGEST_ENV = "ONNXFN_BUNDLE_S3", "ONNXFN_BUNDLE_DIGEST"  # runtime.aws_lambda.bundle_fetch
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


@dataclass(frozen=True)
class ZipCode:
    """Where a zip-packaged function's code and bundle are in its bucket."""

    code_sha256: str  # base64, as Lambda reports `CodeSha256`
    code_key: str  # code/SHA256.zip
    bundle_prefix: str  # bundles/HEX/


def choose_package(settings: AwsLambdaTarget) -> tuple[str, str]:
    """`image` or `zip`, and why (what `pkg deploy` prints)."""
    if settings.package != "auto":
        return settings.package, f'targets.{TARGET}.package = "{settings.package}"'
    if settings.snapstart:
        return "zip", "package auto: snapstart = true, and AWS offers SnapStart for zip packages only"
    return "image", "package auto: snapstart is off, and the container image carries the bundle in a layer"


def check_settings(settings: AwsLambdaTarget) -> None:
    """What the schema cannot say: combinations AWS refuses."""
    section = f"targets.{TARGET}"
    problems = []
    if settings.snapstart and choose_package(settings)[0] == "image":
        problems.append(
            f'{section}.snapstart = true with package = "image": AWS offers SnapStart for zip packages on the '
            'managed runtimes only; set package = "zip" (or "auto"), or use provisioned_concurrency with the image'
        )
    if settings.snapstart and settings.provisioned_concurrency > 0:
        problems.append(f"{section}.snapstart = true with provisioned_concurrency: AWS allows one or the other")
    if settings.snapstart and settings.ephemeral_storage_mb > SNAPSTART_TMP_MB:
        problems.append(
            f"{section}.snapstart = true with ephemeral_storage_mb = {settings.ephemeral_storage_mb}: SnapStart "
            f"allows at most {SNAPSTART_TMP_MB} MB"
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


def check_size(spec: FunctionSpec) -> None:
    """Refuse, before anything is built or sent, a bundle this function's memory, image or /tmp cannot hold."""
    settings = spec.targets.aws_lambda
    size = bundle_size(bundle_dir(spec), spec.runtime.kv_memory_mb, spec.runtime.prefix_cache_mb)
    package = choose_package(settings)[0]
    tmp_mb, snapstart = settings.ephemeral_storage_mb, settings.snapstart
    problems = lambda_refusals(size, settings.memory_mb, package, tmp_mb, snapstart)
    if problems:
        raise UserError(f"the bundle does not fit {TARGET}: " + "; ".join(problems), exit_code=2)


def drivers(
    image: ImageDriver | None = None, uploads: dict[str, S3UploadDriver] | None = None, code_bucket: str = ""
) -> dict[str, Driver]:
    """Every kind's driver, in creation order; the image and the uploads only when a plan has them to push."""
    table: dict[str, Driver] = {"s3-bucket": BucketDriver(), **(uploads or {})}
    table.update({
        "log-group": LogGroupDriver(), "sqs-queue": QueueDriver(),
        "ecr-repository": RepositoryDriver(), "iam-role": RoleDriver(), "lambda-function": FunctionDriver(code_bucket),
        "lambda-alias": AliasDriver(), "lambda-url": FunctionUrlDriver(), "event-source": EventSourceDriver(),
        "provisioned-concurrency": ProvisionedConcurrencyDriver(),
    })  # fmt: skip
    if image is not None:
        table["ecr-image"] = image
    return table


def plan(spec: FunctionSpec, *, progress: StepProgress | None = None) -> AwsPlan:
    """Build (or reuse) the image, then compare every resource with what exists. Touches nothing in AWS."""
    settings = spec.targets.aws_lambda
    check_settings(settings)
    check_size(spec)
    progress = progress or StepProgress()
    digest = bundle_digest(spec)
    context = aws.connect(TARGET, settings.region, settings.endpoint_url)
    names = Names.of(spec.name, context)
    package, why = choose_package(settings)
    progress.console.print(f"package: {package} ({why})", highlight=False)
    if package == "zip":
        zipped = zip_package(spec, progress)
        code = zip_code(zipped, digest)
        bundle = bundle_dir(spec)
        files = tuple((f"{code.bundle_prefix}{name}", bundle / name) for name in sorted(read_manifest(bundle).files))
        uploads = {
            "s3-code": S3UploadDriver(((code.code_key, zipped.path),)),
            "s3-bundle": S3UploadDriver((*files, (f"{code.bundle_prefix}{MANIFEST_NAME}", bundle / MANIFEST_NAME))),
        }
        desired = resources(spec, context, names, "", digest, code=code)
        table = drivers(uploads=uploads, code_bucket=names.bucket)
    else:
        platform = PLATFORMS[settings.architecture]
        layout, manifest_digest = function_image(spec, platform, state_dir(spec), progress)
        repository_uri, registry = image_registry(context, names.repository, tag=manifest_digest[7:23])
        desired = resources(spec, context, names, f"{repository_uri}@{manifest_digest}", digest)
        table = drivers(ImageDriver(layout, registry))
    return AwsPlan(
        target=TARGET, function=spec.name, context=context, changes=aws.plan_changes(context, table, desired),
        removals=_stale(spec, desired), state_dir=state_dir(spec), bundle_digest=digest,
        url="", drivers=table,
    )  # fmt: skip


def zip_package(spec: FunctionSpec, progress: StepProgress) -> ZipPackage:
    """The zip package, built (or reused), checked against Lambda's limits with the bundle it will fetch."""
    settings = spec.targets.aws_lambda
    with progress.step("zip", f"zip package for Lambda python{LAMBDA_PYTHON} {settings.architecture}") as step:
        zipped = build_zip(cache_root() / "lambda-zip", settings.architecture)
        if zipped.reused:
            step.cached()
    bundle = bundle_dir(spec)
    bundle_bytes = sum(entry.size for entry in read_manifest(bundle).files.values())
    tmp_mb = settings.ephemeral_storage_mb  # at most 512 with SnapStart (check_settings)
    check_fits(zipped)
    mb = 1_000_000
    progress.console.print(
        f"zip package: {zipped.path.stat().st_size / mb:.0f} MB, {zipped.unpacked_bytes / mb:.0f} MB unpacked of "
        f"Lambda's 250 MB; the bundle ({bundle_bytes / mb:.0f} MB) goes to S3 and is fetched into /tmp "
        f"({tmp_mb} MB) in the init phase" + (", before the SnapStart snapshot" if settings.snapstart else ""),
        highlight=False,
    )
    return zipped


def zip_code(zipped: ZipPackage, digest: str) -> ZipCode:
    return ZipCode(zipped.code_sha256, zipped.key, f"bundles/{digest.removeprefix('sha256:')}/")


def resources(
    spec: FunctionSpec, context: AwsContext, names: Names, image_uri: str, digest: str, *, code: ZipCode | None = None
) -> list[Resource]:
    """Every resource of the deployment with the settings `pkg deploy` gives it (and Terraform's inputs mirror).
    `code` given: the zip package's resources (code and bundle in the bucket, no ECR), else the image's."""
    settings = spec.targets.aws_lambda
    tags = aws.tags(spec.name, digest, TARGET)
    function_arn = context.arn("lambda", f"function:{names.function}")
    queue_arn, dlq_arn = context.arn("sqs", names.queue), context.arn("sqs", names.dlq)
    manifest_digest = image_uri.rpartition("@")[2]
    flags = shlex.join([*server_flags(spec), "--ledger", f"s3://{names.bucket}/ledger"])
    common = {
        "role": context.arn("iam", f"role/{names.role}", regional=False),
        "memory_mb": settings.memory_mb,
        "timeout_seconds": settings.timeout_seconds,
        "architecture": settings.architecture,
        "ephemeral_storage_mb": settings.ephemeral_storage_mb,
    }
    function: dict[str, Any]
    if code is None:
        function = {"image_uri": image_uri, **common, "environment": {"ONNXFN_FLAGS": flags}, "command": ["lambda"]}
    else:
        environment = {
            "ONNXFN_FLAGS": flags,
            BUNDLE_S3_ENV: f"s3://{names.bucket}/{code.bundle_prefix}",
            BUNDLE_DIGEST_ENV: digest,
        }
        function = {
            "package": "Zip", "code_sha256": code.code_sha256, "runtime": f"python{LAMBDA_PYTHON}",
            "handler": HANDLER, **common, "environment": environment,
            "snapstart": "PublishedVersions" if settings.snapstart else "None",
        }  # fmt: skip
    function.update({"reserved_concurrency": settings.reserved_concurrency, "tags": tags})
    versioned = {k: v for k, v in function.items() if k not in ("tags", "reserved_concurrency")}
    config_digest = hashlib.sha256(json.dumps(versioned, sort_keys=True).encode()).hexdigest()[:16]
    uploads = []
    if code is not None:
        uploads = [
            Resource("s3-code", f"{names.bucket}/{code.code_key}", {"sha256": code.code_sha256}),
            Resource("s3-bundle", f"{names.bucket}/{code.bundle_prefix}", {"digest": digest}),
        ]
    image = [
        repository_resource(names.repository, _repository_policy(function_arn), tags),
        Resource("ecr-image", f"{names.repository}@{manifest_digest}", {"digest": manifest_digest}),
    ]
    listed = [
        bucket_resource(names.bucket, tags),
        *uploads,
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
        *(image if code is None else []),
        Resource(
            "iam-role",
            names.role,
            {
                "trust": aws.trust_policy("lambda.amazonaws.com"),
                "policy": role_policy(context, names, bundle=code is not None),
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


def role_policy(context: AwsContext, names: Names, *, bundle: bool = False) -> dict[str, Any]:
    """What the function does, written out: its logs, its queue, its bucket's results and ledger, reply queues;
    with `bundle` (a zip package) also reading the bundle in its bucket."""
    bucket = context.arn("s3", names.bucket, regional=False)
    fetch = [{"Sid": "Bundle", "Action": ["s3:GetObject"], "Resource": f"{bucket}/bundles/*"}] if bundle else []
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
        *fetch,
    )  # fmt: skip


def _stale(spec: FunctionSpec, desired: list[Resource]) -> tuple[Resource, ...]:
    """Resources an earlier deploy made that this one no longer wants (provisioned concurrency turned off)."""
    previous = aws.load_state(state_dir(spec))
    wanted = {(r.kind, r.name) for r in desired}
    recorded = previous.resources if previous is not None else []
    kept = ("ecr-image", "s3-code", "s3-bundle")  # an image goes with its repository, uploads with the bucket
    return tuple(Resource(k, n, {}) for k, n in recorded if (k, n) not in wanted and k not in kept)


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
