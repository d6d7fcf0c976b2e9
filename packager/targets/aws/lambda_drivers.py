"""Drivers for the Lambda target's own resources: SQS queues, the function, its alias, URL, queue trigger and
provisioned concurrency. Same contract as `aws_resources`: read back in the shape of the desired settings."""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from packager.errors import UserError
from packager.targets.aws.common import AwsContext, Resource, error_code, if_exists, wait_until

PUBLIC_URL_STATEMENT = "onnxfn-public-function-url"
ROLE_PROPAGATION_SECONDS = 60.0  # a new IAM role takes a few seconds before Lambda may assume it
CODE_FIELDS = ("image_uri", "code_sha256", "architecture")
CONFIG_FIELDS = ("role", "memory_mb", "timeout_seconds", "ephemeral_storage_mb", "environment", "command", "runtime",
                 "handler", "snapstart")  # fmt: skip
VERSION_READY_SECONDS = 900.0  # publishing a SnapStart version runs the init phase and takes the snapshot


def _no_queue(exc: ClientError) -> bool:
    """SQS names a missing queue `AWS.SimpleQueueService.NonExistentQueue` or `QueueDoesNotExist`."""
    return "NonExistentQueue" in error_code(exc) or error_code(exc) == "QueueDoesNotExist"


class QueueDriver:
    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        sqs = context.client("sqs")
        url = if_exists(lambda: sqs.get_queue_url(QueueName=resource.name)["QueueUrl"], _no_queue)
        if url is None:
            return None
        attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
        redrive = json.loads(attributes["RedrivePolicy"]) if "RedrivePolicy" in attributes else None
        if redrive is not None:
            redrive["maxReceiveCount"] = int(redrive["maxReceiveCount"])
        return {
            "visibility_timeout": int(attributes["VisibilityTimeout"]),
            "retention_seconds": int(attributes["MessageRetentionPeriod"]),
            "sse": attributes.get("SqsManagedSseEnabled", "false") == "true",
            "redrive": redrive,
            "tags": sqs.list_queue_tags(QueueUrl=url).get("Tags", {}),
        }

    def create(self, context: AwsContext, resource: Resource) -> None:
        context.client("sqs").create_queue(
            QueueName=resource.name, Attributes=self._attributes(resource.settings), tags=resource.settings["tags"]
        )

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        sqs = context.client("sqs")
        url = sqs.get_queue_url(QueueName=resource.name)["QueueUrl"]
        sqs.set_queue_attributes(QueueUrl=url, Attributes=self._attributes(resource.settings))
        if "tags" in fields:
            sqs.tag_queue(QueueUrl=url, Tags=resource.settings["tags"])

    def delete(self, context: AwsContext, name: str) -> bool:
        sqs = context.client("sqs")
        deleted = if_exists(lambda: sqs.delete_queue(QueueUrl=sqs.get_queue_url(QueueName=name)["QueueUrl"]), _no_queue)
        return deleted is not None

    @staticmethod
    def _attributes(settings: dict[str, Any]) -> dict[str, str]:
        attributes = {
            "VisibilityTimeout": str(settings["visibility_timeout"]),
            "MessageRetentionPeriod": str(settings["retention_seconds"]),
            "SqsManagedSseEnabled": "true" if settings["sse"] else "false",
        }
        if settings["redrive"] is not None:
            attributes["RedrivePolicy"] = json.dumps(settings["redrive"])
        return attributes


@dataclass(frozen=True)
class S3UploadDriver:
    """Content-addressed objects in the function's bucket (the zip package, the bundle's files): the name is
    `BUCKET/KEY-OR-PREFIX`, the last file is written last and its presence says the upload is complete."""

    files: tuple[tuple[str, Path], ...]  # (key, local path)

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        bucket = resource.name.split("/", 1)[0]
        last = self.files[-1][0]
        found = if_exists(lambda: context.client("s3").head_object(Bucket=bucket, Key=last), "404", "NoSuchKey")
        return None if found is None else dict(resource.settings)

    def create(self, context: AwsContext, resource: Resource) -> None:
        bucket, s3 = resource.name.split("/", 1)[0], context.client("s3")
        for key, path in self.files:
            s3.upload_file(str(path), bucket, key)

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        self.create(context, resource)

    def delete(self, context: AwsContext, name: str) -> bool:
        return False  # objects go with their bucket


