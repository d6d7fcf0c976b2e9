"""`python -m packager.gateway --host H --port P`: the gateway process, as `pkg gateway start` runs it."""

from __future__ import annotations

import argparse
import logging
import os

from packager.gateway.control import DEFAULT_PORT
from packager.private_state import PRIVATE_UMASK


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m packager.gateway", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args()
    os.umask(PRIVATE_UMASK)  # its logs, records and snapshots, and what its servers write, are the user's alone
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per relayed request and /metrics read

    import uvicorn

    from packager.gateway.app import create_app
    from packager.gateway.functions import Registry
    from packager.paths import state_root
    from runtime.http.connection_limits import ConnectionLimits
    from runtime.http.connections import guarded_protocol

    # The runtime server's connection guards (431 past 64 KiB of head, 408 for a slow head or body, a cap on
    # open connections below `ulimit -n`): the gateway faces the same clients. httptools and asyncio's loop, as
    # there (runtime/http/serve.py says why); no access log: the functions' servers keep their own, and the
    # gateway logs what it decides (wakes, idle stops).
    limits = ConnectionLimits.for_process(ConnectionLimits().max_connections)
    uvicorn.run(
        create_app(Registry(state_root())),
        host=args.host,
        port=args.port,
        loop="asyncio",
        http=guarded_protocol(limits),
        backlog=limits.backlog,
        timeout_keep_alive=limits.keep_alive_timeout,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
