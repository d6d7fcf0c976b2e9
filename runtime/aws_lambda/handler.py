"""AWS Lambda entry point (`runtime.aws_lambda.handler.handler`), run by `awslambdaric`.

One engine per execution environment serves both kinds of event: an SQS batch (`runtime.aws_lambda.sqs_batch`,
answered with `batchItemFailures`) and an HTTP event from API Gateway (REST or HTTP API), a function URL
or an ALB, answered by the HTTP server's app through mangum (`runtime.aws_lambda.function`). Anything
else is an error Lambda reports in its own format (`errorType`, `errorMessage`, `stackTrace`).

The engine loads in the init phase: Lambda imports this module before the first invocation, and the
import loads it (under SnapStart, the before-snapshot hook does, see `runtime.aws_lambda.snapstart`). Outside
Lambda (tests, a REPL) it loads on the first call instead.

Configuration is the environment: `ONNXFN_BUNDLE` (default `/opt/onnxfn/bundle`, where the image puts
it) and `ONNXFN_FLAGS`, the worker's model and AWS flags as one shell-quoted string. A zip package has no
bundle inside: `ONNXFN_BUNDLE_S3` and `ONNXFN_BUNDLE_DIGEST` name it in the function's bucket, and the init
phase fetches and verifies it (`runtime.aws_lambda.bundle_fetch`).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from runtime.aws_lambda import snapstart
from runtime.events.loading import FLAGS_ENV, add_aws_arguments, begin_handler, environment_flags

if TYPE_CHECKING:
    from runtime.aws_lambda.function import LambdaFunction

BUNDLE_ENV = "ONNXFN_BUNDLE"
LOG_LEVEL_ENV = "AWS_LAMBDA_LOG_LEVEL"  # the function's log level, when its logging configuration sets one
RUNTIME_API_ENV = "AWS_LAMBDA_RUNTIME_API"  # set by Lambda (and by whatever runs awslambdaric) for the runtime
DEFAULT_BUNDLE = "/opt/onnxfn/bundle"
# Seconds kept back from the invocation's deadline to cancel unfinished records and report them as failed.
DEADLINE_MARGIN = 5.0

_function: LambdaFunction | None = None


def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    function = loaded_function()
    from runtime.aws_lambda.sqs_batch import is_sqs_batch  # loaded with the function (see `loaded_function`)

    if is_sqs_batch(event):
        return function.sqs_batch(event["Records"], time_left=_time_left(context))
    if function.handles_http(event, context):
        return function.http(event, context)
    keys = sorted(event)[:10] if isinstance(event, dict) else type(event).__name__
    raise ValueError(
        f"unsupported Lambda event: expected an SQS batch or an HTTP event (API Gateway, function URL, ALB), got {keys}"
    )


def loaded_function() -> LambdaFunction:
    """The execution environment's function, loading it on the first call."""
    global _function
    if _function is None:
        logging.basicConfig(level=logging.INFO)  # a no-op under awslambdaric, which configures the root logger
        if LOG_LEVEL_ENV not in os.environ:  # awslambdaric leaves the root at WARNING: keep the start-up timeline
            logging.getLogger("runtime").setLevel(logging.INFO)
        args = lambda_arguments(environment_flags())
        bundle = _bundle(args)
        _adapters(args, bundle)
        pending = begin_handler(bundle, args)
        # The HTTP and queue stack imports (~0.2 s) while the model's session builds: this module imports
        # none of it, so that the build begins first.
        from runtime.aws_lambda.function import LambdaFunction

        _function = LambdaFunction.load(pending)
    return _function


def _bundle(args: argparse.Namespace) -> Path:
    """The image's bundle, or (zip package) the bundle fetched from S3 and verified file by file now."""
    from runtime.aws_lambda.bundle_fetch import BUNDLE_DIGEST_ENV, BUNDLE_S3_ENV

    if BUNDLE_S3_ENV not in os.environ:
        return Path(os.environ.get(BUNDLE_ENV, DEFAULT_BUNDLE))
    from runtime.aws_lambda.bundle_fetch import fetch_bundle
    from runtime.timeline import TIMELINE

    with TIMELINE.phase("bundle_fetch"):
        bundle = fetch_bundle(os.environ[BUNDLE_S3_ENV], os.environ.get(BUNDLE_DIGEST_ENV, ""))
    args.no_verify = True  # every file was hashed on its way from S3: hashing it again would only repeat that
    return bundle


def _adapters(args: argparse.Namespace, bundle: Path) -> None:
    """Adapters added with `pkg adapter add --target aws-lambda`: fetched into /tmp and verified, for the engine."""
    from runtime.adapters.s3_store import LAMBDA, fetch_adapters
    from runtime.timeline import TIMELINE

    with TIMELINE.phase("adapter_fetch"):
        fetch_adapters(args, bundle, target=LAMBDA)


class _FlagsParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # Lambda reports an exception raised at import as the init error; argparse's exit would hide the message.
        raise ValueError(f"${FLAGS_ENV}: {message}\n{self.format_usage()}")


def lambda_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """`ONNXFN_FLAGS` parsed with the same flags the worker takes for the model and AWS."""
    from runtime.startup import add_model_arguments

    parser = _FlagsParser(prog=FLAGS_ENV, description="flags for the Lambda handler", add_help=False)
    add_aws_arguments(parser)
    add_model_arguments(parser)
    return parser.parse_args(argv)


def _time_left(context: Any) -> float | None:
    remaining = getattr(context, "get_remaining_time_in_millis", None)
    return None if remaining is None else max(remaining() / 1000 - DEADLINE_MARGIN, 1.0)


def init_phase() -> None:
    """Runs at import: under Lambda (its Runtime API is set) the engine loads now, in the init phase."""
    if RUNTIME_API_ENV in os.environ:
        snapstart.initialize(lambda: loaded_function().engine, refresh=lambda: loaded_function().after_restore())


init_phase()