@dataclass(frozen=True)
class FunctionDriver:
    """The function from the ECR image or from the zip in `code_bucket` (settings with `code_sha256`): code,
    configuration and reserved concurrency update in place; the package type cannot change."""

    code_bucket: str = ""

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        function = if_exists(
            lambda: context.client("lambda").get_function(FunctionName=resource.name), "ResourceNotFoundException"
        )
        if function is None:
            return None
        config = function["Configuration"]
        if config.get("PackageType") == "Zip":
            return {
                "package": "Zip",
                "code_sha256": config.get("CodeSha256"),
                "runtime": config.get("Runtime"),
                "handler": config.get("Handler"),
                "snapstart": config.get("SnapStart", {}).get("ApplyOn", "None"),
                **self._common(function),
            }
        return {
            "package": "Image",
            "image_uri": function.get("Code", {}).get("ImageUri"),
            "command": config.get("ImageConfigResponse", {}).get("ImageConfig", {}).get("Command"),
            **self._common(function),
        }

    @staticmethod
    def _common(function: dict[str, Any]) -> dict[str, Any]:
        config = function["Configuration"]
        return {
            "role": config["Role"],
            "memory_mb": config["MemorySize"],
            "timeout_seconds": config["Timeout"],
            "architecture": (config.get("Architectures") or ["x86_64"])[0],
            "ephemeral_storage_mb": config.get("EphemeralStorage", {}).get("Size", 512),
            "environment": config.get("Environment", {}).get("Variables", {}),
            "reserved_concurrency": function.get("Concurrency", {}).get("ReservedConcurrentExecutions"),
            "tags": function.get("Tags", {}),
        }

    def create(self, context: AwsContext, resource: Resource) -> None:
        settings = resource.settings
        arguments = {
            "FunctionName": resource.name, **self._code(settings), "Architectures": [settings["architecture"]],
            "Tags": settings["tags"], "Publish": False, **self._configuration(settings),
        }  # fmt: skip
        if self._zip(settings):
            arguments["PackageType"] = "Zip"
        else:
            arguments["PackageType"] = "Image"
        deadline = time.monotonic() + ROLE_PROPAGATION_SECONDS
        while True:
            try:
                context.client("lambda").create_function(**arguments)
                break
            except ClientError as exc:
                propagating = error_code(exc) == "InvalidParameterValueException" and "assume" in str(exc)
                if not propagating or time.monotonic() > deadline:
                    raise
                time.sleep(3)
        self._wait(context, resource.name)
        if settings["reserved_concurrency"] is not None:
            self.update(context, resource, ("reserved_concurrency",))

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        client, name, settings = context.client("lambda"), resource.name, resource.settings
        if "package" in fields or (not self._zip(settings) and "image_uri" in fields):
            current = client.get_function_configuration(FunctionName=name).get("PackageType")
            wanted = "Zip" if self._zip(settings) else "Image"
            if current != wanted:
                raise UserError(
                    f"Lambda function {name} is a {current} package and this deploy makes a {wanted} package; Lambda "
                    f"cannot change a function's package type: pkg destroy it, then deploy again"
                )
        if any(f in CODE_FIELDS for f in fields):
            code = self._code(settings)["Code"]
            client.update_function_code(FunctionName=name, **code, Architectures=[settings["architecture"]])
            self._wait(context, name)
        if any(f in CONFIG_FIELDS for f in fields):
            client.update_function_configuration(FunctionName=name, **self._configuration(settings))
            self._wait(context, name)
        if "reserved_concurrency" in fields:
            if settings["reserved_concurrency"] is None:
                client.delete_function_concurrency(FunctionName=name)
            else:
                client.put_function_concurrency(
                    FunctionName=name, ReservedConcurrentExecutions=settings["reserved_concurrency"]
                )
        if "tags" in fields:
            client.tag_resource(Resource=context.arn("lambda", f"function:{name}"), Tags=settings["tags"])

    def delete(self, context: AwsContext, name: str) -> bool:
        deleted = if_exists(
            lambda: context.client("lambda").delete_function(FunctionName=name), "ResourceNotFoundException"
        )
        return deleted is not None

    @staticmethod
    def _zip(settings: dict[str, Any]) -> bool:
        return "code_sha256" in settings

    def _code(self, settings: dict[str, Any]) -> dict[str, Any]:
        if not self._zip(settings):
            return {"Code": {"ImageUri": settings["image_uri"]}}
        sha256 = base64.b64decode(settings["code_sha256"]).hex()
        return {"Code": {"S3Bucket": self.code_bucket, "S3Key": f"code/{sha256}.zip"}}

    @classmethod
    def _configuration(cls, settings: dict[str, Any]) -> dict[str, Any]:
        configuration = {
            "Role": settings["role"],
            "MemorySize": settings["memory_mb"],
            "Timeout": settings["timeout_seconds"],
            "EphemeralStorage": {"Size": settings["ephemeral_storage_mb"]},
            "Environment": {"Variables": settings["environment"]},
        }
        if cls._zip(settings):
            return {**configuration, "Runtime": settings["runtime"], "Handler": settings["handler"],
                    "SnapStart": {"ApplyOn": settings["snapstart"]}}  # fmt: skip
        return {**configuration, "ImageConfig": {"Command": settings["command"]}}

    @staticmethod
    def _wait(context: AwsContext, name: str) -> None:
        """Lambda refuses the next change while one is in progress; a failed update names its reason."""

        def check() -> str | None:
            config = context.client("lambda").get_function_configuration(FunctionName=name)
            if config.get("State") == "Failed" or config.get("LastUpdateStatus") == "Failed":
                reason = config.get("LastUpdateStatusReason") or config.get("StateReason") or "no reason given"
                raise UserError(f"Lambda function {name} is in a failed state: {reason}")
            if config.get("State") == "Pending" or config.get("LastUpdateStatus") == "InProgress":
                return f"{config.get('State')} / {config.get('LastUpdateStatus')}"
            return None

        wait_until(check, f"Lambda function {name}", timeout=600, poll=2.0)


