"""The function as a Ray Serve application: `runtime.ray_serve.app:build` is the import path Serve configs name
(and `pkg deploy --target ray` calls), its `args` the `ReplicaSettings` of `runtime.ray_serve.settings`.

Each replica is one `FunctionReplica` actor: its constructor fetches the bundle and loads the model
(`runtime.ray_serve.function`) before Serve sends it a request, so a replica that Serve counts as running
answers at once, and one started to serve a request that arrived at zero replicas answers that request
(Serve's proxy holds it meanwhile). Requests reach the runtime's own ASGI app through Serve's ASGI ingress:
the same routes, SSE streaming, msgpack, auth and errors as `python -m runtime serve`.

How the deployment scales (`autoscaling_config`), how many requests a replica takes (`max_ongoing_requests`),
how many wait in the proxy before a 429 (`max_queued_requests`, `backpressure_config`) and what a replica
needs (`ray_actor_options`: CPUs, GPUs, custom resources) are Serve's own deployment options, in `args`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve
from ray.serve import Application

from runtime.ray_serve.function import StartedFunction, start_function
from runtime.ray_serve.settings import ReplicaSettings

SERVE_LOGGER = "ray.serve"  # Serve writes a replica's log file through this logger's handlers


@serve.ingress()
class FunctionReplica:
    """One replica of a function: the runtime's HTTP app around an engine loaded from the node's bundle cache."""

    async def __init__(self, args: dict[str, Any]) -> None:  # type: ignore[misc]  # Serve awaits an async one
        settings = ReplicaSettings.from_args(args)
        _log_to_replica_file()
        # Off the replica's event loop: Serve keeps answering its health and metrics calls meanwhile.
        self._started: StartedFunction = await asyncio.to_thread(start_function, settings)

    def __serve_build_asgi_app__(self) -> Any:
        return self._started.app

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose engine is gone is replaced."""
        service = self._started.service
        if service.engine is None:
            raise RuntimeError(f"the engine is not loaded: {service.load_error or 'unknown reason'}")


def _log_to_replica_file() -> None:
    """The runtime's own log lines (bundle fetch, load times, engine) into the replica's log file beside Serve's,
    where `pkg logs --target ray` reads them."""
    runtime_log = logging.getLogger("runtime")
    runtime_log.setLevel(logging.INFO)
    runtime_log.propagate = False
    for handler in logging.getLogger(SERVE_LOGGER).handlers:
        if handler not in runtime_log.handlers:
            runtime_log.addHandler(handler)


def build(args: dict[str, Any]) -> Application:
    """The application for one function; `args` as `pkg deploy --target ray` writes them."""
    settings = ReplicaSettings.from_args(args)
    deployment = serve.deployment(FunctionReplica).options(  # type: ignore[attr-defined]
        name=settings.function, **settings.deployment
    )
    return deployment.bind(settings.to_args())
