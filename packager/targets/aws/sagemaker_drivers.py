"""Drivers for the SageMaker target's resources: model artifact in S3, model, endpoint config, endpoint, and the
Application Auto Scaling target, policies and alarm. Same contract as `aws_resources`.

Models and endpoint configs cannot change in SageMaker: their names carry a digest of their settings, so a
changed setting is a new one (created) and the old one is deleted once the endpoint has switched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from packager.errors import UserError
from packager.targets.aws.common import AwsContext, Resource, error_code, if_exists, subset, tag_list, wait_until

SERVICE_NAMESPACE = "sagemaker"
DIMENSION = "sagemaker:variant:DesiredInstanceCount"
VARIANT = "AllTraffic"
ENDPOINT_WAIT_SECONDS = 1800.0
PREDEFINED_METRICS = {
    "invocations": "SageMakerVariantInvocationsPerInstance",
    "concurrency": "SageMakerVariantConcurrentRequestsPerModelHighResolution",
}


def _missing(exc: ClientError) -> bool:
    """SageMaker says ValidationException ("Could not find ...") for a name that does not exist."""
    return error_code(exc) in ("ValidationException", "ResourceNotFound") and "Could not find" in str(exc)


def _tags(context: AwsContext, arn: str) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in context.client("sagemaker").list_tags(ResourceArn=arn).get("Tags", [])}


class ArtifactDriver:
    """A model artifact in S3 (the Neuron-compiled model.tar.gz); its name is the s3:// URI, its setting a sha256."""

    def __init__(self, local_file: Path | None = None) -> None:
        self.local_file = local_file

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        bucket, key = resource.name.removeprefix("s3://").split("/", 1)
        head = if_exists(
            lambda: context.client("s3").head_object(Bucket=bucket, Key=key), "404", "NoSuchKey", "NotFound"
        )
        if head is None:
            return None
        return {"sha256": head.get("Metadata", {}).get("sha256")}

    def create(self, context: AwsContext, resource: Resource) -> None:
        if self.local_file is None:
            raise UserError(f"no local file to upload to {resource.name}")
        bucket, key = resource.name.removeprefix("s3://").split("/", 1)
        extra = {"Metadata": {"sha256": resource.settings["sha256"]}, "ServerSideEncryption": "AES256"}
        context.client("s3").upload_file(str(self.local_file), bucket, key, ExtraArgs=extra)

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        self.create(context, resource)

    def delete(self, context: AwsContext, name: str) -> bool:
        return False  # goes with the bucket


class ModelDriver:
    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        model = if_exists(lambda: context.client("sagemaker").describe_model(ModelName=resource.name), _missing)
        if model is None:
            return None
        container = model["PrimaryContainer"]
        return {
            "image": container["Image"],
            "role": model["ExecutionRoleArn"],
            "environment": container.get("Environment", {}),
            "model_data_url": container.get("ModelDataUrl"),
            "tags": _tags(context, model["ModelArn"]),
        }

    def create(self, context: AwsContext, resource: Resource) -> None:
        settings = resource.settings
        container: dict[str, Any] = {"Image": settings["image"], "Environment": settings["environment"]}
        if settings["model_data_url"]:
            container["ModelDataUrl"] = settings["model_data_url"]
        # The container needs no network: SageMaker pulls the image and model and moves async payloads itself.
        context.client("sagemaker").create_model(
            ModelName=resource.name, PrimaryContainer=container, ExecutionRoleArn=settings["role"],
            EnableNetworkIsolation=True, Tags=tag_list(settings["tags"]),
        )  # fmt: skip

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        _update_tags_only(context, resource, fields, context.arn("sagemaker", f"model/{resource.name.lower()}"))

    def delete(self, context: AwsContext, name: str) -> bool:
        deleted = if_exists(lambda: context.client("sagemaker").delete_model(ModelName=name), _missing)
        return deleted is not None