class AliasDriver:
    """The `live` alias: a version published from the function's settings, named by their digest."""

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        function, alias = resource.name.split(":")
        found = if_exists(
            lambda: context.client("lambda").get_alias(FunctionName=function, Name=alias), "ResourceNotFoundException"
        )
        if found is None:
            return None
        return {"config_digest": str(found.get("Description", "")).removeprefix("onnxfn config ")}

    def create(self, context: AwsContext, resource: Resource) -> None:
        self._point(context, resource, "create_alias")

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        self._point(context, resource, "update_alias")

    def _point(self, context: AwsContext, resource: Resource, operation: str) -> None:
        """Publish a version of the current settings and point the alias at it (`create_alias`/`update_alias`)."""
        function, alias = resource.name.split(":")
        version = self._publish(context, function, resource.settings["config_digest"])
        getattr(context.client("lambda"), operation)(
            FunctionName=function, Name=alias, FunctionVersion=version, Description=self._describe(resource)
        )

    def delete(self, context: AwsContext, name: str) -> bool:
        function, alias = name.split(":")
        deleted = if_exists(
            lambda: context.client("lambda").delete_alias(FunctionName=function, Name=alias),
            "ResourceNotFoundException",
        )
        return deleted is not None

    @staticmethod
    def _publish(context: AwsContext, function: str, digest: str) -> str:
        """Publish a version and wait until it can be invoked: with SnapStart, Lambda runs the init phase and takes
        the snapshot now (the version is Pending meanwhile), and a failing init fails the version with its reason."""
        client = context.client("lambda")
        version = str(client.publish_version(FunctionName=function, Description=f"onnxfn config {digest}")["Version"])

        def check() -> str | None:
            config = client.get_function_configuration(FunctionName=function, Qualifier=version)
            if config.get("State") == "Failed":
                reason = config.get("StateReason") or "no reason given"
                raise UserError(f"version {version} of Lambda function {function} failed: {reason}")
            return None if config.get("State", "Active") == "Active" else str(config.get("State"))

        wait_until(check, f"version {version} of Lambda function {function}", timeout=VERSION_READY_SECONDS, poll=3.0)
        return version

    @staticmethod
    def _describe(resource: Resource) -> str:
        return f"onnxfn config {resource.settings['config_digest']}"


class FunctionUrlDriver:
    """The function URL on the alias, streaming responses; `NONE` auth also needs a public invoke permission."""

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        function, alias = resource.name.split(":")
        config = if_exists(
            lambda: context.client("lambda").get_function_url_config(FunctionName=function, Qualifier=alias),
            "ResourceNotFoundException",
        )
        if config is None:
            return None
        return {"auth_type": config["AuthType"], "invoke_mode": config.get("InvokeMode", "BUFFERED")}

    def create(self, context: AwsContext, resource: Resource) -> None:
        function, alias = resource.name.split(":")
        context.client("lambda").create_function_url_config(
            FunctionName=function, Qualifier=alias, **self._arguments(resource.settings)
        )
        self._permission(context, resource)

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        function, alias = resource.name.split(":")
        context.client("lambda").update_function_url_config(
            FunctionName=function, Qualifier=alias, **self._arguments(resource.settings)
        )
        self._permission(context, resource)

    def delete(self, context: AwsContext, name: str) -> bool:
        function, alias = name.split(":")
        deleted = if_exists(
            lambda: context.client("lambda").delete_function_url_config(FunctionName=function, Qualifier=alias),
            "ResourceNotFoundException",
        )
        return deleted is not None

    @staticmethod
    def _arguments(settings: dict[str, Any]) -> dict[str, Any]:
        return {"AuthType": settings["auth_type"], "InvokeMode": settings["invoke_mode"]}

    @staticmethod
    def _permission(context: AwsContext, resource: Resource) -> None:
        function, alias = resource.name.split(":")
        client = context.client("lambda")
        if_exists(
            lambda: client.remove_permission(FunctionName=function, Qualifier=alias, StatementId=PUBLIC_URL_STATEMENT),
            "ResourceNotFoundException",
        )
        if resource.settings["auth_type"] == "NONE":
            client.add_permission(
                FunctionName=function, Qualifier=alias, StatementId=PUBLIC_URL_STATEMENT,
                Action="lambda:InvokeFunctionUrl", Principal="*", FunctionUrlAuthType="NONE",
            )  # fmt: skip


