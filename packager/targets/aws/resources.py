"""Drivers for the resources both AWS targets create: S3 bucket, ECR repository and image, IAM role, log group.

Each reads a resource back in the shape of its desired settings (so `plan` compares like with like),
creates it, updates the settings that differ, and deletes it (returning False if it was already gone).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from packager.errors import UserError
from packager.image.layout import INDEX_MEDIA_TYPE, MANIFEST_MEDIA_TYPE
from packager.image.registry import RegistryAuth, RegistryTarget, connect, push_layout
from packager.paths import bundle_dir
from packager.progress import StepProgress
from packager.spec import FunctionSpec
from packager.targets.aws.common import AwsContext, Resource, error_code, if_exists, tag_list
from runtime.bundle import BundleError, read_manifest

INLINE_POLICY = "onnxfn"


def _tags_of(entries: list[dict[str, str]], key: str = "Key", value: str = "Value") -> dict[str, str]:
    return {entry[key]: entry[value] for entry in entries}


class BucketDriver:
    """An S3 bucket: versioned, encrypted, closed to the public, old versions expiring."""

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        s3, name = context.client("s3"), resource.name
        if if_exists(lambda: s3.head_bucket(Bucket=name), "404", "NoSuchBucket", "NotFound") is None:
            return None
        current: dict[str, Any] = {"versioning": s3.get_bucket_versioning(Bucket=name).get("Status", "Disabled")}
        try:
            rules = s3.get_bucket_encryption(Bucket=name)["ServerSideEncryptionConfiguration"]["Rules"]
            current["encryption"] = rules[0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"]
        except ClientError:
            current["encryption"] = None
        try:
            block = s3.get_public_access_block(Bucket=name)["PublicAccessBlockConfiguration"]
            current["block_public_access"] = all(block.values())
        except ClientError:
            current["block_public_access"] = False
        try:
            rules = s3.get_bucket_lifecycle_configuration(Bucket=name)["Rules"]
            current["noncurrent_days"] = rules[0]["NoncurrentVersionExpiration"]["NoncurrentDays"]
        except (ClientError, KeyError, IndexError):
            current["noncurrent_days"] = None
        try:
            current["tags"] = _tags_of(s3.get_bucket_tagging(Bucket=name)["TagSet"])
        except ClientError:
            current["tags"] = {}
        return current

    def create(self, context: AwsContext, resource: Resource) -> None:
        location = {} if context.region == "us-east-1" else {"LocationConstraint": context.region}
        arguments: dict[str, Any] = {"Bucket": resource.name}
        if location:
            arguments["CreateBucketConfiguration"] = location
        context.client("s3").create_bucket(**arguments)
        self.update(context, resource, tuple(resource.settings))

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        s3, name, settings = context.client("s3"), resource.name, resource.settings
        if "versioning" in fields:
            s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": settings["versioning"]})
        if "encryption" in fields:
            rule = {"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": settings["encryption"]}}
            s3.put_bucket_encryption(Bucket=name, ServerSideEncryptionConfiguration={"Rules": [rule]})
        if "block_public_access" in fields:
            flag = bool(settings["block_public_access"])
            names = ("BlockPublicAcls", "IgnorePublicAcls", "BlockPublicPolicy", "RestrictPublicBuckets")
            s3.put_public_access_block(Bucket=name, PublicAccessBlockConfiguration=dict.fromkeys(names, flag))
        if "noncurrent_days" in fields:
            expiry = {
                "ID": "expire-old-versions", "Status": "Enabled", "Filter": {"Prefix": ""},
                "NoncurrentVersionExpiration": {"NoncurrentDays": settings["noncurrent_days"]},
                "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 7},
            }  # fmt: skip
            s3.put_bucket_lifecycle_configuration(Bucket=name, LifecycleConfiguration={"Rules": [expiry]})
        if "tags" in fields:
            s3.put_bucket_tagging(Bucket=name, Tagging={"TagSet": tag_list(settings["tags"])})

    def delete(self, context: AwsContext, name: str) -> bool:
        s3 = context.client("s3")
        try:
            pages = s3.get_paginator("list_object_versions").paginate(Bucket=name)
            for page in pages:
                doomed = [
                    {"Key": item["Key"], "VersionId": item["VersionId"]}
                    for item in page.get("Versions", []) + page.get("DeleteMarkers", [])
                ]
                if doomed:
                    s3.delete_objects(Bucket=name, Delete={"Objects": doomed, "Quiet": True})
            s3.delete_bucket(Bucket=name)
        except ClientError as exc:
            if error_code(exc) in ("NoSuchBucket", "404"):
                return False
            raise
        return True


class RepositoryDriver:
    """An ECR repository: immutable tags, scanned on push, encrypted, readable only by the service that runs it."""

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        ecr = context.client("ecr")
        repository = if_exists(
            lambda: ecr.describe_repositories(repositoryNames=[resource.name])["repositories"][0],
            "RepositoryNotFoundException",
        )
        if repository is None:
            return None
        try:
            repository_policy = json.loads(ecr.get_repository_policy(repositoryName=resource.name)["policyText"])
        except ClientError:
            repository_policy = None
        return {
            "tag_mutability": repository["imageTagMutability"],
            "scan_on_push": repository["imageScanningConfiguration"]["scanOnPush"],
            "encryption": repository.get("encryptionConfiguration", {}).get("encryptionType", "AES256"),
            "policy": repository_policy,
            "tags": _tags_of(ecr.list_tags_for_resource(resourceArn=repository["repositoryArn"])["tags"]),
        }

    def create(self, context: AwsContext, resource: Resource) -> None:
        settings = resource.settings
        context.client("ecr").create_repository(
            repositoryName=resource.name,
            imageTagMutability=settings["tag_mutability"],
            imageScanningConfiguration={"scanOnPush": settings["scan_on_push"]},
            encryptionConfiguration={"encryptionType": settings["encryption"]},
            tags=tag_list(settings["tags"]),
        )
        if settings["policy"] is not None:
            self.update(context, resource, ("policy",))

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        ecr, name, settings = context.client("ecr"), resource.name, resource.settings
        if "encryption" in fields:
            raise UserError(f"ECR cannot change the encryption of repository {name}: pkg destroy, then deploy again")
        if "tag_mutability" in fields:
            ecr.put_image_tag_mutability(repositoryName=name, imageTagMutability=settings["tag_mutability"])
        if "scan_on_push" in fields:
            ecr.put_image_scanning_configuration(
                repositoryName=name, imageScanningConfiguration={"scanOnPush": settings["scan_on_push"]}
            )
        if "policy" in fields:
            ecr.set_repository_policy(repositoryName=name, policyText=json.dumps(settings["policy"]))
        if "tags" in fields:
            arn = context.arn("ecr", f"repository/{name}")
            ecr.tag_resource(resourceArn=arn, tags=tag_list(settings["tags"]))

    def delete(self, context: AwsContext, name: str) -> bool:
        deleted = if_exists(
            lambda: context.client("ecr").delete_repository(repositoryName=name, force=True),
            "RepositoryNotFoundException",
        )
        return deleted is not None


@dataclass(frozen=True)
class ImageDriver:
    """The function's image in its ECR repository, pushed over the registry API from the local OCI layout.

    Its settings are the manifest digest the function runs; "reading" it asks the registry for that digest.
    """

    layout: Path
    registry: RegistryTarget

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        client, container = connect(self.registry)
        url = f"{client.prefix}://{container.manifest_url(resource.settings['digest'])}"
        response = client.do_request(url, "HEAD", headers={"Accept": f"{INDEX_MEDIA_TYPE}, {MANIFEST_MEDIA_TYPE}"})
        return dict(resource.settings) if response.status_code == 200 else None

    def create(self, context: AwsContext, resource: Resource) -> None:
        push_layout(self.layout, self.registry)

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        push_layout(self.layout, self.registry)

    def delete(self, context: AwsContext, name: str) -> bool:
        return False  # images go with their repository


class RoleDriver:
    """An IAM role with its trust policy and one inline policy naming exactly what the service may do."""

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        iam = context.client("iam")
        role = if_exists(lambda: iam.get_role(RoleName=resource.name)["Role"], "NoSuchEntity")
        if role is None:
            return None
        try:
            document = iam.get_role_policy(RoleName=resource.name, PolicyName=INLINE_POLICY)["PolicyDocument"]
        except ClientError:
            document = None
        return {
            "trust": _json(role["AssumeRolePolicyDocument"]),
            "policy": _json(document),
            "tags": _tags_of(iam.list_role_tags(RoleName=resource.name)["Tags"]),
        }

    def create(self, context: AwsContext, resource: Resource) -> None:
        context.client("iam").create_role(
            RoleName=resource.name,
            AssumeRolePolicyDocument=json.dumps(resource.settings["trust"]),
            Description=f"onnxfn {resource.settings['tags'].get('onnxfn:function', '')}: least privilege",
            Tags=tag_list(resource.settings["tags"]),
        )
        self.update(context, resource, ("policy",))

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        iam, name, settings = context.client("iam"), resource.name, resource.settings
        if "trust" in fields:
            iam.update_assume_role_policy(RoleName=name, PolicyDocument=json.dumps(settings["trust"]))
        if "policy" in fields:
            iam.put_role_policy(RoleName=name, PolicyName=INLINE_POLICY, PolicyDocument=json.dumps(settings["policy"]))
        if "tags" in fields:
            iam.tag_role(RoleName=name, Tags=tag_list(settings["tags"]))

    def delete(self, context: AwsContext, name: str) -> bool:
        iam = context.client("iam")
        try:
            for policy_name in iam.list_role_policies(RoleName=name)["PolicyNames"]:
                iam.delete_role_policy(RoleName=name, PolicyName=policy_name)
            iam.delete_role(RoleName=name)
        except ClientError as exc:
            if error_code(exc) == "NoSuchEntity":
                return False
            raise
        return True


def _json(document: Any) -> Any:
    """IAM returns documents as URL-decoded JSON (boto3 parses it) or as a string: compare them as objects."""
    return json.loads(document) if isinstance(document, str) else document


class LogGroupDriver:
    """A CloudWatch log group created ahead of the service, so its retention is ours rather than "forever"."""

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        logs = context.client("logs")
        groups = logs.describe_log_groups(logGroupNamePrefix=resource.name)["logGroups"]
        group = next((g for g in groups if g["logGroupName"] == resource.name), None)
        if group is None:
            return None
        return {
            "retention_days": group.get("retentionInDays"),
            "tags": logs.list_tags_log_group(logGroupName=resource.name).get("tags", {}),
        }

    def create(self, context: AwsContext, resource: Resource) -> None:
        context.client("logs").create_log_group(logGroupName=resource.name, tags=resource.settings["tags"])
        self.update(context, resource, ("retention_days",))

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        logs = context.client("logs")
        if "retention_days" in fields:
            logs.put_retention_policy(logGroupName=resource.name, retentionInDays=resource.settings["retention_days"])
        if "tags" in fields:
            logs.tag_log_group(logGroupName=resource.name, tags=resource.settings["tags"])

    def delete(self, context: AwsContext, name: str) -> bool:
        deleted = if_exists(
            lambda: context.client("logs").delete_log_group(logGroupName=name), "ResourceNotFoundException"
        )
        return deleted is not None


def bucket_resource(name: str, tags: dict[str, str]) -> Resource:
    settings = {"versioning": "Enabled", "encryption": "AES256", "block_public_access": True, "noncurrent_days": 30}
    return Resource("s3-bucket", name, {**settings, "tags": tags})


def repository_resource(name: str, repository_policy: dict[str, Any] | None, tags: dict[str, str]) -> Resource:
    settings = {"tag_mutability": "IMMUTABLE", "scan_on_push": True, "encryption": "AES256"}
    return Resource("ecr-repository", name, {**settings, "policy": repository_policy, "tags": tags})


def bucket_name(function: str, target: str, context: AwsContext) -> str:
    """Bucket names are global: the account and region make ours unique; S3 allows lowercase, digits and '-'."""
    name = f"onnxfn-{function}-{target.removeprefix('aws-')}-{context.account}-{context.region}".lower()
    return name.replace("_", "-")[:63].rstrip("-")


def image_registry(context: AwsContext, repository: str, tag: str) -> tuple[str, RegistryTarget]:
    """The repository URI the service pulls from, and where the image is pushed.

    `ONNXFN_ECR_REGISTRY_URL` (e.g. `http://127.0.0.1:5000`) sends the push to another registry that stands in
    for ECR's registry API (which local AWS endpoints lack); the function still names the ECR URI.
    """
    host = f"{context.account}.dkr.ecr.{context.region}.{context.dns_suffix}"
    override = os.environ.get("ONNXFN_ECR_REGISTRY_URL", "").strip()
    if override:
        scheme, _, address = override.rpartition("://")
        target = RegistryTarget(address.rstrip("/"), repository, tag, insecure=scheme == "http")
    else:
        target = RegistryTarget(host, repository, tag, auth=RegistryAuth.from_env())
    return f"{host}/{repository}", target


def bundle_digest(spec: FunctionSpec) -> str:
    try:
        return read_manifest(bundle_dir(spec)).digest
    except BundleError as exc:
        raise UserError(f"{exc}\nbuild it first: pkg build {spec.directory}") from exc


def function_image(spec: FunctionSpec, platform: str, out_dir: Path, progress: StepProgress) -> tuple[Path, str]:
    """The function's image for one platform (layers come from the cache when unchanged): its OCI layout and the
    platform manifest's digest, which is what Lambda and SageMaker run (neither takes an image index)."""
    from packager.image import build_image

    result = build_image(bundle_dir(spec), spec, platforms=(platform,), progress=progress, out_dir=out_dir)
    return result.layout, result.manifests[platform]
