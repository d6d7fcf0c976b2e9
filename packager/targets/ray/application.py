"""`[targets.ray]` → the Serve application: its name and route, and the `args` its replicas are built from
(`runtime.ray_serve.settings.ReplicaSettings`). One function, so `pkg deploy` and the RayService of
`--emit-kubernetes` carry the same deployment options.

Serve's options, chosen for a continuous-batching engine:
- `max_ongoing_requests` = one decode batch running and at most one waiting inside the replica, within what
  the engine queues (min(2 x `runtime.max_batch`, `runtime.max_queue`): a burst of them all at once is
  queued, never a 429 from the replica): the rest wait in the proxy, where a replica the autoscaler adds
  picks them up, instead of queueing behind a busy engine;
- `max_queued_requests` with `backpressure_config` 429 + `Retry-After`: the proxy's bound, as the gateway's
  `max_waking_requests` is the local target's;
- `autoscaling_config`: min/max replicas, `target_ongoing_requests` (default one batch per replica), the delays
  before adding and removing replicas; with `min_replicas = 0` the last replica goes after `idle_timeout` and
  the next request starts one;
- `ray_actor_options`: CPUs, GPUs and custom resources per replica;
- `max_constructor_retry_count` small: a bundle that cannot load fails the deploy in seconds, not minutes.
"""

from __future__ import annotations

import re
from typing import Any

from packager.errors import UserError
from packager.runtime_flags import server_flags
from packager.spec import FunctionSpec, RayTarget
from runtime.ray_serve.settings import ReplicaSettings

TARGET = "ray"
SECTION = f"targets.{TARGET}"
IMPORT_PATH = "runtime.ray_serve.app:build"
CONSTRUCTOR_RETRIES = 3
GRACEFUL_SHUTDOWN_SECONDS = 10.0  # a replica removed by the autoscaler finishes its streams first
RETRY_AFTER_SECONDS = 1.0  # what a client told to wait by a full proxy queue waits
_ROUTE = re.compile(r"^/([A-Za-z0-9._~-]+(/[A-Za-z0-9._~-]+)*)?$")


def route_prefix(spec: FunctionSpec) -> str:
    return spec.targets.ray.route_prefix or f"/{spec.name}"


def check_settings(spec: FunctionSpec) -> None:
    """What the schema cannot say about `[targets.ray]`; every problem at once."""
    settings, problems = spec.targets.ray, []
    if settings.min_replicas > settings.max_replicas:
        problems.append(
            f"{SECTION}.min_replicas = {settings.min_replicas} is above max_replicas = {settings.max_replicas}"
        )
    if not _ROUTE.match(route_prefix(spec)):
        problems.append(
            f"{SECTION}.route_prefix = {route_prefix(spec)!r}: a path such as /{spec.name} (letters, digits, "
            "'.', '-', '_', '~' between slashes, no trailing slash)"
        )
    if settings.bundle_store is not None and not _valid_store(settings.bundle_store):
        problems.append(
            f"{SECTION}.bundle_store = {settings.bundle_store!r}: use s3://BUCKET/PREFIX or an absolute folder "
            "path that every node mounts"
        )
    if settings.address is not None and settings.bundle_store is None:
        problems.append(
            f"{SECTION}.address is set but bundle_store is not: the cluster's nodes fetch the bundle from it; "
            "set s3://BUCKET/PREFIX or a folder every node mounts"
        )
    for name in settings.resources:
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            problems.append(f"{SECTION}.resources: {name!r} is Ray's own; use num_cpus / num_gpus")
    if problems:
        raise UserError("\n".join(problems), exit_code=2)


def _valid_store(store: str) -> bool:
    if store.startswith("s3://"):
        bucket = store[5:].split("/", 1)[0]
        return bool(bucket)
    return store.startswith("/")


def max_ongoing_requests(spec: FunctionSpec) -> int:
    return max(1, min(2 * spec.runtime.max_batch, spec.runtime.max_queue))


def deployment_options(spec: FunctionSpec) -> dict[str, Any]:
    """Serve's deployment options for the function's replicas (plain JSON: they go into Serve configs too)."""
    settings = spec.targets.ray
    target = settings.target_ongoing_requests or float(spec.runtime.max_batch)
    actor: dict[str, Any] = {"num_cpus": settings.num_cpus}
    if settings.num_gpus:
        actor["num_gpus"] = settings.num_gpus
    if settings.resources:
        actor["resources"] = dict(settings.resources)
    return {
        "max_ongoing_requests": max_ongoing_requests(spec),
        "max_queued_requests": settings.max_queued_requests,
        "backpressure_config": {"status_code": 429, "retry_after_s": RETRY_AFTER_SECONDS},
        "autoscaling_config": {
            "min_replicas": settings.min_replicas,
            "initial_replicas": settings.min_replicas,
            "max_replicas": settings.max_replicas,
            "target_ongoing_requests": target,
            "upscale_delay_s": float(settings.upscale_delay),
            "downscale_delay_s": float(settings.idle_timeout),
        },
        "ray_actor_options": actor,
        "max_constructor_retry_count": CONSTRUCTOR_RETRIES,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_SECONDS,
    }


def replica_settings(spec: FunctionSpec, digest: str, store: str, *, api_key_env: str | None) -> ReplicaSettings:
    settings: RayTarget = spec.targets.ray
    flags = server_flags(spec) + [arg for name in settings.allowed_hosts for arg in ("--allowed-host", name)]
    return ReplicaSettings(
        function=spec.name,
        bundle_digest=digest,
        bundle_store=store,
        server_flags=flags,
        deployment=deployment_options(spec),
        cache_dir=settings.cache_dir,
        store_endpoint_url=settings.endpoint_url,
        store_region=settings.region,
        api_key_env=api_key_env,
    )


def describe_scaling(spec: FunctionSpec) -> str:
    settings = spec.targets.ray
    target = settings.target_ongoing_requests or spec.runtime.max_batch
    where = ", ".join(f"{k}={v:g}" for k, v in settings.resources.items())
    need = f"{settings.num_cpus:g} CPU" + (f", {settings.num_gpus:g} GPU" if settings.num_gpus else "")
    return (
        f"{settings.min_replicas}..{settings.max_replicas} replicas, {target:g} requests each, "
        f"{need}{', ' + where if where else ''}; idle {settings.idle_timeout} s"
    )
