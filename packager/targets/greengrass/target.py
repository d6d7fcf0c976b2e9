"""The `greengrass` target: the function as an AWS IoT Greengrass v2 component, deployed to a thing group.

Resources, in creation order: s3-bucket `onnxfn-F-greengrass-ACCOUNT-REGION` (unless `bucket` names one),
the artifacts `s3-object BUCKET/onnxfn/F/greengrass/NAME` (bundle archive, runtime zip, requirements, launcher;
see `greengrass_recipe`), the `greengrass-component` version holding the recipe, and the thing group's
`greengrass-deployment`. Everything carries the function name and bundle digest as tags.

Greengrass has no local stand-in (moto lacks it): the recipe is checked against the recipe format and every
request against botocore's service model in the tests; S3 runs against moto. Nothing here proves that a real
nucleus installs the component: see docs/targets/edge.md.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlencode

from packager.edge.archive import archive_bundle
from packager.errors import UserError
from packager.paths import build_dir, bundle_dir
from packager.progress import StepProgress
from packager.runtime_flags import server_flags
from packager.spec import FunctionSpec, GreengrassTarget
from packager.targets.aws import common as aws
from packager.targets.aws.common import AwsContext, AwsDeployment, AwsPlan, Driver, Resource
from packager.targets.aws.resources import BucketDriver, bucket_name, bucket_resource
from packager.targets.aws.target import AwsTarget, AwsTargetModule
from packager.targets.base import LogLine, TargetStatus
from packager.targets.greengrass.drivers import (
    ArtifactDriver,
    ComponentDriver,
    DeploymentDriver,
    component_versions,
    deployment_policies,
    deployments_of,
    latest_deployment,
)
from packager.targets.greengrass.recipe import Artifacts, ComponentSettings, build_artifacts, recipe, recipe_digest

TARGET = "greengrass"
SECTION = f"targets.{TARGET}"
COMPONENT_NAME = re.compile(r"^[a-zA-Z0-9._-]{1,128}$")
DEVICES_READ = 25  # core devices whose effective deployment `status` asks for


def state_dir(spec: FunctionSpec) -> Path:
    return build_dir(spec) / TARGET


def component_name(spec: FunctionSpec) -> str:
    return spec.targets.greengrass.component_name or f"onnxfn.{spec.name}"


def check_settings(spec: FunctionSpec) -> None:
    """What the schema cannot say; every problem at once."""
    settings, problems = spec.targets.greengrass, []
    if not settings.thing_group:
        problems.append(f"{SECTION}.thing_group is not set: name the thing group whose core devices run the function")
    if not COMPONENT_NAME.match(component_name(spec)):
        problems.append(
            f"{SECTION}.component_name = {component_name(spec)!r}: use 1-128 letters, digits, '.', '-' and '_'"
        )
    if settings.mode == "agent" and bool(settings.token_file) == bool(settings.token_secret):
        problems.append(
            f'{SECTION}: mode = "agent" needs exactly one of token_secret (a Secrets Manager secret the device '
            "reads through the Token Exchange Service) or token_file (a file already on the device)"
        )
    if settings.mode == "worker" and not settings.queue_url:
        problems.append(f'{SECTION}: mode = "worker" needs queue_url (the SQS queue the devices consume)')
    if settings.mode == "worker" and (settings.token_file or settings.token_secret):
        problems.append(f'{SECTION}: token_file / token_secret are for mode = "agent"; the worker has no agent API')
    if problems:
        raise UserError("\n".join(problems), exit_code=2)


def plan(spec: FunctionSpec, *, progress: StepProgress | None = None) -> AwsPlan:
    """Archive the bundle, write the artifacts, compare every resource with what exists. Touches nothing in AWS."""
    check_settings(spec)
    settings = spec.targets.greengrass
    context = aws.connect(TARGET, settings.region, settings.endpoint_url)
    _check_references(context, settings)
    progress = progress or StepProgress()
    with progress.step("artifacts", "archive the bundle and write the Greengrass artifacts"):
        archive = archive_bundle(bundle_dir(spec), build_dir(spec) / "edge")
        artifacts = build_artifacts(archive, state_dir(spec) / "artifacts")
    desired, table = resources(spec, context, artifacts)
    return AwsPlan(
        target=TARGET, function=spec.name, context=context, changes=aws.plan_changes(context, table, desired),
        removals=(), state_dir=state_dir(spec), bundle_digest=artifacts.bundle_digest,
        url=_url(settings, component_name(spec)), drivers=table,
    )  # fmt: skip


def _check_references(context: AwsContext, settings: GreengrassTarget) -> None:
    """The thing group and the token secret must exist: say so now rather than on the devices."""
    with aws.aws_errors(context, f"look up thing group {settings.thing_group}"):
        iot = context.client("iot")
        try:
            iot.describe_thing_group(thingGroupName=settings.thing_group)
        except iot.exceptions.ResourceNotFoundException as exc:
            raise UserError(
                f"{SECTION}.thing_group = {settings.thing_group!r}: no such thing group in {context.region}; "
                "create it (aws iot create-thing-group) and add the core devices, or fix the name",
                exit_code=2,
            ) from exc
    if settings.token_secret:
        with aws.aws_errors(context, f"look up secret {settings.token_secret}"):
            secrets = context.client("secretsmanager")
            try:
                secrets.describe_secret(SecretId=settings.token_secret)
            except secrets.exceptions.ResourceNotFoundException as exc:
                raise UserError(
                    f"{SECTION}.token_secret = {settings.token_secret!r}: no such secret in {context.region}; "
                    "create it with the agent token as its SecretString",
                    exit_code=2,
                ) from exc


def _url(settings: GreengrassTarget, component: str) -> str:
    return f"thinggroup/{settings.thing_group} {component}"


def _bucket(spec: FunctionSpec, context: AwsContext) -> str:
    return spec.targets.greengrass.bucket or bucket_name(spec.name, TARGET, context)


def _prefix(spec: FunctionSpec) -> str:
    return f"onnxfn/{spec.name}/{TARGET}"


def resources(
    spec: FunctionSpec, context: AwsContext, artifacts: Artifacts
) -> tuple[list[Resource], dict[str, Driver]]:
    settings = spec.targets.greengrass
    tags = aws.tags(spec.name, artifacts.bundle_digest, TARGET)
    bucket, name = _bucket(spec, context), component_name(spec)
    objects = {f"{bucket}/{_prefix(spec)}/{a.name}": a for a in artifacts.all()}
    uris = {a.name: f"s3://{key}" for key, a in objects.items()}
    component = ComponentSettings(
        name=name, function=spec.name, mode=settings.mode, port=settings.port,
        token_file=settings.token_file or "", token_secret=settings.token_secret or "",
        queue_url=settings.queue_url or "", region=context.region,
        install_timeout=settings.install_timeout_seconds, runtime_flags=tuple(server_flags(spec)),
    )  # fmt: skip
    digest = recipe_digest(recipe(component, artifacts, uris, "0.0.0"))
    tagging = urlencode(sorted(tags.items()))
    desired = [] if settings.bucket else [bucket_resource(bucket, tags)]
    desired += [Resource("s3-object", key, {"sha256": a.sha256, "size": a.size, "tagging": tagging})
                for key, a in objects.items()]  # fmt: skip
    desired.append(Resource("greengrass-component", name, {"recipe_digest": digest}))
    deployment = {
        "target_arn": context.arn("iot", f"thinggroup/{settings.thing_group}"), "recipe_digest": digest,
        "failure_handling": settings.failure_handling, "update_timeout": settings.update_timeout_seconds,
        "state": "live",
    }  # fmt: skip
    desired.append(Resource("greengrass-deployment", f"onnxfn-{spec.name}", deployment))
    table: dict[str, Driver] = {
        "s3-bucket": BucketDriver(),
        "s3-object": _ObjectDriver(ArtifactDriver({key: a.path for key, a in objects.items()})),
        "greengrass-component": ComponentDriver(lambda version: recipe(component, artifacts, uris, version), tags),
        "greengrass-deployment": DeploymentDriver(name, tags),
    }
    return desired, table


@dataclass(frozen=True)
class _ObjectDriver:
    """`ArtifactDriver` whose read leaves out what S3 cannot report back (the tagging string)."""

    inner: ArtifactDriver

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        current = self.inner.read(context, resource)
        return None if current is None else {**current, "tagging": resource.settings["tagging"]}

    def create(self, context: AwsContext, resource: Resource) -> None:
        self.inner.create(context, resource)

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        self.inner.update(context, resource, fields)

    def delete(self, context: AwsContext, name: str) -> bool:
        return self.inner.delete(context, name)


def apply(plan: AwsPlan) -> AwsDeployment:
    return aws.apply_plan(plan)


def status(spec: FunctionSpec) -> TargetStatus | None:
    deployment = aws.load_state(state_dir(spec))
    if deployment is None:
        return None
    row = partial(
        TargetStatus, target=TARGET, url=deployment.url, bundle_digest=deployment.bundle_digest, deployment=deployment
    )
    if deployment.outcome == "failed":
        return row(state="failed", detail=f"the last deploy stopped at: {deployment.failed_step}")
    context = aws.connect(TARGET, deployment.region, deployment.endpoint_url)
    settings, name = spec.targets.greengrass, component_name(spec)
    with aws.aws_errors(context, f"read the deployment of thing group {settings.thing_group}"):
        latest = latest_deployment(context, context.arn("iot", f"thinggroup/{settings.thing_group}"))
        if latest is None or name not in latest.get("components", {}):
            return row(state="missing", detail="the thing group's deployment no longer has it")
        devices = _device_outcomes(context, latest)
    state = {"COMPLETED": "ready", "ACTIVE": "updating", "FAILED": "failed"}.get(latest["deploymentStatus"], "missing")
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(devices.items())) or "no core devices reported"
    if state == "ready" and set(devices) - {"SUCCEEDED", "COMPLETED"}:
        state = "updating" if set(devices) & {"QUEUED", "IN_PROGRESS"} else "failed"
    detail = f"deployment {latest['deploymentId']} {latest['deploymentStatus']}; devices: {counts}"
    return row(state=state, detail=detail)


def _device_outcomes(context: AwsContext, latest: dict[str, Any]) -> Counter[str]:
    """How this deployment went on each core device of the group (the first `DEVICES_READ`)."""
    client = context.client("greengrassv2")
    listed = client.list_core_devices(thingGroupArn=latest["targetArn"], maxResults=DEVICES_READ)
    outcomes: Counter[str] = Counter()
    for device in listed.get("coreDevices", []):
        effective = client.list_effective_deployments(coreDeviceThingName=device["coreDeviceThingName"])
        for entry in effective.get("effectiveDeployments", []):
            if entry["deploymentId"] == latest["deploymentId"]:
                outcomes[entry["coreDeviceExecutionStatus"]] += 1
    return outcomes


def destroy(spec: FunctionSpec) -> list[str] | None:
    """Take the component off the thing group (a revision without it), cancel and delete this function's
    deployments, delete its component versions and artifacts. None if nothing existed."""
    deployment = aws.load_state(state_dir(spec))
    settings = spec.targets.greengrass
    region = deployment.region if deployment else settings.region
    context = aws.connect(TARGET, region, deployment.endpoint_url if deployment else settings.endpoint_url)
    name, client = component_name(spec), context.client("greengrassv2")
    target_arn = context.arn("iot", f"thinggroup/{settings.thing_group}")
    deleted: list[str] = []
    with aws.aws_errors(context, f"remove {name} from thing group {settings.thing_group}"):
        latest = latest_deployment(context, target_arn) if settings.thing_group else None
        if latest is not None and name in latest.get("components", {}):
            if latest["deploymentStatus"] == "ACTIVE":
                client.cancel_deployment(deploymentId=latest["deploymentId"])
            others = {k: v for k, v in latest["components"].items() if k != name}
            policies = deployment_policies(settings.failure_handling, settings.update_timeout_seconds)
            client.create_deployment(
                targetArn=target_arn, deploymentName=f"onnxfn-{spec.name}-removed", components=others,
                deploymentPolicies=policies, tags={aws.TAG_TARGET: TARGET},
            )  # fmt: skip
            deleted.append(f"greengrass-component {name} from thinggroup/{settings.thing_group}")
        for old in deployments_of(context, target_arn, spec.name) if settings.thing_group else []:
            if old["deploymentStatus"] == "ACTIVE":
                client.cancel_deployment(deploymentId=old["deploymentId"])
            client.delete_deployment(deploymentId=old["deploymentId"])
            deleted.append(f"greengrass-deployment {old['deploymentId']}")
        for version in component_versions(context, name):
            client.delete_component(arn=version["arn"])
            deleted.append(f"greengrass-component {name}@{version['componentVersion']}")
    deleted += _delete_artifacts(spec, context)
    (state_dir(spec) / "state.json").unlink(missing_ok=True)
    return deleted or None


def _delete_artifacts(spec: FunctionSpec, context: AwsContext) -> list[str]:
    bucket = _bucket(spec, context)
    if not spec.targets.greengrass.bucket:
        return aws.destroy_resources(context, {"s3-bucket": BucketDriver()}, [Resource("s3-bucket", bucket, {})])
    s3, prefix, deleted = context.client("s3"), _prefix(spec) + "/", []
    with aws.aws_errors(context, f"delete the artifacts under s3://{bucket}/{prefix}"):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                s3.delete_object(Bucket=bucket, Key=item["Key"])
                deleted.append(f"s3-object {bucket}/{item['Key']}")
    return deleted


class Greengrass(AwsTarget):
    name = TARGET
    steps: ClassVar[AwsTargetModule] = sys.modules[__name__]  # this module offers AwsTargetModule's functions

    def invoke(self, spec: FunctionSpec, path: str, body: dict[str, Any]) -> dict[str, Any]:
        settings = spec.targets.greengrass
        if settings.mode == "worker":
            raise self.refuse("invoke", f"the component serves {settings.queue_url}: pkg invoke --queue QUEUE_URL")
        raise self.refuse("invoke", f"each core device serves http://DEVICE:{settings.port}/v1 (the agent's own port)")

    def logs(
        self, spec: FunctionSpec, *, follow: bool, since_seconds: float | None, tail: int | None
    ) -> Iterator[LogLine]:
        where = f"/greengrass/v2/logs/{component_name(spec)}.log"
        raise self.refuse("logs", f"the log is {where} on each core device (or in CloudWatch with LogManager)")
