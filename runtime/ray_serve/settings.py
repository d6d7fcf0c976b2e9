"""What a replica is told: the Serve application's `args`, written by `pkg deploy --target ray` (and into a KubeRay
RayService's Serve config), read by `runtime.ray_serve.app:build` on the cluster.

The `args` are plain JSON, so the same dict deploys through `serve.run` and through a Serve config file:

    {"function": NAME, "bundle_digest": "sha256:…", "bundle_store": "s3://BUCKET/PREFIX" | "/shared/folder",
     "store_endpoint_url": null, "store_region": null, "cache_dir": "/tmp/onnxfn-bundles",
     "server_flags": ["--model-name", NAME, …], "api_key_env": null | "ONNXFN_API_KEY",
     "deployment": {Serve deployment options: autoscaling_config, max_ongoing_requests, max_queued_requests,
                    backpressure_config, ray_actor_options, …}}

Bundles lie in the store content-addressed: `STORE/bundles/HEX/` holds `manifest.json` and the files it lists.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CACHE_ENV = "ONNXFN_BUNDLE_CACHE"  # set on a node (ray start's environment, a pod's env): its bundle cache
DEFAULT_CACHE = "/tmp/onnxfn-bundles"
BUNDLES = "bundles"


@dataclass(frozen=True)
class ReplicaSettings:
    function: str
    bundle_digest: str
    bundle_store: str
    server_flags: list[str]
    deployment: dict[str, Any]
    cache_dir: str = DEFAULT_CACHE
    store_endpoint_url: str | None = None
    store_region: str | None = None
    api_key_env: str | None = None  # the variable the replica's environment holds the API key in

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> ReplicaSettings:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(args) - known)
        missing = sorted(k for k in ("function", "bundle_digest", "bundle_store", "server_flags", "deployment")
                         if k not in args)  # fmt: skip
        if unknown or missing:
            raise ValueError(
                f"onnxfn application args: unknown {unknown}, missing {missing}; `pkg deploy --target ray` writes them"
            )
        return cls(**args)

    def to_args(self) -> dict[str, Any]:
        return asdict(self)

    def bundle_location(self) -> str:
        """Where this digest's files lie in the store: `s3://BUCKET/PREFIX/bundles/HEX/` or `FOLDER/bundles/HEX/`."""
        return f"{self.bundle_store.rstrip('/')}/{BUNDLES}/{self.bundle_digest.removeprefix('sha256:')}/"

    def cache(self) -> Path:
        """The node's bundle cache: `$ONNXFN_BUNDLE_CACHE` where the node sets it, else `cache_dir`."""
        return Path(os.environ.get(CACHE_ENV) or self.cache_dir)
