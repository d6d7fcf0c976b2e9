"""Build a started `QueueHandler` from flags: the engine, the HTTP handlers' state, and the AWS clients.

The AWS endpoint is configuration, never code: boto3 reads `AWS_ENDPOINT_URL` (and the per-service
`AWS_ENDPOINT_URL_SQS` / `_S3`) from the environment, and `--endpoint-url` overrides it.

Both queue frontends (the worker and the Lambda handler) also read their flags from `ONNXFN_FLAGS`, one
shell-quoted string, so one function configuration serves either; flags on a command line come after it.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.events.handler import QueueHandler
    from runtime.events.results import ResultStore


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
    return boto3.client(service, endpoint_url=args.endpoint_url, region_name=args.region, config=config)


def result_store(args: argparse.Namespace) -> ResultStore:
    """Where results go, with fresh AWS clients (a SnapStart restore rebuilds it: credentials change)."""
    from runtime.events.results import Ledger, ResultStore

    ledger = Ledger.from_uri(args.ledger) if args.ledger else None
    return ResultStore(aws_client("s3", args), aws_client("sqs", args), ledger)


def load_handler(bundle: Path, args: argparse.Namespace) -> QueueHandler:
    """Open the bundle, start its engine and return the handler every queue frontend runs messages through."""
    from runtime.bundle import read_manifest
    from runtime.events.handler import QueueHandler
    from runtime.server.serve import encoder_config, engine_config, fingerprint, request_policy, start_engine
    from runtime.server.state import ServerSettings, ServerState

    manifest = read_manifest(bundle)
    state = ServerState(ServerSettings(policy=request_policy(args, manifest), fingerprint=fingerprint(manifest)))
    results = result_store(args)
    if manifest.encoder is not None:  # an embedding or classification bundle
        from runtime.encoder.engine import start_encoder

        encoder = start_encoder(bundle, encoder_config(args), verify=not args.no_verify)
        state.engine = encoder  # type: ignore[assignment]  # the handlers need only stats() and shutdown() of either
    else:
        state.engine = start_engine(
            bundle,
            engine_config(args),
            verify=not args.no_verify,
            system_prompt=args.system_prompt,
            use_snapshot=not args.no_snapshot,
        )
    return QueueHandler(state, results)
