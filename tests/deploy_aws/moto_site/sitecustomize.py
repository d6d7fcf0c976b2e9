"""Loaded at start-up by the moto server that the AWS deploy tests launch (this folder is on its PYTHONPATH).

It fills four gaps of moto 5.2.5 as a local AWS endpoint, in the test server only, never in product code:
- Lambda ignores `SnapStart` (it always reports `ApplyOn: None`): keep what create/update set, and report
  `OptimizationStatus: On` for published versions of a function with `ApplyOn: PublishedVersions`, as Lambda does;
- SageMaker's instance-type list predates ml.g5 / ml.g6 / ml.g6e / ml.inf2: accept those families too;
- `UpdateEndpoint` is missing: switch the endpoint to the new endpoint config, as SageMaker does;
- fault injection: an endpoint whose name contains `fail-on-create` ends in the `Failed` state with a
  failure reason, as SageMaker reports a container that never passes its health check.
"""

from __future__ import annotations

import os
from typing import Any

EXTRA_FAMILIES = ("ml.g5.", "ml.g6.", "ml.g6e.", "ml.inf2.")
FAILING_MARKER = "fail-on-create"
FAILURE_REASON = "The primary container for production variant AllTraffic did not pass the ping health check."


def _patch() -> None:
    from moto.core.responses import ActionResult
    from moto.sagemaker import models, responses
    from moto.sagemaker.exceptions import ValidationError

    original_validate = models.FakeEndpointConfig.validate_instance_type

    def validate_instance_type(self: Any, instance_type: str) -> None:
        if not instance_type.startswith(EXTRA_FAMILIES):
            original_validate(self, instance_type)

    models.FakeEndpointConfig.validate_instance_type = validate_instance_type

    original_init = models.FakeEndpoint.__init__

    def endpoint_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if FAILING_MARKER in self.endpoint_name:
            self.endpoint_status = "Failed"
            self.failure_reason = FAILURE_REASON

    models.FakeEndpoint.__init__ = endpoint_init

    def update_endpoint(self: Any, endpoint_name: str, endpoint_config_name: str) -> str:
        endpoint = self.endpoints.get(endpoint_name)
        if endpoint is None:
            arn = models.FakeEndpoint.arn_formatter(endpoint_name, self.account_id, self.region_name)
            raise ValidationError(message=f'Could not find endpoint "{arn}".')
        if endpoint.endpoint_status == "Failed":
            raise ValidationError(message=f"Cannot update in-progress or failed endpoint {endpoint.arn}.")
        try:
            config = self.describe_endpoint_config(endpoint_config_name)
        except KeyError:
            arn = models.FakeEndpointConfig.arn_formatter(endpoint_config_name, self.account_id, self.region_name)
            raise ValidationError(message=f"Could not find endpoint_config '{arn}'.") from None
        endpoint.endpoint_config_name = endpoint_config_name
        endpoint.production_variants = endpoint._process_production_variants(config["ProductionVariants"])
        endpoint.last_modified_time = models.utcnow()
        return str(endpoint.arn)

    models.SageMakerModelBackend.update_endpoint = update_endpoint

    def update_endpoint_response(self: Any) -> Any:
        arn = self.sagemaker_backend.update_endpoint(
            endpoint_name=self._get_param("EndpointName"), endpoint_config_name=self._get_param("EndpointConfigName")
        )
        return ActionResult({"EndpointArn": arn})

    responses.SageMakerResponse.update_endpoint = update_endpoint_response


def _patch_snapstart() -> None:
    from moto.awslambda import models

    original_init = models.LambdaFunction.__init__

    def init(self: Any, account_id: str, spec: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        original_init(self, account_id, spec, *args, **kwargs)
        self.onnxfn_snapstart = (spec.get("SnapStart") or {}).get("ApplyOn", "None")

    original_update = models.LambdaFunction.update_configuration

    def update_configuration(self: Any, config_updates: dict[str, Any]) -> Any:
        if "SnapStart" in config_updates:
            self.onnxfn_snapstart = config_updates["SnapStart"].get("ApplyOn", "None")
        return original_update(self, config_updates)

    original_configuration = models.LambdaFunction.get_configuration

    def get_configuration(self: Any, on_create: bool = False) -> dict[str, Any]:
        config: dict[str, Any] = original_configuration(self, on_create)
        apply_on = getattr(self, "onnxfn_snapstart", "None")
        published = str(self.version) not in ("$LATEST", "0")
        status = "On" if apply_on == "PublishedVersions" and published else "Off"
        config["SnapStart"] = {"ApplyOn": apply_on, "OptimizationStatus": status}
        return config

    models.LambdaFunction.__init__ = init
    models.LambdaFunction.update_configuration = update_configuration
    models.LambdaFunction.get_configuration = get_configuration


if os.environ.get("ONNXFN_MOTO_PATCHES") == "1":
    _patch()
    _patch_snapstart()
