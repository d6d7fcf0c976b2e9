"""`pkg deploy --target ray --emit-kubernetes DIR`: the function as a KubeRay RayService (`ray.io/v1`).

One manifest, `rayservice.yaml`: the Serve config of this function (the same application `args` as `pkg deploy
--target ray` gives `serve.run`, from `application.py`), a head group (Serve's proxy and controller, no
replicas) and one worker group sized for one replica per pod, which KubeRay's autoscaler grows and shrinks
between `min_replicas` and `max_replicas` as Serve's autoscaler asks for replicas (zero pods at zero replicas).
GPUs become `nvidia.com/gpu` limits; a `neuron_cores` resource becomes `aws.amazon.com/neuroncore` (the AWS
Neuron device plugin's name); every custom resource is also given to the workers' `ray start`.

The image (`[targets.ray] image`) must hold Ray 2.60 and onnxfn's runtime (docs/targets/ray.md); the bundle is
not in it: the workers fetch it by digest from `bundle_store` into an `emptyDir` cache, so the bundle must be in
the store (this command uploads it when it is not). The API key comes from a Kubernetes Secret the user makes
(`onnxfn-NAME-api-key`, key `api-key`), never from the manifest.

What is checked here, offline: the pod templates against Kubernetes' own schemas (the tests run
kubernetes-validate), the Serve config by Ray itself (`ServeDeploySchema`, and the application built from it),
the image reference's form. What is not: that a cluster accepts the RayService (no API server here), KubeRay's
behaviour, pulling the image, the memory estimate below.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from packager.errors import UserError
from packager.paths import bundle_dir
from packager.progress import StepProgress
from packager.spec import FunctionSpec
from packager.targets.ray import store
from packager.targets.ray.application import IMPORT_PATH, SECTION, check_settings, replica_settings, route_prefix
from packager.targets.ray.nodes import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from runtime.bundle import BundleError, read_manifest
from runtime.ray_serve.settings import CACHE_ENV

RAY_VERSION = "2.60.0"
SERVE_PORT = 8000
CACHE_MOUNT = "/var/cache/onnxfn"
KEY_IN_SECRET = "api-key"
NEURON_RESOURCE = "neuron_cores"
# An image reference: [registry[:port]/]repository[:tag][@sha256:…]
_IMAGE = re.compile(
    r"^([a-z0-9.-]+(:[0-9]+)?/)?[a-z0-9]+([._/-][a-z0-9]+)*(:[\w][\w.-]{0,127})?(@sha256:[0-9a-f]{64})?$"
)
MANIFEST_FILE = "rayservice.yaml"


def write_rayservice(spec: FunctionSpec, out: Path, progress: StepProgress) -> list[Path]:
    check_settings(spec)
    settings = spec.targets.ray
    problems = []
    if not settings.image:
        problems.append(f"{SECTION}.image is not set: the RayService's pods run it (Ray {RAY_VERSION} with onnxfn's "
                        "runtime; docs/targets/ray.md shows its Dockerfile)")  # fmt: skip
    elif not _IMAGE.match(settings.image):
        problems.append(f"{SECTION}.image = {settings.image!r} is not an image reference (REGISTRY/REPOSITORY:TAG)")
    if not settings.bundle_store:
        problems.append(f"{SECTION}.bundle_store is not set: the pods fetch the bundle from it (s3://BUCKET/PREFIX)")
    if problems:
        raise UserError("\n".join(problems), exit_code=2)
    assert settings.bundle_store is not None and settings.image is not None
    try:
        manifest = read_manifest(bundle_dir(spec))
    except BundleError as exc:
        raise UserError(f"{exc}\nbuild it first: pkg build {spec.directory}") from exc
    with progress.step("bundle", "make sure the store holds the bundle the pods fetch") as step:
        if store.present(spec, settings.bundle_store, manifest.digest):
            step.cached()
        else:
            store.upload(spec, bundle_dir(spec), settings.bundle_store, manifest.digest)
    document = rayservice(spec, manifest.digest, settings.image, _bundle_bytes(spec))
    out.mkdir(parents=True, exist_ok=True)
    path = out / MANIFEST_FILE
    path.write_text(_yaml(document))
    return [path]


def serve_config(spec: FunctionSpec, digest: str) -> dict[str, Any]:
    """The RayService's `serveConfigV2`: Serve's own config schema, one application."""
    assert spec.targets.ray.bundle_store is not None
    key_env = spec.endpoint.api_key_env
    args = replica_settings(spec, digest, spec.targets.ray.bundle_store, api_key_env=key_env).to_args()
    args["cache_dir"] = CACHE_MOUNT
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": SERVE_PORT},
        "applications": [
            {"name": spec.name, "route_prefix": route_prefix(spec), "import_path": IMPORT_PATH, "args": args}
        ],
    }


def rayservice(spec: FunctionSpec, digest: str, image: str, bundle_bytes: int) -> dict[str, Any]:
    settings = spec.targets.ray
    labels = {"app.kubernetes.io/name": "onnxfn", "app.kubernetes.io/instance": spec.name,
              "onnxfn.dev/bundle": digest.removeprefix("sha256:")[:63]}  # fmt: skip
    env = _env(spec)
    head = {
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},  # replicas go to workers
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "containers": [
                    {
                        "name": "ray-head",
                        "image": image,
                        "env": env,
                        "ports": [
                            {"containerPort": 6379, "name": "gcs-server"},
                            {"containerPort": 8265, "name": "dashboard"},
                            {"containerPort": 10001, "name": "client"},
                            {"containerPort": SERVE_PORT, "name": "serve"},
                        ],
                        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
                    }
                ]
            },
        },
    }
    worker_params = {"num-cpus": str(max(1, math.ceil(settings.num_cpus)))}
    if settings.resources:
        worker_params["resources"] = json.dumps(json.dumps(settings.resources))  # KubeRay's quoting of a JSON map
    if settings.num_gpus:
        worker_params["num-gpus"] = str(math.ceil(settings.num_gpus))
    workers = {
        "groupName": "replicas",
        "replicas": settings.min_replicas,
        "minReplicas": settings.min_replicas,
        "maxReplicas": settings.max_replicas,
        "rayStartParams": worker_params,
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "containers": [
                    {
                        "name": "ray-worker",
                        "image": image,
                        "env": [*env, {"name": CACHE_ENV, "value": CACHE_MOUNT}],
                        "resources": _worker_resources(spec, bundle_bytes),
                        "volumeMounts": [{"name": "bundle-cache", "mountPath": CACHE_MOUNT}],
                    }
                ],
                "volumes": [{"name": "bundle-cache", "emptyDir": {}}],
            },
        },
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": f"onnxfn-{spec.name}", "labels": labels},
        "spec": {
            "serveConfigV2": _yaml(serve_config(spec, digest)),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "headGroupSpec": head,
                "workerGroupSpecs": [workers],
            },
        },
    }


def _env(spec: FunctionSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": PROXY_CALLBACK_ENV, "value": PROXY_CALLBACK}]
    if spec.endpoint.api_key_env:
        secret = {"name": f"onnxfn-{spec.name}-api-key", "key": KEY_IN_SECRET}
        env.append({"name": spec.endpoint.api_key_env, "valueFrom": {"secretKeyRef": secret}})
    return env


def memory_estimate_mib(spec: FunctionSpec, bundle_bytes: int) -> int:
    """A replica's memory: the bundle mapped, the fp32 prefill weights a CPU without int8 dot products derives
    (about four times a quantized bundle), the KV and prefix caches, and ~1 GiB for Ray's worker and the runtime.
    An estimate: measure a replica (`pkg status`, the pod's metrics) and set the limit from that."""
    derived = 4 * bundle_bytes if spec.export.prefill_graph else 0
    return math.ceil((bundle_bytes + derived) / 2**20) + spec.runtime.kv_memory_mb + spec.runtime.prefix_cache_mb + 1024


def _worker_resources(spec: FunctionSpec, bundle_bytes: int) -> dict[str, Any]:
    settings = spec.targets.ray
    memory = f"{memory_estimate_mib(spec, bundle_bytes)}Mi"
    limits: dict[str, Any] = {"memory": memory}
    if settings.num_gpus:
        limits["nvidia.com/gpu"] = str(math.ceil(settings.num_gpus))
    if NEURON_RESOURCE in settings.resources:
        limits["aws.amazon.com/neuroncore"] = str(math.ceil(settings.resources[NEURON_RESOURCE]))
    return {"requests": {"cpu": str(max(settings.num_cpus, 0.1)), "memory": memory}, "limits": limits}


def _bundle_bytes(spec: FunctionSpec) -> int:
    manifest = read_manifest(bundle_dir(spec))
    return sum(entry.size for entry in manifest.files.values())


def _yaml(document: dict[str, Any]) -> str:
    try:
        import yaml  # PyYAML comes with the `ray` extra
    except ImportError as exc:
        raise UserError("--emit-kubernetes needs the ray extra: pip install 'onnxfn[ray]'") from exc

    return str(yaml.safe_dump(document, sort_keys=False, width=120))