class EndpointConfigDriver:
    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        config = if_exists(
            lambda: context.client("sagemaker").describe_endpoint_config(EndpointConfigName=resource.name), _missing
        )
        if config is None:
            return None
        variant = config["ProductionVariants"][0]
        asynchronous = config.get("AsyncInferenceConfig")
        return {
            "model": variant["ModelName"],
            "instance_type": variant["InstanceType"],
            "initial_instances": variant["InitialInstanceCount"],
            "startup_timeout": variant.get("ContainerStartupHealthCheckTimeoutInSeconds"),
            "async": None if asynchronous is None else {
                "output": asynchronous["OutputConfig"]["S3OutputPath"],
                "failure": asynchronous["OutputConfig"].get("S3FailurePath"),
                "max_concurrent": asynchronous.get("ClientConfig", {}).get("MaxConcurrentInvocationsPerInstance"),
            },
            "tags": _tags(context, config["EndpointConfigArn"]),
        }  # fmt: skip

    def create(self, context: AwsContext, resource: Resource) -> None:
        settings = resource.settings
        variant = {
            "VariantName": VARIANT, "ModelName": settings["model"], "InstanceType": settings["instance_type"],
            "InitialInstanceCount": settings["initial_instances"],
            "ContainerStartupHealthCheckTimeoutInSeconds": settings["startup_timeout"],
        }  # fmt: skip
        arguments: dict[str, Any] = {
            "EndpointConfigName": resource.name, "ProductionVariants": [variant], "Tags": tag_list(settings["tags"]),
        }  # fmt: skip
        if settings["async"] is not None:
            arguments["AsyncInferenceConfig"] = {
                "OutputConfig": {"S3OutputPath": settings["async"]["output"],
                                 "S3FailurePath": settings["async"]["failure"]},
                "ClientConfig": {"MaxConcurrentInvocationsPerInstance": settings["async"]["max_concurrent"]},
            }  # fmt: skip
        context.client("sagemaker").create_endpoint_config(**arguments)

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        arn = context.arn("sagemaker", f"endpoint-config/{resource.name.lower()}")
        _update_tags_only(context, resource, fields, arn)

    def delete(self, context: AwsContext, name: str) -> bool:
        deleted = if_exists(
            lambda: context.client("sagemaker").delete_endpoint_config(EndpointConfigName=name), _missing
        )
        return deleted is not None


class EndpointDriver:
    """The endpoint; a new endpoint config switches it in place (UpdateEndpoint), with no downtime."""

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        endpoint = if_exists(
            lambda: context.client("sagemaker").describe_endpoint(EndpointName=resource.name), _missing
        )
        if endpoint is None:
            return None
        if endpoint["EndpointStatus"] == "Failed":
            raise UserError(
                f"SageMaker endpoint {resource.name} is in a failed state: "
                f"{endpoint.get('FailureReason', 'no reason given')}\n"
                f"a failed endpoint cannot be updated: fix the cause, run pkg destroy --target aws-sagemaker, "
                f"then deploy again"
            )
        return {"config": endpoint["EndpointConfigName"], "tags": _tags(context, endpoint["EndpointArn"])}

    def create(self, context: AwsContext, resource: Resource) -> None:
        context.client("sagemaker").create_endpoint(
            EndpointName=resource.name, EndpointConfigName=resource.settings["config"],
            Tags=tag_list(resource.settings["tags"]),
        )  # fmt: skip
        self.wait(context, resource.name)

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        if "config" in fields:
            context.client("sagemaker").update_endpoint(
                EndpointName=resource.name, EndpointConfigName=resource.settings["config"]
            )
            self.wait(context, resource.name)
        arn = context.arn("sagemaker", f"endpoint/{resource.name.lower()}")
        _update_tags_only(context, resource, tuple(f for f in fields if f == "tags"), arn)

    def delete(self, context: AwsContext, name: str) -> bool:
        deleted = if_exists(lambda: context.client("sagemaker").delete_endpoint(EndpointName=name), _missing)
        return deleted is not None

    @staticmethod
    def wait(context: AwsContext, name: str) -> None:
        def check() -> str | None:
            endpoint = context.client("sagemaker").describe_endpoint(EndpointName=name)
            status = endpoint["EndpointStatus"]
            if status == "Failed":
                raise UserError(f"SageMaker endpoint {name} failed: {endpoint.get('FailureReason', 'no reason given')}")
            return None if status == "InService" else status

        wait_until(check, f"SageMaker endpoint {name}", timeout=ENDPOINT_WAIT_SECONDS, poll=15.0)


def _update_tags_only(context: AwsContext, resource: Resource, fields: tuple[str, ...], arn: str) -> None:
    if set(fields) - {"tags"}:
        raise UserError(f"{resource.kind} {resource.name} cannot change in place ({', '.join(fields)})")
    if fields:
        context.client("sagemaker").add_tags(ResourceArn=arn, Tags=tag_list(resource.settings["tags"]))


class ScalableTargetDriver:
    """The variant's instance count as an Application Auto Scaling target: min and max from the spec.

    Its tags are sent on registration; they are not compared (scaling policies themselves take no tags)."""

    def __init__(self, tags: dict[str, str] | None = None) -> None:
        self.tags = tags or {}

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        found = context.client("application-autoscaling").describe_scalable_targets(
            ServiceNamespace=SERVICE_NAMESPACE, ResourceIds=[resource.name], ScalableDimension=DIMENSION
        )["ScalableTargets"]
        if not found:
            return None
        return {"min": found[0]["MinCapacity"], "max": found[0]["MaxCapacity"]}

    def create(self, context: AwsContext, resource: Resource) -> None:
        context.client("application-autoscaling").register_scalable_target(
            ServiceNamespace=SERVICE_NAMESPACE, ResourceId=resource.name, ScalableDimension=DIMENSION,
            MinCapacity=resource.settings["min"], MaxCapacity=resource.settings["max"], Tags=self.tags,
        )  # fmt: skip

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        self.create(context, resource)  # registering again updates min and max in place

    def delete(self, context: AwsContext, name: str) -> bool:
        client = context.client("application-autoscaling")
        found = client.describe_scalable_targets(
            ServiceNamespace=SERVICE_NAMESPACE, ResourceIds=[name], ScalableDimension=DIMENSION
        )["ScalableTargets"]
        if not found:
            return False
        client.deregister_scalable_target(
            ServiceNamespace=SERVICE_NAMESPACE, ResourceId=name, ScalableDimension=DIMENSION
        )
        return True


