"""Drivers for the Greengrass target's resources: artifacts in S3, the component version, the deployment.

Component versions are immutable, so "updating" the component creates the next patch version; which version
holds which content is read back from its `onnxfn:recipe-digest` tag, never remembered. A thing group has
one deployment (revised by each new one) holding every component its devices run: a new revision carries
the group's other components over and replaces only this function's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from packager.targets.aws.common import TAG_FUNCTION, AwsContext, Resource, if_exists

TAG_RECIPE = "onnxfn:recipe-digest"
LIVE_STATES = ("ACTIVE", "COMPLETED")  # a deployment devices are applying or have applied
MAX_VERSIONS_READ = 50


def split_object(name: str) -> tuple[str, str]:
    bucket, _, key = name.partition("/")
    return bucket, key


@dataclass(frozen=True)
class ArtifactDriver:
    """One artifact in S3 (`bucket/key`), identified by the sha256 kept in its metadata."""

    files: dict[str, Path]  # resource name → local file

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        bucket, key = split_object(resource.name)
        s3 = context.client("s3")
        head = if_exists(lambda: s3.head_object(Bucket=bucket, Key=key), "404", "NoSuchKey", "NotFound", "NoSuchBucket")
        if head is None:
            return None
        return {"sha256": head.get("Metadata", {}).get("sha256"), "size": head.get("ContentLength")}

    def create(self, context: AwsContext, resource: Resource) -> None:
        bucket, key = split_object(resource.name)
        extra = {"Metadata": {"sha256": resource.settings["sha256"]}, "Tagging": resource.settings["tagging"]}
        context.client("s3").upload_file(str(self.files[resource.name]), bucket, key, ExtraArgs=extra)

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        self.create(context, resource)

    def delete(self, context: AwsContext, name: str) -> bool:
        bucket, key = split_object(name)
        deleted = if_exists(lambda: context.client("s3").delete_object(Bucket=bucket, Key=key), "NoSuchBucket", "404")
        return deleted is not None


def component_arn(context: AwsContext, name: str) -> str:
    return context.arn("greengrass", f"components:{name}")


def component_versions(context: AwsContext, name: str) -> list[dict[str, Any]]:
    """The versions of component `name`, newest first (empty when it does not exist)."""
    client = context.client("greengrassv2")
    pages = client.get_paginator("list_component_versions").paginate(arn=component_arn(context, name))
    versions = if_exists(
        lambda: [v for page in pages for v in page.get("componentVersions", [])], "ResourceNotFoundException"
    )
    if versions is None:
        return []
    return sorted(versions, key=lambda v: _semver(v["componentVersion"]), reverse=True)


def version_tags(context: AwsContext, version_arn: str) -> dict[str, str]:
    return dict(context.client("greengrassv2").describe_component(arn=version_arn).get("tags", {}))


def find_version(context: AwsContext, name: str, recipe_digest: str) -> str | None:
    """The version whose content is `recipe_digest`, if one was created before."""
    for entry in component_versions(context, name)[:MAX_VERSIONS_READ]:
        if version_tags(context, entry["arn"]).get(TAG_RECIPE) == recipe_digest:
            return str(entry["componentVersion"])
    return None


def _semver(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split("-")[0].split("."))


@dataclass(frozen=True)
class ComponentDriver:
    """The component version holding this recipe. `recipe(version)` renders the recipe for a version number."""

    recipe: Callable[[str], dict[str, Any]]
    tags: dict[str, str]

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        wanted = resource.settings["recipe_digest"]
        versions = component_versions(context, resource.name)
        if not versions:
            return None
        if find_version(context, resource.name, wanted) is not None:
            return dict(resource.settings)
        return {"recipe_digest": version_tags(context, versions[0]["arn"]).get(TAG_RECIPE)}

    def create(self, context: AwsContext, resource: Resource) -> None:
        versions = component_versions(context, resource.name)
        major, minor, patch = _semver(versions[0]["componentVersion"])[:3] if versions else (1, 0, -1)
        document = self.recipe(f"{major}.{minor}.{patch + 1}")
        context.client("greengrassv2").create_component_version(
            inlineRecipe=json.dumps(document, indent=2).encode(),
            tags={**self.tags, TAG_RECIPE: resource.settings["recipe_digest"]},
        )

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        self.create(context, resource)  # versions are immutable: the next one

    def delete(self, context: AwsContext, name: str) -> bool:
        versions = component_versions(context, name)
        for entry in versions:
            context.client("greengrassv2").delete_component(arn=entry["arn"])
        return bool(versions)


def latest_deployment(context: AwsContext, target_arn: str) -> dict[str, Any] | None:
    """The thing group's current deployment revision, in full (`get_deployment`)."""
    client = context.client("greengrassv2")
    listed = client.list_deployments(targetArn=target_arn, historyFilter="LATEST_ONLY").get("deployments", [])
    if not listed:
        return None
    return dict(client.get_deployment(deploymentId=listed[0]["deploymentId"]))