class EventSourceDriver:
    """The SQS trigger of the alias; its name is the queue's. Partial batch failures are always reported."""

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        mapping = self._find(context, resource.settings["queue_arn"])
        if mapping is None:
            return None
        return {
            "queue_arn": mapping["EventSourceArn"],
            "function_arn": self._as_alias(context, mapping["FunctionArn"], resource.settings["function_arn"]),
            "batch_size": mapping["BatchSize"],
            "batch_window_seconds": mapping.get("MaximumBatchingWindowInSeconds", 0),
            "response_types": mapping.get("FunctionResponseTypes", []),
            "max_concurrency": mapping.get("ScalingConfig", {}).get("MaximumConcurrency"),
        }

    def create(self, context: AwsContext, resource: Resource) -> None:
        settings = resource.settings
        context.client("lambda").create_event_source_mapping(
            EventSourceArn=settings["queue_arn"], FunctionName=settings["function_arn"], Enabled=True,
            **self._arguments(settings),
        )  # fmt: skip

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        mapping = self._find(context, resource.settings["queue_arn"])
        if mapping is None:
            raise UserError(f"the SQS trigger of {resource.name} disappeared during the deploy; deploy again")
        context.client("lambda").update_event_source_mapping(
            UUID=mapping["UUID"], FunctionName=resource.settings["function_arn"], **self._arguments(resource.settings)
        )

    def delete(self, context: AwsContext, name: str) -> bool:
        mapping = self._find(context, context.arn("sqs", name))
        if mapping is None:
            return False
        context.client("lambda").delete_event_source_mapping(UUID=mapping["UUID"])
        return True

    @staticmethod
    def _as_alias(context: AwsContext, current: str, alias_arn: str) -> str:
        """Some Lambda implementations report the version an alias resolved to rather than the alias: the same
        target as long as the alias still points at that version."""
        base, _, alias = alias_arn.rpartition(":")
        current_base, _, qualifier = current.rpartition(":")
        if current == alias_arn or current_base != base or not qualifier.isdigit():
            return current
        found = context.client("lambda").get_alias(FunctionName=base, Name=alias)
        return alias_arn if found["FunctionVersion"] == qualifier else current

    @staticmethod
    def _find(context: AwsContext, queue_arn: str) -> dict[str, Any] | None:
        mappings = context.client("lambda").list_event_source_mappings(EventSourceArn=queue_arn)
        return next(iter(mappings.get("EventSourceMappings", [])), None)

    @staticmethod
    def _arguments(settings: dict[str, Any]) -> dict[str, Any]:
        arguments: dict[str, Any] = {
            "BatchSize": settings["batch_size"],
            "MaximumBatchingWindowInSeconds": settings["batch_window_seconds"],
            "FunctionResponseTypes": settings["response_types"],
        }
        if settings["max_concurrency"] is not None:
            arguments["ScalingConfig"] = {"MaximumConcurrency": settings["max_concurrency"]}
        return arguments


class ProvisionedConcurrencyDriver:
    """Instances kept initialised on the alias: no cold start for the first `count` concurrent requests."""

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        function, alias = resource.name.split(":")
        config = if_exists(
            lambda: context.client("lambda").get_provisioned_concurrency_config(FunctionName=function, Qualifier=alias),
            "ProvisionedConcurrencyConfigNotFoundException",
        )
        if config is None:
            return None
        return {"count": config["RequestedProvisionedConcurrentExecutions"]}

    def create(self, context: AwsContext, resource: Resource) -> None:
        function, alias = resource.name.split(":")
        context.client("lambda").put_provisioned_concurrency_config(
            FunctionName=function, Qualifier=alias, ProvisionedConcurrentExecutions=resource.settings["count"]
        )

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        self.create(context, resource)

    def delete(self, context: AwsContext, name: str) -> bool:
        function, alias = name.split(":")
        deleted = if_exists(
            lambda: context.client("lambda").delete_provisioned_concurrency_config(
                FunctionName=function, Qualifier=alias
            ),
            "ProvisionedConcurrencyConfigNotFoundException",
            "ResourceNotFoundException",
        )
        return deleted is not None
