"""Build a started `QueueHandler` from flags: the model (through `runtime.startup`), its service, the AWS clients.

The AWS endpoint is configuration, never code: boto3 reads `AWS_ENDPOINT_URL` (and the per-service
`AWS_ENDPOINT_URL_SQS` / `_S3`) from the environment, and `--endpoint-url` overrides it.

Both queue frontends (the worker and the Lambda handler) also read their flags from `ONNXFN_FLAGS`, one
shell-quoted string, so one function configuration serves either; flags on a command line come after it.
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.events.handler import QueueHandler
    from runtime.events.results import ResultStore
    from runtime.startup import LoadingModel


FLAGS_ENV = "ONNXFN_FLAGS"


def environment_flags() -> list[str]:
    """`$ONNXFN_FLAGS`, split as the shell would."""
    return shlex.split(os.environ.get(FLAGS_ENV, ""))


def add_aws_arguments(parser: argparse.ArgumentParser) -> None:
    aws = parser.add_argument_group("AWS (unset: boto3's environment and config files)")
    aws.add_argument("--endpoint-url", help="AWS endpoint for S3 and SQS (default: $AWS_ENDPOINT_URL or AWS itself)")
    aws.add_argument("--region", help="AWS region (default: $AWS_REGION / $AWS_DEFAULT_REGION)")
    aws.add_argument(
        "--ledger",
        metavar="S3_URI",
        help="s3://BUCKET[/PREFIX] recording results sent to SQS reply queues (makes them exactly-once) "
        "and why each rejected message failed",
    )


def aws_client(service: str, args: argparse.Namespace, *, pool: int = 32) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(max_pool_connections=pool, retries={"mode": "standard", "max_attempts": 5})
    # boto3 reads only $AWS_DEFAULT_REGION; $AWS_REGION (what Lambda and the AWS CLI v2 set) comes first, as there.
    region = args.region or os.environ.get("AWS_REGION") or None
    return boto3.client(service, endpoint_url=args.endpoint_url, region_name=region, config=config)


def result_store(args: argparse.Namespace) -> ResultStore:
    """Where results go, with fresh AWS clients (a SnapStart restore rebuilds it: credentials change)."""
    from runtime.events.results import Ledger, ResultStore

    ledger = Ledger.from_uri(args.ledger) if args.ledger else None
    return ResultStore(aws_client("s3", args), aws_client("sqs", args), ledger)


@dataclass
class PendingHandler:
    """A queue handler whose model is loading on a helper thread (see `begin_handler`)."""

    args: argparse.Namespace
    loading: LoadingModel

    def finish(self) -> QueueHandler:
        """The handler: its service and AWS clients are built while the model loads, then the model is waited for."""
        from runtime.api.service import ModelService, ServiceSettings
        from runtime.events.handler import QueueHandler
        from runtime.startup import fingerprint, request_policy
        from runtime.timeline import TIMELINE

        manifest = self.loading.manifest
        policy = request_policy(self.args, manifest)
        service = ModelService(ServiceSettings(policy=policy, fingerprint=fingerprint(manifest)))
        with TIMELINE.phase("aws_clients"):
            results = result_store(self.args)
        service.engine = self.loading.engine.result()
        return QueueHandler(service, results)


def begin_handler(bundle: Path, args: argparse.Namespace) -> PendingHandler:
    """Start loading `bundle`'s model (`runtime.startup.begin_loading`); return once its session has begun
    building, so the handler stack, mangum, boto3 and its clients (~0.4 s of a Lambda init) import and build
    while it does."""
    from runtime.startup import begin_loading

    return PendingHandler(args, begin_loading(bundle, args))