def deployment_policies(failure_handling: str, update_timeout: int) -> dict[str, Any]:
    return {
        "failureHandlingPolicy": failure_handling,
        "componentUpdatePolicy": {"timeoutInSeconds": update_timeout, "action": "NOTIFY_COMPONENTS"},
        "configurationValidationPolicy": {"timeoutInSeconds": 30},
    }


@dataclass(frozen=True)
class DeploymentDriver:
    """The thing group's deployment, holding the component version whose recipe digest the settings name."""

    component: str
    tags: dict[str, str]

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        latest = latest_deployment(context, resource.settings["target_arn"])
        if latest is None:
            return None
        entry = latest.get("components", {}).get(self.component)
        if entry is None:
            return {"recipe_digest": None}
        policies = latest.get("deploymentPolicies", {})
        version_arn = f"{component_arn(context, self.component)}:versions:{entry['componentVersion']}"
        try:
            digest = version_tags(context, version_arn).get(TAG_RECIPE)
        except ClientError:
            digest = None  # the version was deleted
        return {
            "target_arn": latest["targetArn"],
            "recipe_digest": digest,
            "failure_handling": policies.get("failureHandlingPolicy"),
            "update_timeout": policies.get("componentUpdatePolicy", {}).get("timeoutInSeconds"),
            "state": "live" if latest.get("deploymentStatus") in LIVE_STATES else latest.get("deploymentStatus"),
        }

    def create(self, context: AwsContext, resource: Resource) -> None:
        settings = resource.settings
        version = find_version(context, self.component, settings["recipe_digest"])
        if version is None:
            raise RuntimeError(f"no version of {self.component} holds recipe {settings['recipe_digest']}")
        latest = latest_deployment(context, settings["target_arn"])
        components = {
            name: _carried_over(entry) for name, entry in (latest or {}).get("components", {}).items()
        }  # other functions and Greengrass' own components on the group stay deployed
        components[self.component] = {"componentVersion": version}
        context.client("greengrassv2").create_deployment(
            targetArn=settings["target_arn"],
            deploymentName=resource.name,
            components=components,
            deploymentPolicies=deployment_policies(settings["failure_handling"], settings["update_timeout"]),
            tags=self.tags,
        )

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        self.create(context, resource)  # a new revision of the group's deployment

    def delete(self, context: AwsContext, name: str) -> bool:
        return False  # see `greengrass.destroy`: removal is a revision without the component


def _carried_over(entry: dict[str, Any]) -> dict[str, Any]:
    """A `get_deployment` component entry as `create_deployment` takes it (same shape, minus empty parts)."""
    return {k: v for k, v in entry.items() if v not in (None, {}, [])}


def deployments_of(context: AwsContext, target_arn: str, function: str) -> list[dict[str, Any]]:
    """Every deployment of the group (all revisions) this function's deploys created, newest first."""
    client = context.client("greengrassv2")
    pages = client.get_paginator("list_deployments").paginate(targetArn=target_arn, historyFilter="ALL")
    found = []
    for entry in (d for page in pages for d in page.get("deployments", [])):
        full = client.get_deployment(deploymentId=entry["deploymentId"])
        if full.get("tags", {}).get(TAG_FUNCTION) == function:
            found.append(dict(full))
    return found