class ScalingPolicyDriver:
    """A target-tracking or step policy on the scalable target; PutScalingPolicy creates and updates alike."""

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        found_policy = _policy(context, resource.name, resource.settings["resource_id"])
        if found_policy is None:
            return None
        current: dict[str, Any] = {"resource_id": found_policy["ResourceId"], "type": found_policy["PolicyType"]}
        key = _configuration_key(found_policy["PolicyType"])
        # AWS adds defaults (DisableScaleIn, …) to what was sent: compare what this deploy sets.
        current["configuration"] = subset(found_policy.get(key, {}), resource.settings["configuration"])
        return current

    def create(self, context: AwsContext, resource: Resource) -> None:
        settings = resource.settings
        key = _configuration_key(settings["type"])
        context.client("application-autoscaling").put_scaling_policy(
            PolicyName=resource.name, ServiceNamespace=SERVICE_NAMESPACE, ResourceId=settings["resource_id"],
            ScalableDimension=DIMENSION, PolicyType=settings["type"], **{key: settings["configuration"]},
        )  # fmt: skip

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        self.create(context, resource)

    def delete(self, context: AwsContext, name: str) -> bool:
        existing = _policy(context, name, None)
        if existing is None:
            return False
        context.client("application-autoscaling").delete_scaling_policy(
            PolicyName=name, ServiceNamespace=SERVICE_NAMESPACE, ResourceId=existing["ResourceId"],
            ScalableDimension=DIMENSION,
        )  # fmt: skip
        return True


def _policy(context: AwsContext, name: str, resource_id: str | None) -> dict[str, Any] | None:
    """The named scaling policy; matched by name here, since not every implementation filters by PolicyNames."""
    arguments = {"ServiceNamespace": SERVICE_NAMESPACE, "PolicyNames": [name]}
    if resource_id is not None:
        arguments["ResourceId"] = resource_id
    found = context.client("application-autoscaling").describe_scaling_policies(**arguments)["ScalingPolicies"]
    return next((p for p in found if p["PolicyName"] == name), None)


def _configuration_key(policy_type: str) -> str:
    if policy_type == "TargetTrackingScaling":
        return "TargetTrackingScalingPolicyConfiguration"
    return "StepScalingPolicyConfiguration"


class AlarmDriver:
    """The CloudWatch alarm that wakes a scaled-to-zero async endpoint when requests wait with no instance."""

    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None:
        cloudwatch = context.client("cloudwatch")
        alarms = cloudwatch.describe_alarms(AlarmNames=[resource.name])["MetricAlarms"]
        if not alarms:
            return None
        alarm = alarms[0]
        tags = cloudwatch.list_tags_for_resource(ResourceARN=alarm["AlarmArn"]).get("Tags", [])
        return {
            "metric": alarm["MetricName"], "endpoint": alarm["Dimensions"][0]["Value"],
            "threshold": alarm["Threshold"], "periods": alarm["EvaluationPeriods"],
            "policy": next((a.rsplit("policyName/", 1)[-1] for a in alarm.get("AlarmActions", [])), None),
            "resource_id": resource.settings["resource_id"],
            "tags": {t["Key"]: t["Value"] for t in tags},
        }  # fmt: skip

    def create(self, context: AwsContext, resource: Resource) -> None:
        settings = resource.settings
        policy_arn = self._policy_arn(context, settings["policy"], settings["resource_id"])
        context.client("cloudwatch").put_metric_alarm(
            AlarmName=resource.name, MetricName=settings["metric"], Namespace="AWS/SageMaker",
            Dimensions=[{"Name": "EndpointName", "Value": settings["endpoint"]}], Statistic="Average", Period=60,
            EvaluationPeriods=settings["periods"], Threshold=settings["threshold"],
            ComparisonOperator="GreaterThanOrEqualToThreshold", TreatMissingData="missing",
            AlarmActions=[policy_arn], Tags=tag_list(settings["tags"]),
        )  # fmt: skip

    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None:
        self.create(context, resource)

    def delete(self, context: AwsContext, name: str) -> bool:
        cloudwatch = context.client("cloudwatch")
        if not cloudwatch.describe_alarms(AlarmNames=[name])["MetricAlarms"]:
            return False
        cloudwatch.delete_alarms(AlarmNames=[name])
        return True

    @staticmethod
    def _policy_arn(context: AwsContext, policy_name: str, resource_id: str) -> str:
        found = _policy(context, policy_name, resource_id)
        if found is None:
            raise UserError(f"scaling policy {policy_name} does not exist yet; deploy again to resume")
        return str(found["PolicyARN"])
