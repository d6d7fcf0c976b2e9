"""SnapStart's cycle on one machine, for `pkg bench cold`: CRIU stands in for Lambda's microVM snapshot.

`python -m runtime.aws_lambda.snapstart_emulation --port PORT` runs what Lambda runs when it publishes a
SnapStart version: the handler module's import (the init phase, which registers the hooks) and the
before-snapshot hooks, through awslambdaric's own hook runner (load the engine, restore the system-prompt KV,
warm it). It then serves the function's HTTP app on PORT (uvicorn, asyncio, httptools: what CRIU can dump), so
a client can see the first streamed token. The bench dumps this process once `/ready` answers; each restored
copy gets SIGUSR1 (what `packager.targets.local.process_snapshot.restore` sends) and runs the after-restore
hooks there, as awslambdaric does once `restore/next` answers, before any request is served.

Configuration is the handler's: `ONNXFN_BUNDLE` and `ONNXFN_FLAGS` (or `ONNXFN_BUNDLE_S3` and
`ONNXFN_BUNDLE_DIGEST`, fetched before the snapshot like on Lambda).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("runtime.aws_lambda")
RUNTIME_API_ENV = "AWS_LAMBDA_RUNTIME_API"  # runtime.aws_lambda.handler's: set, its import registers the hooks


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.aws_lambda.snapstart_emulation")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from runtime.aws_lambda.snapstart import INIT_TYPE_ENV  # (importing the handler here would run its init)

    os.environ[INIT_TYPE_ENV] = "snap-start"  # what Lambda sets while it prepares a snapshot
    os.environ.setdefault(RUNTIME_API_ENV, "snapstart-emulation")  # no Runtime API is called: hooks only
    started = time.monotonic()
    from awslambdaric import lambda_runtime_hooks_runner

    from runtime.aws_lambda import handler  # the init phase: registers the hooks

    lambda_runtime_hooks_runner.run_before_snapshot()
    log.info("SnapStart emulation: init phase and before-snapshot hooks took %.3f s", time.monotonic() - started)
    function = handler.loaded_function()

    def resumed(signum: int, frame: Any) -> None:
        began = time.monotonic()
        lambda_runtime_hooks_runner.run_after_restore()
        log.info("SnapStart emulation: after-restore hooks took %.3f s", time.monotonic() - began)

    signal.signal(signal.SIGUSR1, resumed)
    import uvicorn

    config = uvicorn.Config(
        function.app, host=args.host, port=args.port, loop="asyncio", http="httptools", lifespan="off",
        log_level="warning",
    )  # fmt: skip
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
